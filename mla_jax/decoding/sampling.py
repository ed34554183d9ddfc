"""Sampling settings and the one sampler ``generate``'s programs and the engine's call.

Every row draws with a key of its own, ``fold_in(base key of the row, token index)``, its base
key ``key(seed)`` (``seed_keys``): an engine request's seed, or ``generate``'s seed plus the
row's index (``sample``), so ``generate`` and an engine given those seeds draw the same tokens
from the same logits. A row's token depends on its logits, settings and key alone, never on
the other rows of the batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.0
  top_p: float = 1.0

  def __post_init__(self):
    for name in ("temperature", "top_p"):  # NaN would sample id 0 for every token
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
      object.__setattr__(self, name, float(value))
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


def sample(logits_BV, seed, index, sampling: SamplingConfig):
  """``generate``'s draw. Greedy at temperature 0; otherwise nucleus sampling over ``logits /
  temperature``, row b drawing as the engine draws for a request of seed ``seed + b`` (mod
  2**32; ``seed_keys``) at token index ``index``: from the same logits, the same tokens."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  b = logits_BV.shape[0]
  seeds_B = jnp.asarray(seed, jnp.uint32) + jnp.arange(b, dtype=jnp.uint32)
  return sample_rows(logits_BV, seed_keys(seeds_B), jnp.full((b,), index, jnp.int32),
                     jnp.full((b,), sampling.temperature, jnp.float32),
                     jnp.full((b,), sampling.top_p, jnp.float32))


def row_logits(logits_BV, temperature_B, top_p_B, top_k_B=None, min_p_B=None):
  """The logits each row samples from: divided by its temperature (1 for a greedy row, which
  takes the argmax of ``logits_BV`` instead), cut to its ``top_k_B`` most likely tokens (ties
  with the k-th stay) and to those at least ``min_p_B`` times as likely as the most likely one
  (vLLM's top_k and min_p; None or 0: no cut), then to its nucleus: the smallest prefix, by
  probability, whose mass reaches ``top_p_B`` (1: no cut). The most likely token always
  survives; a cut token's logit is -inf."""
  scaled_BV = logits_BV / jnp.where(temperature_B == 0, 1.0, temperature_B)[:, None]
  # One descending sort serves every cut: none of them reorders the tokens it keeps.
  sorted_BV = jnp.sort(scaled_BV, axis=-1)[:, ::-1]
  floor_B1 = jnp.full((scaled_BV.shape[0], 1), -jnp.inf, scaled_BV.dtype)
  if top_k_B is not None:
    k_B1 = jnp.clip(top_k_B - 1, 0, scaled_BV.shape[-1] - 1)[:, None]
    kth_B1 = jnp.take_along_axis(sorted_BV, k_B1, axis=-1)
    floor_B1 = jnp.where(top_k_B[:, None] > 0, kth_B1, floor_B1)
  if min_p_B is not None:  # log(0) = -inf: no floor
    floor_B1 = jnp.maximum(floor_B1, sorted_BV[:, :1] + jnp.log(min_p_B)[:, None])
  kept_BV = (sorted_BV >= floor_B1) & (sorted_BV > -jnp.inf)
  probs_BV = jax.nn.softmax(jnp.where(kept_BV, sorted_BV, -jnp.inf), axis=-1)
  nucleus_BV = kept_BV & (jnp.cumsum(probs_BV, axis=-1) - probs_BV < top_p_B[:, None])
  cutoff_B1 = jnp.min(jnp.where(nucleus_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  # top_p 1 keeps every token the other cuts keep (the cumsum's rounding could drop a last one).
  cutoff_B1 = jnp.where(top_p_B[:, None] >= 1, floor_B1, cutoff_B1)
  return jnp.where(scaled_BV >= cutoff_B1, scaled_BV, -jnp.inf)


def seed_keys(seeds_B):
  """A base key per row from its request's seed: ``key(seed)``."""
  return jax.vmap(jax.random.key)(seeds_B)


def row_keys(keys_B, counters_B):
  """Row b's key for its token at index ``counters_B[b]``: ``fold_in(keys_B[b], counter)``."""
  return jax.vmap(jax.random.fold_in)(keys_B, counters_B)


def sample_rows(logits_BV, keys_B, counters_B, temperature_B, top_p_B, top_k_B=None,
                min_p_B=None):
  """Sampling with settings per row: row b draws with key ``fold_in(keys_B[b],
  counters_B[b])`` (its base key and token index), so a row's token depends on its logits and
  settings alone, never on the other rows of the batch. Temperature 0 rows are greedy.

  A row draws by inverting its distribution's CDF at one uniform number: one random draw a
  row, where a Gumbel-max draw (``jax.random.categorical``) needs one per vocabulary entry,
  which cost a decode step on a CPU as much as the rest of the sampling. A token of
  probability 0 (cut by top_k, min_p or the nucleus) is never drawn."""
  probs_BV = jax.nn.softmax(row_logits(logits_BV, temperature_B, top_p_B, top_k_B, min_p_B),
                            axis=-1)
  cdf_BV = jnp.cumsum(probs_BV, axis=-1)
  u_B = jax.vmap(jax.random.uniform)(row_keys(keys_B, counters_B)) * cdf_BV[:, -1]
  # The first entry whose CDF passes u; a run of zero-probability entries never does.
  drawn_B = jnp.minimum((cdf_BV <= u_B[:, None]).sum(axis=-1), logits_BV.shape[-1] - 1)
  return jnp.where(temperature_B == 0, jnp.argmax(logits_BV, axis=-1), drawn_B).astype(jnp.int32)
