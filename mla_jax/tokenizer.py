"""Tokenizers behind one interface: a checkpoint's own and a byte-level one.

- ``HFTokenizer``: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` library, with
  BOS / EOS from ``tokenizer_config.json`` and ``generation_config.json``.
- ``ByteTokenizer``: ids 0-255 are UTF-8 bytes, so text prompts work on the built-in presets
  with no downloads.

Both have ``encode(text) -> ids`` (BOS first where the tokenizer adds one), ``decode(ids) ->
text`` (special tokens dropped), ``bos_id``, ``eos_ids`` (a tuple: some models end on any of
several tokens) and ``max_id``, the largest id they can produce.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from pathlib import Path

import tokenizers

from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.generation_config import read_generation_config
from mla_jax.checkpoints.reading import read_json_object

TOKENIZER_FILE, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


class Tokenizer(abc.ABC):
  bos_id: int | None
  eos_ids: tuple[int, ...]

  @abc.abstractmethod
  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``, BOS first where the tokenizer adds one (``add_special_tokens``
    False: none added, for text that spells its own, as a rendered chat template does)."""

  @abc.abstractmethod
  def decode(self, ids) -> str:
    """Text of ``ids``; special tokens are dropped."""

  def decoder_keeping(self, texts) -> Callable[[Sequence[int]], str]:
    """A ``decode`` that keeps the special tokens spelled as one of ``texts`` (a parser's
    tags, such as GLM's ``<tool_call>``), dropping the others."""
    return self.decode

  def special_ids(self) -> dict[str, int]:
    """The special tokens spelled as text (their ids by text): none here."""
    return {}

  @property
  @abc.abstractmethod
  def max_id(self) -> int:
    """The largest id ``encode`` can return."""

  def check_fits(self, vocab_size: int) -> None:
    """Every id the tokenizer can produce must index the model's vocabulary."""
    largest = max(self.max_id, *self.eos_ids, self.bos_id or 0)
    if largest >= vocab_size:
      raise ValueError(f"{self.describe()} has ids up to {largest}, but the model's vocabulary "
                       f"has {vocab_size} entries (ids 0-{vocab_size - 1}): they do not belong "
                       "together")

  @abc.abstractmethod
  def describe(self) -> str:
    """Where the tokenizer comes from, for messages."""


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as ids 0-255, then BOS 256, EOS 257, PAD 258."""

  BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
  VOCAB_SIZE = 259

  def __init__(self):
    self.bos_id, self.eos_ids = self.BOS_ID, (self.EOS_ID,)

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return [self.BOS_ID] * add_special_tokens + list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    """Invalid UTF-8 is replaced."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  @property
  def max_id(self) -> int:
    return self.VOCAB_SIZE - 1

  def describe(self) -> str:
    return "the byte tokenizer"


def special_token(file: Path, config: dict, key: str) -> str | None:
  """A ``tokenizer_config.json`` special token: a string or HF's AddedToken dict."""
  value = config.get(key)
  if isinstance(value, dict):
    value = value.get("content")
  if value is not None and not isinstance(value, str):
    raise CheckpointError(f"{file}: {key} must be a string or an object with a 'content' "
                          f"string, got {config[key]!r}")
  return value


class HFTokenizer(Tokenizer):
  """A checkpoint's ``tokenizer.json``.

  ``encode`` applies the tokenizer's own post-processor (HF saves the BOS template there)
  and puts BOS first when ``tokenizer_config.json`` says ``add_bos_token: true`` and the
  template did not. BOS is ``tokenizer_config.json``'s ``bos_token``, else
  ``generation_config.json``'s ``bos_token_id``; EOS is ``generation_config.json``'s
  ``eos_token_id`` (one id or a list, what HF's ``generate`` stops on), else
  ``tokenizer_config.json``'s ``eos_token``.
  """

  def __init__(self, directory: str | Path):
    directory = Path(directory)
    self.file = directory / TOKENIZER_FILE
    try:
      self.tokenizer = tokenizers.Tokenizer.from_file(str(self.file))
    except Exception as e:  # the library raises a bare Exception for unreadable files
      raise CheckpointError(f"{self.file}: not a tokenizers file ({e})") from None
    self._special: dict[int, str] | None = None  # special tokens' texts, once asked
    config_file = directory / TOKENIZER_CONFIG
    config = read_json_object(config_file) or {}
    generation = read_generation_config(directory)
    self.add_bos = config.get("add_bos_token", False)
    if not isinstance(self.add_bos, bool):
      raise CheckpointError(f"{config_file}: add_bos_token must be true or false, got "
                            f"{self.add_bos!r}")
    bos_token = special_token(config_file, config, "bos_token")
    eos_token = special_token(config_file, config, "eos_token")
    self.bos_id = self._id(config_file, bos_token) if bos_token else generation.bos_id
    self.eos_ids = generation.eos_ids or (
        (self._id(config_file, eos_token),) if eos_token else ())
    if self.add_bos and self.bos_id is None:
      raise CheckpointError(f"{config_file}: add_bos_token is true but no BOS token is given")

  def _id(self, file: Path, token: str) -> int:
    token_id = self.tokenizer.token_to_id(token)
    if token_id is None:
      raise CheckpointError(f"{file}: special token {token!r} is not in {self.file}")
    return token_id

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    if add_special_tokens and self.add_bos and ids[:1] != [self.bos_id]:
      ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

  def special_ids(self) -> dict[str, int]:
    return {text: i for i, text in self._specials().items()}

  def _specials(self) -> dict[int, str]:
    if self._special is None:
      self._special = {i: t.content for i, t in
                       self.tokenizer.get_added_tokens_decoder().items() if t.special}
    return self._special

  def decoder_keeping(self, texts) -> Callable[[Sequence[int]], str]:
    self._specials()
    if not set(self._special.values()) & set(texts):  # nothing to keep: the plain decode
      return self.decode
    dropped = {i for i, content in self._special.items() if content not in texts}

    def decode(ids) -> str:
      return self.tokenizer.decode([int(i) for i in ids if int(i) not in dropped],
                                   skip_special_tokens=False)

    return decode

  @property
  def max_id(self) -> int:
    return max(self.tokenizer.get_vocab(with_added_tokens=True).values())

  def describe(self) -> str:
    return f"tokenizer {self.file}"


def checkpoint_tokenizer(directory: str | Path) -> Tokenizer:
  """The tokenizer of a checkpoint directory: its ``tokenizer.json`` if there is one, else
  the byte tokenizer."""
  if (Path(directory) / TOKENIZER_FILE).is_file():
    return HFTokenizer(directory)
  return ByteTokenizer()
