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

Both sets run on the backend's sparse MQA (absorbed MQA over selected rows); their partial
softmaxes merge with the sink by log-sum-exp, so the compressed entries are read in place.
The output's rotary slice is rotated back by the query's position (K = V carries the keys'
rotation), then projected per head group (``o_a_proj``) and mixed (``o_b_proj``).
"""

from __future__ import annotations

import enum
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.backends import Backend
from mla_jax.backends.on_mesh import MeshOps
from mla_jax.indexer import topk_indices
from mla_jax.layers import Linear, RMSNorm
from mla_jax.rope import apply_rope
from mla_jax.v4.compressor import Compressor, ring_rows, write_entries, write_ring
from mla_jax.v4.config import CSA, HCA, SLIDING, V4Config
from mla_jax.v4.hyper import unweighted_rms_norm


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


def window_indices(start_B, num_new: int, window: int, ring: int | None = None):
  """Rows of each query's window (its last ``window`` positions) in ``[ring (R) | this step's
  rows (T)]``: [B, T, W], -1 where the position is before the sequence. The ring holds
  position p at slot ``p % R``; R is ``window``, or more to hold spare slots (``ring_rows``)."""
  pos_BT = start_B[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]
  key_BTW = pos_BT[..., None] - jnp.arange(window, dtype=jnp.int32)
  row_BTW = ring_rows(key_BTW, start_B[:, None, None], window if ring is None else ring)
  return jnp.where(key_BTW >= 0, row_BTW, -1)


def merge_with_sink(parts, sink_H):
  """One softmax over every part's rows and the sink, from each part's ``(out, lse)``.

  A part with no rows for a query has LSE +inf (the backends' empty row) and weight 0."""
  lses = [jnp.where(jnp.isinf(lse), -jnp.inf, lse) for _, lse in parts]
  sink = jnp.broadcast_to(sink_H.astype(jnp.float32), lses[0].shape)
  top = jnp.maximum(jnp.max(jnp.stack(lses), axis=0), sink)
  weights = [jnp.exp(lse - top) for lse in lses]
  total = sum(weights) + jnp.exp(sink - top)
  out = sum(w[..., None] * out.astype(jnp.float32) for w, (out, _) in zip(weights, parts))
  return out / total[..., None]


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

  def init_cache(self, batch: int, capacity: int, dtype, spare: int = 0) -> dict:
    """This layer's cache for sequences of up to ``capacity`` tokens (all zeros); its rings
    (window, compressor state) hold ``spare`` more slots, for steps that run ahead of the
    next step's start (``compressor`` module docstring)."""
    cache = {"window": jnp.zeros((batch, self.config.sliding_window + spare,
                                  self.config.head_dim), dtype)}
    if self.compressed:
      cache["entries"] = jnp.zeros((batch, capacity // self.ratio, self.config.head_dim), dtype)
      cache["pool_kv"], cache["pool_gate"] = self.compressor.init_state(batch, dtype, spare)
    if self.scored:
      cache["index_keys"] = jnp.zeros((batch, capacity // self.ratio,
                                       self.config.index_head_dim), dtype)
      cache["index_pool_kv"], cache["index_pool_gate"] = self.indexer.init_state(batch, dtype,
                                                                                 spare)
    return cache

  def _rotate(self, x, pos_BT, *, inverse: bool = False):
    r = self.config.rope_dim
    rotated = apply_rope(x[..., -r:], pos_BT, self.rope, interleaved=True, inverse=inverse,
                         max_position=self.config.max_position_embeddings)
    return jnp.concatenate([x[..., :-r], rotated], axis=-1)

  def __call__(self, x_BTD, cache: dict, start_B):
    """Attention of T new tokens at positions ``start_B + t``; returns ``(out_BTD, cache)``."""
    config = self.config
    b, t, _ = x_BTD.shape
    h, dh = config.num_attention_heads, config.head_dim
    pos_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    q_res_BTC = self.q_a_norm(self.q_a_proj(x_BTD))
    q_BTHL = unweighted_rms_norm(self.q_b_proj(q_res_BTC).reshape(b, t, h, dh),
                                 config.rms_norm_eps)
    q_BTHL = self._rotate(q_BTHL, pos_BT)
    kv_BTL = self._rotate(self.kv_norm(self.kv_proj(x_BTD)), pos_BT)
    sm_scale = dh**-0.5
    cache = dict(cache)

    with jax.named_scope("v4_window"):
      kv_BTL = kv_BTL.astype(cache["window"].dtype)  # as the ring holds it
      rows_BSL = jnp.concatenate([cache["window"], kv_BTL], 1)
      idx_BTW = window_indices(start_B, t, config.sliding_window, cache["window"].shape[1])
      parts = [self.ops.sparse_mqa(q_BTHL, rows_BSL.astype(q_BTHL.dtype), idx_BTW,
                                   sm_scale=sm_scale, d_v=dh)]
      cache["window"] = write_ring(cache["window"], kv_BTL, start_B)
    if self.compressed:
      entries, window_BJ, cache["pool_kv"], cache["pool_gate"] = self.compressor(
          x_BTD, cache["pool_kv"], cache["pool_gate"], start_B)
      cache["entries"] = write_entries(cache["entries"], entries, window_BJ)
      selection = compressed_selection(self, cache["entries"].shape[1])
      with jax.named_scope(selection.scope):
        idx_BTK = self._select(selection, x_BTD, q_res_BTC, pos_BT, start_B, cache)
        parts.append(self.ops.sparse_mqa(q_BTHL, cache["entries"].astype(q_BTHL.dtype),
                                         idx_BTK, sm_scale=sm_scale, d_v=dh))
    out_BTHL = merge_with_sink(parts, self.sinks[...]).astype(x_BTD.dtype)
    out_BTHL = self._rotate(out_BTHL, pos_BT, inverse=True)
    groups = config.o_groups
    out_BTGX = out_BTHL.reshape(b, t, groups, -1)
    w_GOX = self.o_a_proj.weight[...].reshape(groups, config.o_lora_rank, -1)
    grouped_BTGO = jnp.einsum("btgx,gox->btgo", out_BTGX, w_GOX.astype(out_BTGX.dtype),
                              preferred_element_type=jnp.float32).astype(x_BTD.dtype)
    return self.o_b_proj(grouped_BTGO.reshape(b, t, -1)), cache

  def _select(self, selection: CompressedSelection, x_BTD, q_res_BTC, pos_BT, start_B, cache):
    """Entry indices of each query, -1 for none: valid ones only, never an unwritten row."""
    capacity = cache["entries"].shape[1]
    visible_BT = (pos_BT + 1) // self.ratio  # entries [0, visible) are complete
    if selection is CompressedSelection.ALL:
      idx_C = jnp.arange(capacity, dtype=jnp.int32)
      return jnp.where(idx_C < visible_BT[..., None], idx_C, -1)
    keys, window_BJ, cache["index_pool_kv"], cache["index_pool_gate"] = self.indexer(
        x_BTD, cache["index_pool_kv"], cache["index_pool_gate"], start_B)
    cache["index_keys"] = write_entries(cache["index_keys"], keys, window_BJ)
    config = self.config
    b, t, _ = x_BTD.shape
    g, i = config.index_n_heads, config.index_head_dim
    q_BTGI = self._rotate(self.indexer.q_b_proj(q_res_BTC).reshape(b, t, g, i), pos_BT)
    w_BTG = self.indexer.weights_proj(x_BTD).astype(jnp.float32) * (g**-0.5 * i**-0.5)
    logits_BTC = self.ops.indexer_logits(
        q_BTGI, cache["index_keys"].astype(q_BTGI.dtype), w_BTG, jnp.zeros_like(visible_BT),
        visible_BT)
    return topk_indices(logits_BTC, min(config.index_topk, capacity))


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
