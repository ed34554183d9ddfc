"""DeepSeek-V4 attention: one class per layer type, each fixing what it may select.

Every layer attends with one shared K=V row per token (``head_dim`` wide, the last
``rope_dim`` rotary) and a learned sink per head, over two sets of rows:

* the window: the last ``sliding_window`` tokens (a ring in the cache, plus this step's);
* compressed entries (``compressed`` classes only): each query sees entry ``i`` once the
  ``m`` tokens it pools are all at or before it, ``i < (pos + 1) // m``.

Which entries a query attends is the class's, at trace time (``compressed_selection``):

* ``SlidingAttention``: none; it has no compressor.
* ``HeavilyCompressedAttention`` (HCA): all of them. It has no indexer.
* ``CompressedSparseAttention`` (CSA): the lightning indexer's top-``index_topk``. It
  declares ``skips_complete_scoring``: where the cache holds no more entries than top-k,
  every valid entry is selected and nothing is scored, a complete selection. A class that
  does not declare it always scores.

Every set runs on the backend's sparse MQA (absorbed MQA over selected rows), reading its rows
where they lie: the window's in the state's ring and in this step's rows, the entries in their
pages (``mla_jax.v4.cache``). The parts' partial softmaxes merge with the sink by log-sum-exp
(``partial_softmax.merge``). A step's rows lie flat, [N] = every sequence's tokens end to end
(``StepGeometry``), so a prefill, a decode and an engine's mixed step are one computation.
The output's rotary slice is rotated back by the query's position (K = V carries the keys'
rotation), then projected per head group (``o_a_proj``) and mixed (``o_b_proj``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import fp8_cache, partial_softmax
from mla_jax.backends import Backend
from mla_jax.backends.on_mesh import MeshOps
from mla_jax.indexer import scoring_operands, topk_indices
from mla_jax.layers import Linear, RMSNorm
from mla_jax.rope import apply_rope
from mla_jax.v4.cache import StepGeometry, V4LayerCache, entries_per_page
from mla_jax.v4.compressor import Compressor, write_entries
from mla_jax.v4.config import CSA, HCA, SLIDING, V4Config
from mla_jax.v4.hyper import unweighted_rms_norm


# Latent values a scale in fp8 entries: the block of DeepSeek's reference, which fp8-rounds
# V4's non-RoPE KV in blocks of 64 with power-of-two scales (docs/models.md, Caches).
REFERENCE_TILE = 64


def empty_entries(config: V4Config, rows: int, entry_dtype):
  """``rows`` zero compressed entries in ``entry_dtype``, or with ``"fp8"`` in V3.2's fp8
  latent layout (``mla_jax.fp8_cache``): the RoPE part is the latent's, the other values in
  tiles of ``REFERENCE_TILE`` where they divide into them."""
  if not isinstance(entry_dtype, str):
    return jnp.zeros((rows, config.head_dim), entry_dtype)
  latent = config.head_dim - config.rope_dim
  return fp8_cache.empty_latent((rows,), latent, config.rope_dim,
                                REFERENCE_TILE if latent % REFERENCE_TILE == 0 else None)


def empty_index_keys(config: V4Config, rows: int, entry_dtype):
  """``rows`` zero CSA indexer keys in ``entry_dtype``, or with ``"fp8"`` as ``Fp8Keys``."""
  if isinstance(entry_dtype, str):
    return fp8_cache.empty_keys((rows,), config.index_head_dim)
  return jnp.zeros((rows, config.index_head_dim), entry_dtype)


class CompressedSelection(enum.Enum):
  NONE = "none"      # no compressed entries (sliding window only)
  ALL = "all"        # every causally valid entry: a complete selection, nothing scored
  SCORED = "scored"  # the indexer's top-k

  @property
  def scope(self) -> str:
    return "v4_compressed_" + self.value


def compressed_selection(layer, capacity: int) -> CompressedSelection:
  """What ``layer`` selects among a cache of ``capacity`` compressed entries (static)."""
  if not layer.compressed:
    return CompressedSelection.NONE
  if not layer.scored:
    return CompressedSelection.ALL
  if layer.skips_complete_scoring and capacity <= layer.config.index_topk:
    return CompressedSelection.ALL
  return CompressedSelection.SCORED


class V4Attention(nnx.Module):
  """The shared part of the three layer types; subclasses only declare capabilities."""

  layer_type: ClassVar[str]
  compressed: ClassVar[bool] = False
  scored: ClassVar[bool] = False
  skips_complete_scoring: ClassVar[bool] = False

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.scored and not cls.compressed:
      raise TypeError(f"{cls.__name__}: only a compressed layer can score entries")
    if cls.skips_complete_scoring and not cls.scored:
      raise TypeError(f"{cls.__name__} declares skips_complete_scoring without scoring")

  def __init__(self, config: V4Config, *, rngs: nnx.Rngs, backend: Backend,
               param_dtype=jnp.float32, mesh=None):
    d, h, dh = config.hidden_size, config.num_attention_heads, config.head_dim
    eps = config.rms_norm_eps
    lin = lambda i, o: Linear(i, o, rngs=rngs, param_dtype=param_dtype)
    self.q_a_proj = lin(d, config.q_lora_rank)
    self.q_a_norm = RMSNorm(config.q_lora_rank, eps=eps)
    self.q_b_proj = lin(config.q_lora_rank, h * dh)
    self.kv_proj = lin(d, dh)
    self.kv_norm = RMSNorm(dh, eps=eps)
    self.o_a_proj = lin(h * dh // config.o_groups, config.o_groups * config.o_lora_rank)
    self.o_b_proj = lin(config.o_groups * config.o_lora_rank, d)
    self.sinks = nnx.Param(jnp.zeros((h,), jnp.float32))
    self.rope = config.main_rope if self.layer_type == SLIDING else config.compress_rope
    self.config, self.backend, self.mesh = config, backend, mesh
    if self.compressed:
      self.compressor = Compressor(
          d, dh, self.ratio, overlap=self.scored, rope_dim=config.rope_dim,
          rope=config.compress_rope, max_position=config.max_position_embeddings,
          norm_eps=eps, rngs=rngs, param_dtype=param_dtype)
    if self.scored:
      self.indexer = Compressor(
          d, config.index_head_dim, self.ratio, overlap=True, rope_dim=config.rope_dim,
          rope=config.compress_rope, max_position=config.max_position_embeddings,
          norm_eps=eps, rngs=rngs, param_dtype=param_dtype)
      self.indexer.q_b_proj = lin(config.q_lora_rank,
                                  config.index_n_heads * config.index_head_dim)
      self.indexer.weights_proj = lin(d, config.index_n_heads)

  @property
  def ops(self) -> MeshOps:
    """The backend's ops, under ``shard_map`` on a mesh: heads over tensor, batch over data."""
    return MeshOps(self.backend, self.mesh)

  @property
  def ratio(self) -> int:
    return self.config.compress_ratio(self.layer_type)

  def init_cache(self, slots: int, num_pages: int, page_size: int, dtype,
                 spare: int = 0, *, entry_dtype=None) -> V4LayerCache:
    """This layer's arrays (all zeros): state for ``slots`` sequences, its rings (window,
    compressor) holding ``spare`` more rows for steps that run ahead of the next step's
    start; entries for ``num_pages`` pages of ``page_size`` tokens (``mla_jax.v4.cache``).
    ``entry_dtype`` (default ``dtype``): the entries' and indexer keys' (``empty_entries``)."""
    config = self.config
    entry_dtype = dtype if entry_dtype is None else entry_dtype
    window = jnp.zeros((slots, config.sliding_window + spare, config.head_dim), dtype)
    if not self.compressed:
      return V4LayerCache(window)
    rows = num_pages * entries_per_page(page_size, self.ratio)
    pool_kv, pool_gate = self.compressor.init_state(slots, dtype, spare)
    entries = empty_entries(config, rows, entry_dtype)
    cache = V4LayerCache(window, pool_kv, pool_gate, entries)
    if not self.scored:
      return cache
    index_kv, index_gate = self.indexer.init_state(slots, dtype, spare)
    return dataclasses.replace(cache, index_pool_kv=index_kv, index_pool_gate=index_gate,
                               index_keys=empty_index_keys(config, rows, entry_dtype))

  def _rotate(self, x, pos_N, *, inverse: bool = False):
    """RoPE on the last ``rope_dim`` features of rows [N, ...] at positions ``pos_N``."""
    r = self.config.rope_dim
    rotated = apply_rope(x[..., -r:], pos_N, self.rope, interleaved=True, inverse=inverse,
                         max_position=self.config.max_position_embeddings)
    return jnp.concatenate([x[..., :-r], rotated], axis=-1)

  def __call__(self, x_BTD, cache: V4LayerCache, geo: StepGeometry,
               selection: CompressedSelection, kv_rows: int):
    """Attention of a step's rows (``x_BTD`` flattened in ``geo``'s row order) under
    ``selection`` (the step plan's for this layer), reading entries of positions below
    ``kv_rows``; returns ``(out_BTD, cache)``."""
    config = self.config
    b, t, d = x_BTD.shape
    n, h, dh = b * t, config.num_attention_heads, config.head_dim
    x_ND = x_BTD.reshape(n, d)
    pos_N = geo.pos_N
    q_res_NC = self.q_a_norm(self.q_a_proj(x_ND))
    q_NHL = unweighted_rms_norm(self.q_b_proj(q_res_NC).reshape(n, h, dh), config.rms_norm_eps)
    q_N1HL = self._rotate(q_NHL, pos_N)[:, None]
    kv_NL = self._rotate(self.kv_norm(self.kv_proj(x_ND)), pos_N)
    attend = lambda rows, idx_NK: self.ops.sparse_mqa(
        q_N1HL, rows.astype(q_N1HL.dtype), idx_NK[:, None], sm_scale=dh**-0.5, d_v=dh,
        batched_rows=False)

    with jax.named_scope("v4_window"):
      ring = cache.window
      kv_NL = kv_NL.astype(ring.dtype)  # as the ring holds it
      step_NW, ring_NW = geo.window(config.sliding_window, ring.shape[1])
      parts = [attend(ring.reshape(-1, dh), ring_NW), attend(kv_NL, step_NW)]
      cache = dataclasses.replace(cache, window=geo.state_after(ring, kv_NL))
    if self.compressed:
      with jax.named_scope("v4_compressor"):
        entries, window_J, row_J, pool_kv, pool_gate = self.compressor(
            x_ND, cache.pool_kv, cache.pool_gate, geo)
        rows_J = geo.entry_rows(geo.seq_N[row_J], window_J, self.ratio)
        cache = dataclasses.replace(
            cache, pool_kv=pool_kv, pool_gate=pool_gate,
            entries=write_entries(cache.entries, entries, rows_J, window_J >= 0))
      with jax.named_scope(selection.scope):
        rows_NK, cache = self._select(selection, x_ND, q_res_NC, geo, cache, kv_rows)
        # fp8 entries are dequantized whole: the kernels' fp8 rows give only their latent
        # part as values, and a V4 entry's RoPE part is a value too (docs/models.md)
        parts.append(attend(fp8_cache.dense_latent(fp8_cache.readable(cache.entries),
                                                   q_N1HL.dtype), rows_NK))
    out_NHL, _ = partial_softmax.merge(parts, sink=self.sinks[...])
    out_NHL = self._rotate(out_NHL[:, 0].astype(x_BTD.dtype), pos_N, inverse=True)
    groups = config.o_groups
    out_NGX = out_NHL.reshape(n, groups, -1)
    w_GOX = self.o_a_proj.weight[...].reshape(groups, config.o_lora_rank, -1)
    grouped_NGO = jnp.einsum("ngx,gox->ngo", out_NGX, w_GOX.astype(out_NGX.dtype),
                             preferred_element_type=jnp.float32).astype(x_BTD.dtype)
    return self.o_b_proj(grouped_NGO.reshape(n, -1)).reshape(b, t, d), cache

  def _select(self, selection: CompressedSelection, x_ND, q_res_NC, geo: StepGeometry,
              cache: V4LayerCache, kv_rows: int):
    """Each row's entries as pool rows, -1 for none: valid ones only (complete at its
    position, ``i < (pos + 1) // m``), never an unwritten row; and the cache (a scored
    selection writes its indexer's keys first)."""
    m = self.ratio
    num_entries = max(kv_rows // m, 1)  # the entries a position below kv_rows can see
    entry_C = jnp.arange(num_entries, dtype=jnp.int32)
    visible_N = jnp.where(geo.real_N, (geo.pos_N + 1) // m, 0)  # entries [0, visible)
    rows_NC = jnp.where(entry_C < visible_N[:, None],
                        geo.entry_rows(geo.seq_N[:, None], entry_C[None, :], m), -1)
    if selection is CompressedSelection.ALL:
      return rows_NC, cache
    config, n = self.config, x_ND.shape[0]
    with jax.named_scope("v4_indexer"):
      keys, window_J, row_J, index_kv, index_gate = self.indexer(
          x_ND, cache.index_pool_kv, cache.index_pool_gate, geo)
      rows_J = geo.entry_rows(geo.seq_N[row_J], window_J, m)
      cache = dataclasses.replace(
          cache, index_pool_kv=index_kv, index_pool_gate=index_gate,
          index_keys=write_entries(cache.index_keys, keys, rows_J, window_J >= 0))
      g, i = config.index_n_heads, config.index_head_dim
      q_NGI = self._rotate(self.indexer.q_b_proj(q_res_NC).reshape(n, g, i), geo.pos_N)
      w_NG = self.indexer.weights_proj(x_ND).astype(jnp.float32) * (g**-0.5 * i**-0.5)
      q_N1GI, keys, w_N1G, k_scale = scoring_operands(
          q_NGI[:, None], fp8_cache.readable(cache.index_keys), w_NG[:, None], pooled=True)
      logits_N1C = self.ops.indexer_logits(
          q_N1GI, keys, w_N1G, jnp.zeros((n, 1), jnp.int32), visible_N[:, None],
          k_scale_BS=k_scale, key_rows_BS=rows_NC)
      top_NK = topk_indices(logits_N1C, min(config.index_topk, num_entries))[:, 0]
      picked_NK = jnp.take_along_axis(rows_NC, jnp.maximum(top_NK, 0), axis=1)
      return jnp.where(top_NK >= 0, picked_NK, -1), cache


class SlidingAttention(V4Attention):
  layer_type: ClassVar[str] = SLIDING


class HeavilyCompressedAttention(V4Attention):
  layer_type: ClassVar[str] = HCA
  compressed: ClassVar[bool] = True


class CompressedSparseAttention(V4Attention):
  layer_type: ClassVar[str] = CSA
  compressed: ClassVar[bool] = True
  scored: ClassVar[bool] = True
  skips_complete_scoring: ClassVar[bool] = True


ATTENTION_CLASSES = {cls.layer_type: cls for cls in
                     (SlidingAttention, HeavilyCompressedAttention, CompressedSparseAttention)}
