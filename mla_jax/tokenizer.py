"""A byte-level tokenizer, so text prompts work with no downloads (ids 0-255 are bytes)."""

from __future__ import annotations

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 259


def encode(text: str, *, add_bos: bool = True) -> list[int]:
  ids = list(text.encode("utf-8"))
  return [BOS_ID, *ids] if add_bos else ids


def decode(ids) -> str:
  """Bytes back to text; special ids are dropped, invalid UTF-8 is replaced."""
  return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
