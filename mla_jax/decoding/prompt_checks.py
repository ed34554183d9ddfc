"""The checks of a request's prompt that ``generate``, the engine and the server share: each
refuses bad input by name, before anything is queued or built."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from mla_jax.checks import is_int


class ContextLengthError(ValueError):
  """A prompt and its tokens to generate do not fit the context (OpenAI's
  ``context_length_exceeded``)."""


def checked_prompt(prompt, vocab_size: int, name: str = "prompt") -> list[int]:
  """``prompt`` (a sequence of token ids, or a 1-d int array) as a list of ints, each in
  ``[0, vocab_size)``; a ``TypeError`` or ``ValueError`` naming ``name`` otherwise: not a
  sequence, empty, an id that is not an int (its type named), an id outside the
  vocabulary."""
  if isinstance(prompt, np.ndarray):
    prompt = prompt.tolist()
  if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
    raise TypeError(f"{name} must be a list of int ids, got {type(prompt).__name__}")
  ids = list(prompt)
  if not ids:
    raise ValueError(f"{name} is empty; every prompt needs at least one token")
  wrong_type = [t for t in ids if not is_int(t)]
  if wrong_type:
    raise TypeError(f"{name} holds {type(wrong_type[0]).__name__} values ({wrong_type[:3]}); "
                    "token ids must be ints")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"{name} has ids outside [0, {vocab_size}): token id {bad[0]} is outside "
                     "the vocabulary")
  return [int(t) for t in ids]


def check_fits(num_prompt: int, max_tokens: int, context: int, name: str = "prompt") -> None:
  """A ``ContextLengthError`` when ``num_prompt`` tokens and ``max_tokens`` new ones exceed
  ``context``."""
  if num_prompt + max_tokens > context:
    raise ContextLengthError(f"{name} of {num_prompt} tokens + max_tokens {max_tokens} = "
                             f"{num_prompt + max_tokens} exceeds the model's context of "
                             f"{context} tokens")
