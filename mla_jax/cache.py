"""Per-layer decode cache: latent rows, indexer keys and per-sequence lengths (docs/design.md §7).

The cache is a pytree that a layer call takes and returns. Both buffers are written for every
token on every route, before any scoring decision: later decode steps read them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mla_jax import checks
from mla_jax.config import MLAConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
  """One layer's cache for a batch of sequences.

  Attributes:
    latent_BSL: rows [normalized c_kv (A) | rotated k_pe (R)], L = A + R (576 for DSv3.2).
    index_keys_BSI: the indexer's keys, or None for a layer without an indexer.
    lengths_B: int32 number of valid rows per sequence.
  """

  latent_BSL: jax.Array
  index_keys_BSI: jax.Array | None
  lengths_B: jax.Array

  @property
  def batch_size(self) -> int:
    return self.latent_BSL.shape[0]

  @property
  def capacity(self) -> int:
    return self.latent_BSL.shape[1]


def init_layer_cache(config: MLAConfig, batch_size: int, capacity: int, dtype=jnp.float32, *,
                     index_keys: bool = True) -> LayerCache:
  """An empty cache for ``batch_size`` sequences of up to ``capacity`` tokens.

  ``index_keys=False`` is for a layer that shares another layer's top-k (no key cache).
  """
  for name, value in (("batch_size", batch_size), ("capacity", capacity)):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if capacity > config.max_position_embeddings:
    raise ValueError(f"capacity {capacity} exceeds max_position_embeddings "
                     f"{config.max_position_embeddings}")
  checks.float_dtype(dtype, "cache dtype")
  keys = None
  if config.indexer is not None and index_keys:
    keys = jnp.zeros((batch_size, capacity, config.indexer.head_dim), dtype)
  return LayerCache(latent_BSL=jnp.zeros((batch_size, capacity, config.latent_dim), dtype),
                    index_keys_BSI=keys, lengths_B=jnp.zeros((batch_size,), jnp.int32))


def check_layout(cache: LayerCache, config: MLAConfig) -> None:
  """The buffers' dtypes and the key cache's shape fit ``config`` (static: shapes, dtypes)."""
  checks.float_dtype(cache.latent_BSL.dtype, "cache.latent_BSL dtype")
  keys = cache.index_keys_BSI
  if keys is not None:
    checks.float_dtype(keys.dtype, "cache.index_keys_BSI dtype")
    expected = (cache.batch_size, cache.capacity, config.indexer.head_dim)
    if tuple(keys.shape) != expected:
      raise ValueError(f"cache.index_keys_BSI must be {list(expected)} [batch, capacity, "
                       f"indexer head_dim], got {list(keys.shape)}")
  lengths = cache.lengths_B
  if tuple(lengths.shape) != (cache.batch_size,) or not jnp.issubdtype(lengths.dtype,
                                                                       jnp.integer):
    raise TypeError(f"cache.lengths_B must be int [{cache.batch_size}], got "
                    f"{lengths.dtype} {list(lengths.shape)}")


def check_fits(cache: LayerCache, new_lens_B) -> None:
  """Refuses a step that would overflow the cache (rows past capacity would be dropped).

  At once with concrete lengths, before anything is written; under ``jit`` only when run
  checked (``mla_jax.checks``).
  """
  checks.cache_fits(cache.lengths_B, new_lens_B, cache.capacity)


def write_rows(buffer_BSX, rows_BTX, start_B, new_lens_B):
  """Writes row t of sequence b at ``start_B[b] + t`` for ``t < new_lens_B[b]``.

  Padding rows and rows past capacity are dropped (never clamped onto valid rows, which a
  ``dynamic_update_slice`` would do).
  """
  capacity = buffer_BSX.shape[1]
  t_T = jnp.arange(rows_BTX.shape[1], dtype=jnp.int32)
  dest_BT = start_B[:, None] + t_T[None, :]
  dest_BT = jnp.where(t_T[None, :] < new_lens_B[:, None], dest_BT, capacity)
  batch_BT = jnp.broadcast_to(jnp.arange(buffer_BSX.shape[0])[:, None], dest_BT.shape)
  return buffer_BSX.at[batch_BT, dest_BT].set(rows_BTX.astype(buffer_BSX.dtype), mode="drop")
