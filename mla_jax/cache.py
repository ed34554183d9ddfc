"""Per-layer decode cache: latent rows, indexer keys and per-sequence lengths (docs/design.md §7).

The cache is a pytree that a layer call takes and returns. Both buffers are written for every
token on every route, before any scoring decision: later decode steps read them.

``cache_dtype`` picks how rows are held: float32 or bfloat16 arrays, or ``"fp8"``, where each
part is a small pytree of arrays (``mla_jax.fp8_cache``: e4m3 values with float32 scales, the
RoPE part in bfloat16), quantized on write. Every array of a part shares the leading
[batch, capacity] axes, so writes and row reads apply to each array alike.
"""

from __future__ import annotations

import abc
import dataclasses
import math

import jax
import jax.numpy as jnp

from mla_jax import checks, fp8_cache
from mla_jax.config import MLAConfig
from pallas_kernels.fp8_rows import Fp8LatentRows

CACHE_DTYPE_NAMES = ("fp32", "bf16", "fp8")
_NAMED_FLOAT_CACHE_DTYPES = {"fp32": jnp.dtype(jnp.float32), "bf16": jnp.dtype(jnp.bfloat16)}
# float16 is accepted as a dtype object but has no name (docs/decode.md names fp32, bf16 and fp8).
_FLOAT_CACHE_DTYPES = (*_NAMED_FLOAT_CACHE_DTYPES.values(), jnp.dtype(jnp.float16))


def resolve_cache_dtype(cache_dtype, name: str = "cache dtype"):
  """The string ``"fp8"`` (the fp8 layouts) or a float cache dtype.

  Accepts ``"fp32" | "bf16" | "fp8"``, the dtypes float32, bfloat16 and float16, and
  float8_e4m3fn (meaning the fp8 layouts, which keep scales and RoPE beside the e4m3 values).
  A non-float dtype is a ``TypeError`` (it would silently round every row written).
  """
  if isinstance(cache_dtype, str):
    if cache_dtype not in CACHE_DTYPE_NAMES:
      raise ValueError(f"{name} must be one of {CACHE_DTYPE_NAMES} or a float dtype, got "
                       f"{cache_dtype!r}")
    return "fp8" if cache_dtype == "fp8" else _NAMED_FLOAT_CACHE_DTYPES[cache_dtype]
  dtype = checks.float_dtype(cache_dtype, name)
  if dtype == jnp.float8_e4m3fn:
    return "fp8"
  if dtype not in _FLOAT_CACHE_DTYPES:
    raise ValueError(f"{name} must be one of {CACHE_DTYPE_NAMES}, float32, bfloat16, "
                     f"float16 or float8_e4m3fn, got {cache_dtype!r}")
  return dtype


def _row_array(part):
  """An array of a cache part whose axes are [..., B, S, X] (the part itself when plain)."""
  return part.values if isinstance(part, (Fp8LatentRows, fp8_cache.Fp8Keys)) else part


def _readable(parts):
  latent, keys = parts
  return fp8_cache.readable(latent), None if keys is None else fp8_cache.readable(keys)


def _row_width(latent) -> int:
  return latent.width if isinstance(latent, Fp8LatentRows) else latent.shape[-1]


