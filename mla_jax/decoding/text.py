"""A growing token list's text, decoded a few tokens at a time, and where a stop string cuts it.

Decoding the whole output after every token costs time quadratic in its length. Here each
``extend`` decodes a short window: the tokens from the last complete character's boundary
(so multi-token characters and tokenizers that merge across tokens come out right, as vLLM's
incremental detokenizer does), and a stop string is searched for only in the new text and the
tail before it that a stop string could straddle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"  # what decoders give for a character whose bytes have not all come


class IncrementalText:
  """The text of the tokens given so far (``text``), and the first stop string in it.

  ``decode`` maps token ids to text; ``stop``: strings whose first occurrence ends the text
  (``stop_at``: the index where it begins, ``stop_end`` where it ends; None until one
  appears). Text is appended only once its characters are complete: a trailing U+FFFD waits
  for the tokens after it (the complete characters before it go at once), and ``flush`` takes
  it as it is when no more will come.
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
    self.decode, self.stop = decode, tuple(stop)
    self.text = ""
    self.stop_at: int | None = None
    self.stop_end: int | None = None
    self._tokens: list[int] = []
    self._prefix = 0  # tokens before it are in ``text``; it starts a complete character
    self._read = 0    # tokens before it are decoded into ``text``
    self._partial = 0  # characters of the window past ``_read`` already in ``text``
    self._reach = max((len(s) for s in self.stop), default=1) - 1

  def extend(self, tokens: Sequence[int]) -> str:
    """Appends ``tokens``; returns the text they completed (possibly empty)."""
    self._tokens.extend(tokens)
    return self._advance(final=False)

  def flush(self) -> str:
    """The text still held back (an incomplete last character, as the decoder renders it)."""
    return self._advance(final=True)

  def _advance(self, *, final: bool) -> str:
    if self._read == len(self._tokens):
      return ""
    before = self.decode(self._tokens[self._prefix:self._read])
    window = self.decode(self._tokens[self._prefix:])[len(before):]
    waiting = not final and window.endswith(INCOMPLETE)
    complete = window.rstrip(INCOMPLETE) if waiting else window
    new = complete[self._partial:]
    if waiting:  # the window's tokens are decoded again once the character is whole
      self._partial = len(complete)
    else:
      self._prefix, self._read, self._partial = self._read, len(self._tokens), 0
    if not new:
      return ""
    start = max(len(self.text) - self._reach, 0)
    self.text += new
    if self.stop and self.stop_at is None:
      found = [(i, -len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
      if found:  # the earliest; of those starting there, the longest
        self.stop_at, minus_length = min(found)
        self.stop_end = self.stop_at - minus_length
    return new

  def pending_stop(self) -> int:
    """How many characters at the end of ``text`` could begin a stop string (a stream holds
    them back until the next tokens tell)."""
    return max((n for s in self.stop for n in range(min(len(s) - 1, len(self.text)), 0, -1)
                if self.text.endswith(s[:n])), default=0)
