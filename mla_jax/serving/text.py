"""A choice's text as its tokens come: what can be sent now, and where a stop string cuts it."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def stop_cut(text: str, stop: Sequence[str]) -> int | None:
  """Where the first stop string in ``text`` begins (OpenAI's text ends before it), or None."""
  found = [i for i in (text.find(s) for s in stop) if i >= 0]
  return min(found) if found else None


def _pending_stop(text: str, stop: Sequence[str]) -> int:
  """How many characters at the end of ``text`` could begin a stop string (held back until
  the next tokens tell)."""
  return max((n for s in stop for n in range(min(len(s) - 1, len(text)), 0, -1)
              if text.endswith(s[:n])), default=0)


class TextStream:
  """Incremental text of one choice: ``update`` with all its output tokens so far returns the
  text not sent before. Until the request finishes it holds back an incomplete UTF-8 character
  (the decoder's U+FFFD) and a tail that could begin a stop string; the text ends before the
  first stop string."""

  def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
    self.decode, self.stop = decode, tuple(stop)
    self.text = ""  # sent so far

  def update(self, tokens: Sequence[int], finished: bool) -> str:
    text = self.decode(tokens)
    cut = stop_cut(text, self.stop)
    if cut is not None:
      text = text[:cut]
    elif not finished:
      text = text.rstrip("\ufffd")
      text = text[:len(text) - _pending_stop(text, self.stop)]
    if not text.startswith(self.text) or len(text) <= len(self.text):
      return ""  # nothing new (or a decoder that rewrote earlier text: keep what was sent)
    delta, self.text = text[len(self.text):], text
    return delta