class CacheView(abc.ABC):
  """What an attention layer reads and writes of its cache, however the rows are held.

  ``LayerCache`` holds one layer's rows; ``StackedLayerView`` is one layer of a cache stacked
  over a scanned layer group. Layers use only this protocol, and ``num_cached_B`` (int32 valid
  rows per sequence).
  """

  num_cached_B: jax.Array

  @property
  @abc.abstractmethod
  def batch_size(self) -> int: ...

  @property
  @abc.abstractmethod
  def capacity(self) -> int: ...

  @property
  def latent_dim(self) -> int:
    return _row_width(self.buffers.pools[0])

  @property
  def has_index_keys(self) -> bool:
    return self.buffers.pools[1] is not None

  @property
  def segment_ids_B(self):
    """Which sequence each row is a token of (a paged cache in an engine's flat step,
    ``StepPlan.segmented``); None: every row is a sequence of its own."""
    return None

  @property
  @abc.abstractmethod
  def buffers(self) -> LayerCache:
    """The arrays behind the view (stacked over layers for a ``StackedLayerView``)."""

  @abc.abstractmethod
  def rows(self, num_rows: int):
    """The first ``num_rows`` rows of the latent and key caches (keys None without them), in
    the cache's layout (fp8 parts as ``fp8_cache.readable`` views)."""

  def attention_rows(self, topk_BTK, num_rows: int):
    """``(rows, indices, batched)`` for the absorbed-MQA gather of the logical ``topk_BTK``
    over the first ``num_rows`` rows: here that sequence's rows [B, S, ...] and the indices as
    they are; a paged view returns its whole pool (``batched`` False) and physical rows."""
    return self.rows(num_rows)[0], topk_BTK, True

  def index_keys(self, num_rows: int):
    """``(keys, key_rows_BS)`` the indexer scores the first ``num_rows`` positions with: here
    that sequence's keys [B, S, I] (``Fp8Keys`` parts in an fp8 cache) and None; a paged view
    returns its whole key pool [rows, I] and each position's physical row in it (the pool
    mode of ``Backend.indexer_logits``). Keys are None for a layer without a key cache."""
    return self.rows(num_rows)[1], None

  @abc.abstractmethod
  def write(self, latent_BTL, keys_BTI, new_lens_B) -> CacheView:
    """Appends ``new_lens_B[b]`` rows to sequence b (see ``write_rows``), quantized first in
    an fp8 cache; padding rows and rows past capacity are dropped."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache(CacheView):
  """One layer's cache for a batch of sequences.

  Attributes:
    latent_BSL: rows [normalized c_kv (A) | rotated k_pe (R)], L = A + R (576 for DSv3.2):
      an array, or ``Fp8LatentRows`` in an fp8 cache (held as bits, read through ``rows``).
    index_keys_BSI: the indexer's keys (an array, or ``Fp8Keys`` in an fp8 cache), or None
      for a layer without an indexer.
    num_cached_B: int32 number of valid rows per sequence.
  """

  latent_BSL: jax.Array
  index_keys_BSI: jax.Array | None
  num_cached_B: jax.Array

  @property
  def batch_size(self) -> int:
    return _row_array(self.latent_BSL).shape[0]

  @property
  def capacity(self) -> int:
    return _row_array(self.latent_BSL).shape[1]

  @property
  def buffers(self) -> LayerCache:
    return self

  @property
  def pools(self):
    """The row arrays: ``(latent, index keys or None)``."""
    return self.latent_BSL, self.index_keys_BSI

  @property
  def num_cached_shape(self) -> tuple[int, ...]:
    """The shape ``num_cached_B`` must have: the rows' leading axes but the capacity."""
    return tuple(_row_array(self.latent_BSL).shape[:-2])

  def layer_view(self, index) -> StackedLayerView:
    """Layer ``index`` of this cache stacked over a group's layers."""
    return StackedLayerView(self, index)

  @property
  def bytes_per_token(self) -> int:
    """Bytes one token's latent row and indexer key take in this cache."""
    parts = jax.tree.leaves((self.latent_BSL, self.index_keys_BSI))
    return sum(a.dtype.itemsize * math.prod(a.shape[2:]) for a in parts)  # [B, S, ...]

  def rows(self, num_rows: int):
    return _readable(jax.tree.map(lambda a: a[:, :num_rows],
                                  (self.latent_BSL, self.index_keys_BSI)))

  def write(self, latent_BTL, keys_BTI, new_lens_B) -> LayerCache:
    write = lambda stored, new: _write_part(stored, new, self.num_cached_B, new_lens_B)
    keys = self.index_keys_BSI
    return LayerCache(write(self.latent_BSL, latent_BTL),
                      None if keys is None else write(keys, keys_BTI),
                      self.num_cached_B + new_lens_B)


