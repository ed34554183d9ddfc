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

  @property
  def latent_dim(self) -> int:
    return self.latent_BSL.shape[-1]

  @property
  def has_index_keys(self) -> bool:
    return self.index_keys_BSI is not None

  def rows(self, num_rows: int):
    """The first ``num_rows`` rows of the latent and key caches (keys None without them)."""
    keys = None if self.index_keys_BSI is None else self.index_keys_BSI[:, :num_rows]
    return self.latent_BSL[:, :num_rows], keys

  def write(self, latent_BTL, keys_BTI, new_lens_B) -> LayerCache:
    """Appends ``new_lens_B[b]`` rows to sequence b (see ``write_rows``)."""
    keys = self.index_keys_BSI
    if keys is not None:
      keys = write_rows(keys, keys_BTI, self.lengths_B, new_lens_B)
    return LayerCache(write_rows(self.latent_BSL, latent_BTL, self.lengths_B, new_lens_B), keys,
                      self.lengths_B + new_lens_B)


@dataclasses.dataclass(frozen=True)
class StackedLayerView:
  """Layer ``index`` of a cache stacked over layers (``[layers, B, S, ...]``), used inside the
  scan over a layer group.

  It behaves like that layer's ``LayerCache`` but never copies it: ``write`` scatters the new
  rows straight into the stacked buffers (updated in place when the caches are donated) and
  ``rows`` reads only the rows asked for, so a decode step touches the live rows, not the
  whole capacity.
  """

  stacked: LayerCache
  index: jax.Array

  @property
  def lengths_B(self):
    return self.stacked.lengths_B[self.index]

  @property
  def batch_size(self) -> int:
    return self.stacked.latent_BSL.shape[1]

  @property
  def capacity(self) -> int:
    return self.stacked.latent_BSL.shape[2]

  @property
  def latent_dim(self) -> int:
    return self.stacked.latent_BSL.shape[-1]

  @property
  def has_index_keys(self) -> bool:
    return self.stacked.index_keys_BSI is not None

  def rows(self, num_rows: int):
    def layer_rows(buffer):
      start = (self.index,) + (0,) * (buffer.ndim - 1)
      return jax.lax.dynamic_slice(buffer, start, (1, buffer.shape[1], num_rows,
                                                   *buffer.shape[3:]))[0]

    keys = self.stacked.index_keys_BSI
    return layer_rows(self.stacked.latent_BSL), None if keys is None else layer_rows(keys)

  def write(self, latent_BTL, keys_BTI, new_lens_B) -> StackedLayerView:
    lengths_B = self.lengths_B
    write = lambda buffer, rows: write_rows(buffer, rows, lengths_B, new_lens_B,
                                            layer=self.index)
    keys = self.stacked.index_keys_BSI
    stacked = LayerCache(write(self.stacked.latent_BSL, latent_BTL),
                         None if keys is None else write(keys, keys_BTI),
                         self.stacked.lengths_B.at[self.index].set(lengths_B + new_lens_B))
    return StackedLayerView(stacked, self.index)


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


def check_layout(cache, config: MLAConfig) -> None:
  """The buffers' dtypes and shapes fit ``config`` (static: shapes and dtypes only).

  ``cache`` is a ``LayerCache`` or a ``StackedLayerView`` (then the stacked buffers, with their
  leading layer axis, are checked). An integer buffer would silently round every row written.
  """
  buffers = cache.stacked if isinstance(cache, StackedLayerView) else cache
  checks.float_dtype(buffers.latent_BSL.dtype, "cache.latent_BSL dtype")
  leading = tuple(buffers.latent_BSL.shape[:-1])  # ([layers,] batch, capacity)
  keys = buffers.index_keys_BSI
  if keys is not None:
    checks.float_dtype(keys.dtype, "cache.index_keys_BSI dtype")
    expected = leading + (config.indexer.head_dim,)
    if tuple(keys.shape) != expected:
      raise ValueError(f"cache.index_keys_BSI must be {list(expected)} ([layers,] batch, "
                       f"capacity, indexer head_dim), got {list(keys.shape)}")
  lengths = buffers.lengths_B
  if tuple(lengths.shape) != leading[:-1] or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"cache.lengths_B must be int {list(leading[:-1])}, got "
                    f"{lengths.dtype} {list(lengths.shape)}")


MIN_BUCKET = 256


def bucket_rows(needed: int, capacity: int) -> int:
  """Cache rows a step reads: ``needed`` rounded up to a power of two (at least 256),
  at most the capacity. Static, so a generation compiles one program per bucket at most:
  ``log2(capacity / 256) + 2`` of them."""
  if needed > capacity:
    raise ValueError(f"{needed} cache rows are needed but the capacity is {capacity}")
  return min(capacity, max(MIN_BUCKET, 1 << max(needed - 1, 0).bit_length()))


def check_fits(cache, new_lens_B) -> None:
  """Refuses a step that would overflow the cache (rows past capacity would be dropped).

  At once with concrete lengths, before anything is written; under ``jit`` only when run
  checked (``mla_jax.checks``).
  """
  checks.cache_fits(cache.lengths_B, new_lens_B, cache.capacity)


def write_rows(buffer, rows_BTX, start_B, new_lens_B, *, layer=None):
  """Writes row t of sequence b at ``start_B[b] + t`` for ``t < new_lens_B[b]``.

  ``buffer`` is [B, S, X], or [layers, B, S, X] with ``layer`` picking the layer. Padding rows
  and rows past capacity are dropped (never clamped onto valid rows, which a
  ``dynamic_update_slice`` would do).
  """
  batch_axis = 0 if layer is None else 1
  num_seqs, capacity = buffer.shape[batch_axis], buffer.shape[batch_axis + 1]
  t_T = jnp.arange(rows_BTX.shape[1], dtype=jnp.int32)
  dest_BT = start_B[:, None] + t_T[None, :]
  dest_BT = jnp.where(t_T[None, :] < new_lens_B[:, None], dest_BT, capacity)
  batch_BT = jnp.broadcast_to(jnp.arange(num_seqs)[:, None], dest_BT.shape)
  index = (batch_BT, dest_BT) if layer is None else (layer, batch_BT, dest_BT)
  return buffer.at[index].set(rows_BTX.astype(buffer.dtype), mode="drop")
