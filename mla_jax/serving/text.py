"""A choice's text as its tokens come: what can be sent now, and where a stop string cuts it
(``decoding.text.IncrementalText`` decodes only the new tokens)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mla_jax.decoding.text import IncrementalText


class TextStream:
  """Incremental text of one choice: ``update`` with all its output tokens so far returns the
  text not sent before. Until the request finishes it holds back an incomplete UTF-8 character
  and a tail that could begin a stop string; the text ends before the first stop string (after
  it with ``include_stop``)."""

  def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), *,
               include_stop: bool = False):
    self._decoded = IncrementalText(decode, stop)
    self._include_stop = include_stop
    self._fed = 0   # tokens given to the decoder
    self.text = ""  # sent so far

  def update(self, tokens: Sequence[int], finished: bool) -> str:
    decoded = self._decoded
    decoded.extend(tokens[self._fed:])
    self._fed = len(tokens)
    if finished:
      decoded.flush()
    if decoded.stop_at is not None:
      text = decoded.text[:decoded.stop_end if self._include_stop else decoded.stop_at]
    elif finished:
      text = decoded.text
    else:
      text = decoded.text[:len(decoded.text) - decoded.pending_stop()]
    if len(text) <= len(self.text):
      return ""
    delta, self.text = text[len(self.text):], text
    return delta