@dataclasses.dataclass(frozen=True)
class StackedLayerView(CacheView):
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
  def num_cached_B(self):
    return self.stacked.num_cached_B[self.index]

  @property
  def batch_size(self) -> int:
    return _row_array(self.stacked.latent_BSL).shape[1]

  @property
  def capacity(self) -> int:
    return _row_array(self.stacked.latent_BSL).shape[2]

  @property
  def buffers(self) -> LayerCache:
    return self.stacked

  def rows(self, num_rows: int):
    def layer_rows(buffer):
      start = (self.index,) + (0,) * (buffer.ndim - 1)
      return jax.lax.dynamic_slice(buffer, start, (1, buffer.shape[1], num_rows,
                                                   *buffer.shape[3:]))[0]

    return _readable(jax.tree.map(layer_rows,
                                  (self.stacked.latent_BSL, self.stacked.index_keys_BSI)))

  def write(self, latent_BTL, keys_BTI, new_lens_B) -> StackedLayerView:
    num_cached_B = self.num_cached_B
    write = lambda stored, new: _write_part(stored, new, num_cached_B, new_lens_B, layer=self.index)
    keys = self.stacked.index_keys_BSI
    stacked = LayerCache(write(self.stacked.latent_BSL, latent_BTL),
                         None if keys is None else write(keys, keys_BTI),
                         self.stacked.num_cached_B.at[self.index].set(num_cached_B + new_lens_B))
    return StackedLayerView(stacked, self.index)


def init_layer_cache(config: MLAConfig, batch_size: int, capacity: int, dtype=jnp.float32, *,
                     index_keys: bool = True) -> LayerCache:
  """An empty cache for ``batch_size`` sequences of up to ``capacity`` tokens.

  ``dtype``: the cache dtype (``resolve_cache_dtype``), ``"fp8"`` for the fp8 layouts.
  ``index_keys=False`` is for a layer that shares another layer's top-k (no key cache).
  """
  dtype = resolve_cache_dtype(dtype)
  return empty_layer_cache(config, *cache_shape(config, batch_size, capacity), dtype,
                           index_keys=index_keys)


def cache_shape(config: MLAConfig, batch_size, capacity) -> tuple[int, int]:
  """``(batch_size, capacity)`` as Python ints, checked: positive, and the capacity within
  ``max_position_embeddings`` (NumPy integers are accepted)."""
  for name, value in (("batch_size", batch_size), ("capacity", capacity)):
    if not checks.is_int(value) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if capacity > config.max_position_embeddings:
    raise ValueError(f"capacity {capacity} exceeds max_position_embeddings "
                     f"{config.max_position_embeddings}")
  return int(batch_size), int(capacity)


def empty_layer_cache(config: MLAConfig, batch_size: int, capacity: int, dtype, *,
                      index_keys: bool = True) -> LayerCache:
  """``init_layer_cache`` for a format already resolved (``resolve_cache_dtype``) and sizes
  already checked (``cache_shape``): a model resolves its cache format once, not per layer."""
  fp8 = isinstance(dtype, str)
  keys = None
  if config.indexer is not None and index_keys:
    head_dim = config.indexer.head_dim
    keys = fp8_cache.empty_keys((batch_size, capacity), head_dim) if fp8 else \
        jnp.zeros((batch_size, capacity, head_dim), dtype)
  if fp8:
    latent = fp8_cache.empty_latent((batch_size, capacity), config.kv_lora_rank,
                                    config.qk_rope_head_dim)
  else:
    latent = jnp.zeros((batch_size, capacity, config.latent_dim), dtype)
  return LayerCache(latent_BSL=latent, index_keys_BSI=keys,
                    num_cached_B=jnp.zeros((batch_size,), jnp.int32))


