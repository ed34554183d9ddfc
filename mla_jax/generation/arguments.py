"""A generation request checked before anything is built or traced: its arguments, its
prompts padded into one batch, and the cache it needs.

Every refusal names the argument. NumPy integer scalars count as ints wherever Python ints
do (``checks.is_int``) and leave here as Python ints, so nothing downstream sees them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import numpy as np

from mla_jax.cache import resolve_cache_dtype
from mla_jax.checks import is_int
from mla_jax.decoding.prompt_checks import checked_prompt
from mla_jax.decoding.protocol import check_decode_model
from mla_jax.decoding.sampling import SamplingConfig
from mla_jax.decoding.speculative import MAX_SPECULATIVE_TOKENS


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
  """One ``generate`` call's checked arguments; ``ids_BT`` right-padded with zeros."""

  ids_BT: np.ndarray  # int32 [B, T]
  lens_B: np.ndarray  # int32 [B], every entry >= 1
  max_new_tokens: int
  capacity: int  # cache rows per sequence
  cache_dtype: object
  sampling: SamplingConfig
  eos_id: tuple[int, ...] | None
  seed: int
  steps_per_dispatch: int
  checked: bool
  speculative_tokens: int = 0  # draft tokens per iteration; 0: plain decoding

  @property
  def batch(self) -> int:
    return self.ids_BT.shape[0]

  @property
  def longest(self) -> int:
    return self.ids_BT.shape[1]


def _positive_int(value, name: str) -> int:
  if not is_int(value) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def pad_prompts(prompt_ids, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Ragged prompts (id lists or an int array [B, T] / [T]) as ``(ids_BT, lens_B)``."""
  if isinstance(prompt_ids, (np.ndarray, jax.Array)):
    prompt_ids = np.asarray(prompt_ids)
    if not np.issubdtype(prompt_ids.dtype, np.integer) or prompt_ids.ndim not in (1, 2):
      raise TypeError(f"prompt_ids must be an int array [batch, tokens] or [tokens], got "
                      f"{prompt_ids.dtype} of shape {list(prompt_ids.shape)}")
    prompt_ids = [prompt_ids.tolist()] if prompt_ids.ndim == 1 else prompt_ids.tolist()
  if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Iterable):
    raise TypeError(f"prompt_ids must be a list of id lists or an int array, got "
                    f"{type(prompt_ids).__name__}")
  prompts = list(prompt_ids)
  if not prompts:
    raise ValueError("prompt_ids holds no prompt")
  prompts = [checked_prompt(p, vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
  lens_B = np.array([len(p) for p in prompts], np.int32)
  ids_BT = np.zeros((len(prompts), lens_B.max()), np.int32)
  for i, p in enumerate(prompts):
    ids_BT[i, :len(p)] = p
  return ids_BT, lens_B


def eos_ids(eos_id, vocab_size: int) -> tuple[int, ...] | None:
  """``eos_id`` as a tuple of ids (a tokenizer may have several end-of-sequence tokens)."""
  if eos_id is None:
    return None
  ids = tuple(eos_id) if isinstance(eos_id, (list, tuple)) else (eos_id,)
  if not ids or not all(is_int(i) and 0 <= i < vocab_size for i in ids):
    raise ValueError(f"eos_id must be an id in [0, {vocab_size}) or a non-empty list of them, "
                     f"got {eos_id!r}")
  return tuple(int(i) for i in ids)


def check_speculative_tokens(model, speculative_tokens, return_logits: bool = False) -> int:
  """``speculative_tokens`` as an int in [0, ``MAX_SPECULATIVE_TOKENS``]; above 0 the model
  needs MTP layers to draft with."""
  limit = MAX_SPECULATIVE_TOKENS
  if not is_int(speculative_tokens) or not 0 <= speculative_tokens <= limit:
    raise ValueError(f"speculative_tokens must be an int in [0, {limit}] (draft tokens per "
                     f"verify step), got {speculative_tokens!r}")
  speculative_tokens = int(speculative_tokens)
  if speculative_tokens and model.num_mtp_layers < 1:
    raise ValueError(f"speculative_tokens={speculative_tokens} drafts with the model's MTP "
                     "layers, but it has none (config.num_mtp_layers is 0): load a checkpoint "
                     "that has them with load_pretrained(..., mtp=True)")
  if speculative_tokens and return_logits:
    raise ValueError("return_logits is not supported with speculative_tokens > 0")
  return speculative_tokens


def check_request(model, prompt_ids, max_new_tokens, *, temperature, top_p, seed, eos_id,
                  cache_capacity, cache_dtype, steps_per_dispatch, checks,
                  speculative_tokens=0, return_logits=False) -> Request:
  """``generate``'s arguments checked and normalised; see ``generate`` for their meaning."""
  check_decode_model(model)
  max_new_tokens = _positive_int(max_new_tokens, "max_new_tokens")
  speculative_tokens = check_speculative_tokens(model, speculative_tokens, return_logits)
  if not is_int(seed) or not 0 <= seed < 2**32:
    raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
  steps_per_dispatch = _positive_int(steps_per_dispatch, "steps_per_dispatch")
  sampling = SamplingConfig(temperature, top_p)
  eos_id = eos_ids(eos_id, model.vocab_size)
  if cache_capacity is not None and (not is_int(cache_capacity) or cache_capacity < 1):
    raise ValueError(f"cache_capacity must be None or a positive int, got {cache_capacity!r}")
  cache_dtype = resolve_cache_dtype(cache_dtype, "cache_dtype")
  if not isinstance(checks, bool):
    raise TypeError(f"checks must be a bool, got {type(checks).__name__}")
  ids_BT, lens_B = pad_prompts(prompt_ids, model.vocab_size)
  longest = ids_BT.shape[1]
  # A verify step writes its k draft rows past the last token before any is accepted.
  needed = longest + max_new_tokens + speculative_tokens
  max_positions = model.max_positions
  if cache_capacity is None and needed > max_positions:
    raise ValueError(f"prompt of {longest} tokens plus {max_new_tokens} new tokens"
                     f"{_drafts(speculative_tokens)} needs {needed} positions, more than "
                     f"max_position_embeddings {max_positions}")
  capacity = needed if cache_capacity is None else int(cache_capacity)
  if needed > capacity:
    raise ValueError(f"prompt of {longest} tokens plus {max_new_tokens} new tokens"
                     f"{_drafts(speculative_tokens)} needs {needed} cache rows, more than "
                     f"cache_capacity {capacity}")
  if capacity > max_positions:
    raise ValueError(f"cache_capacity {capacity} exceeds max_position_embeddings "
                     f"{max_positions}")
  return Request(ids_BT=ids_BT, lens_B=lens_B, max_new_tokens=max_new_tokens,
                 capacity=capacity, cache_dtype=cache_dtype, sampling=sampling, eos_id=eos_id,
                 seed=int(seed), steps_per_dispatch=steps_per_dispatch, checked=checks,
                 speculative_tokens=speculative_tokens)


def _drafts(speculative_tokens: int) -> str:
  return f" and {speculative_tokens} draft rows" if speculative_tokens else ""