def check_layout(cache, config: MLAConfig) -> None:
  """The buffers' dtypes and shapes fit ``config`` (static: shapes and dtypes only).

  ``cache`` is a ``LayerCache`` or a ``StackedLayerView`` (then the stacked buffers, with their
  leading layer axis, are checked). An integer buffer would silently round every row written;
  the fp8 layouts hold their own bit patterns and are checked by shape only.
  """
  buffers = cache.buffers
  latent, keys = buffers.pools
  if not isinstance(latent, Fp8LatentRows):
    checks.float_dtype(latent.dtype, "cache.latent_BSL dtype")
  leading = tuple(_row_array(latent).shape[:-1])  # ([layers,] batch, capacity) or pool rows
  if keys is not None:
    if not isinstance(keys, fp8_cache.Fp8Keys):
      checks.float_dtype(keys.dtype, "cache.index_keys_BSI dtype")
    expected = leading + (config.indexer.head_dim,)
    if tuple(_row_array(keys).shape) != expected:
      raise ValueError(f"cache.index_keys_BSI must be {list(expected)} ([layers,] batch, "
                       f"capacity, indexer head_dim), got {list(_row_array(keys).shape)}")
  num_cached_B, expected = buffers.num_cached_B, buffers.num_cached_shape
  if tuple(num_cached_B.shape) != expected or not jnp.issubdtype(num_cached_B.dtype, jnp.integer):
    raise TypeError(f"cache.num_cached_B must be int {list(expected)}, got "
                    f"{num_cached_B.dtype} {list(num_cached_B.shape)}")


MIN_BUCKET = 256


def bucket_rows(needed: int, capacity: int) -> int:
  """Cache rows a step reads: ``needed`` rounded up to a power of two (at least 256),
  at most the capacity. Static, so a generation compiles one program per bucket at most:
  ``log2(capacity / 256) + 2`` of them."""
  needed, capacity = int(needed), int(capacity)  # NumPy integers have no bit_length
  if needed > capacity:
    raise ValueError(f"{needed} cache rows are needed but the capacity is {capacity}")
  return min(capacity, power_of_two_bucket(needed, MIN_BUCKET))


def power_of_two_bucket(n: int, minimum: int = 1) -> int:
  """``n`` rounded up to a power of two, at least ``minimum``: few distinct static shapes."""
  return max(minimum, 1 << max(int(n) - 1, 0).bit_length())


def scatter_part(stored, new_rows_BTX, index):
  """Every array of the cache part ``stored`` with ``new_rows_BTX`` (encoded in its layout) set
  at ``index``; rows whose index is out of range are dropped, never clamped onto valid rows."""
  encoded = fp8_cache.encode_like(stored, new_rows_BTX)
  return jax.tree.map(lambda buffer, rows: buffer.at[index].set(rows.astype(buffer.dtype),
                                                                mode="drop"), stored, encoded)


def _write_part(stored, new_rows_BTX, start_B, new_lens_B, *, layer=None):
  """``write_rows`` for every array of a cache part, the new rows encoded in its layout."""
  leading = _row_array(stored).shape[(0 if layer is None else 1):]
  index = _write_index(leading[0], leading[1], new_rows_BTX.shape[1], start_B, new_lens_B,
                       layer)
  return scatter_part(stored, new_rows_BTX, index)


def write_rows(buffer, rows_BTX, start_B, new_lens_B, *, layer=None):
  """Writes row t of sequence b at ``start_B[b] + t`` for ``t < new_lens_B[b]``.

  ``buffer`` is [B, S, ...], or [layers, B, S, ...] with ``layer`` picking the layer. Padding rows
  and rows past capacity are dropped (never clamped onto valid rows, which a
  ``dynamic_update_slice`` would do).
  """
  batch_axis = 0 if layer is None else 1
  index = _write_index(buffer.shape[batch_axis], buffer.shape[batch_axis + 1],
                       rows_BTX.shape[1], start_B, new_lens_B, layer)
  return buffer.at[index].set(rows_BTX.astype(buffer.dtype), mode="drop")


def _write_index(num_seqs: int, capacity: int, num_tokens: int, start_B, new_lens_B, layer):
  """Where ``write_rows`` puts row t of sequence b; padding rows point past the capacity."""
  t_T = jnp.arange(num_tokens, dtype=jnp.int32)
  dest_BT = start_B[:, None] + t_T[None, :]
  dest_BT = jnp.where(t_T[None, :] < new_lens_B[:, None], dest_BT, capacity)
  batch_BT = jnp.broadcast_to(jnp.arange(num_seqs)[:, None], dest_BT.shape)
  return (batch_BT, dest_BT) if layer is None else (layer, batch_BT, dest_BT)
