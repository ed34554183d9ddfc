"""A backend's attention ops placed on a device mesh (or on one device, without a mesh).

The backend is kernels only; this wrapper adds where they run. On a mesh each op runs under
``shard_map`` with the specs of ``mla_jax.sharding.OP_SPECS``: the batch over ``data`` and
query heads over ``tensor``. That is also what lets the Pallas kernels, which XLA cannot
partition itself, run on a mesh. On a mesh with a ``context`` axis the ops that read an
engine's page pool run on each rank's block of it (``mla_jax.context_parallel``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from mla_jax import context_parallel, partial_softmax, sharding
from mla_jax.backends.base import Backend
from mla_jax.indexer import KeyBlocks, segmented_topk

# Candidates and union top-k: each context rank's k columns side by side.
_SPLIT_TOPK_SPEC = P(sharding.DATA, None, sharding.CONTEXT)


@dataclasses.dataclass(frozen=True)
class MeshOps:
  """``backend``'s batched ops, sharded over ``mesh`` (None: called as they are)."""

  backend: Backend
  mesh: Mesh | AbstractMesh | None = None

  def __post_init__(self):
    if not isinstance(self.backend, Backend):
      raise TypeError(f"backend must be a Backend, got {type(self.backend).__name__}")
    if self.mesh is not None and not isinstance(self.mesh, (Mesh, AbstractMesh)):
      raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(self.mesh).__name__}")

  @property
  def context(self) -> int:
    """Ranks of the mesh's ``context`` axis (1: pools whole on every device)."""
    return sharding.axis_size(self.mesh, sharding.CONTEXT)

  def _placed(self, op: str, fn, num_args: int):
    in_specs, out_specs = sharding.OP_SPECS[op]
    return sharding.shard_map(fn, self.mesh, in_specs[:num_args], out_specs)

  def sparse_mqa(self, q_BTHL, kv_BSL, topk_BTK, *, sm_scale: float, d_v: int,
                 batched_rows: bool = True, split_rows: bool = False):
    """``Backend.sparse_mqa`` on the mesh (a shared pool, ``batched_rows`` False, is
    replicated: every data shard's sequences index it; or, on a context axis, split over it,
    each rank attending over the rows it holds).

    ``split_rows``: the rows are a union top-k (``ragged_topk``), each context rank's own
    k columns of ``topk_BTK`` on that rank."""
    fn = lambda q, kv, idx: self.backend.sparse_mqa(q, kv, idx, sm_scale=sm_scale, d_v=d_v,
                                                    batched_rows=batched_rows)
    if not batched_rows and self.context > 1:
      return self._sparse_mqa_split(fn, q_BTHL, kv_BSL, topk_BTK, split_rows)
    return self._placed("sparse_mqa" if batched_rows else "sparse_mqa_pool", fn, 3)(
        q_BTHL, kv_BSL, topk_BTK)

  def _sparse_mqa_split(self, fn, q_BTHL, pool, rows_BTK, split_rows: bool):
    """Each rank's partial attention over the pool rows it holds, merged by LSE."""
    def partial(q, kv, rows):
      rows = context_parallel.local_rows(rows, context_parallel.num_rows(kv))
      out, lse = fn(q, kv, rows)  # a rank without rows for a query: out 0, LSE +inf
      merged, lse = partial_softmax.merge([(out, lse)], axis_name=sharding.CONTEXT)
      return merged.astype(out.dtype), lse

    heads = sharding.HEADS_SPEC
    rows_spec = _SPLIT_TOPK_SPEC if split_rows else sharding.BATCH_SPEC
    return sharding.shard_map(partial, self.mesh, (heads, sharding.POOL_SPEC, rows_spec),
                              (heads, heads))(q_BTHL, pool, rows_BTK)

  def indexer_logits(self, q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT, *, k_scale_BS=None,
                     key_rows_BS=None):
    """``Backend.indexer_logits`` on the mesh; fp8 key scales are split like the keys (a
    shared pool, ``key_rows_BS`` given, is replicated with its scales)."""
    fn = lambda q, k, w, s, e, ks, rows: self.backend.indexer_logits(
        q, k, w, s, e, k_scale_BS=ks, key_rows_BS=rows)
    if key_rows_BS is not None and self.context > 1:
      # Each rank scores the keys it holds; every column is one rank's (-inf elsewhere).
      scored = lambda *args: jax.lax.pmax(self._local_logits(*args), sharding.CONTEXT)
      return self._on_pool(scored)(q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT, k_scale_BS,
                                   key_rows_BS)
    op = "indexer_logits" if key_rows_BS is None else "indexer_logits_pool"
    return self._placed(op, fn, 7)(q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT, k_scale_BS,
                                   key_rows_BS)

  def _local_logits(self, q, keys, w, starts, ends, k_scale, key_rows):
    """Inside ``shard_map`` over ``context``: the logits of the pool keys this rank holds
    (-inf in the columns of another rank's keys)."""
    rows = context_parallel.local_rows(key_rows, context_parallel.num_rows(keys))
    return self.backend.indexer_logits(q, keys, w, starts, ends, k_scale_BS=k_scale,
                                       key_rows_BS=rows)

  def _on_pool(self, fn):
    """``fn(q, keys, w, starts, ends, key scales, key rows)`` under ``shard_map``: the pool
    and its scales split over ``context``, the rest (and the output) over ``data``."""
    batch, pool = sharding.BATCH_SPEC, sharding.POOL_SPEC
    in_specs = (batch, pool, batch, batch, batch, pool, batch)
    return sharding.shard_map(fn, self.mesh, in_specs, batch)

  def ragged_topk(self, q_NTGI, keys, w_NTG, ends_NT, k_scale, key_rows_NC,
                  blocks: KeyBlocks, k: int, mode: str):
    """Each row's top-k over the keys of its own blocks (``Indexer.select_in_blocks``):
    the blocks' logits (one query token a block, ``T`` = 1) and ``indexer.segmented_topk``,
    [R, k]. On a context axis each rank scores the keys it holds and keeps its own top-k:
    ``union`` mode keeps every rank's, [R, context x k] (each rank's k columns on that rank);
    ``exact`` mode all-gathers the candidates (scores and positions, never rows) and takes
    the global top-k, equal to one device's (``context_parallel.merge_candidates``)."""
    starts_NT = jnp.zeros_like(ends_NT)
    if self.context == 1:
      logits_NTC = self.indexer_logits(q_NTGI, keys, w_NTG, starts_NT, ends_NT,
                                       k_scale_BS=k_scale, key_rows_BS=key_rows_NC)
      return segmented_topk(logits_NTC[:, 0], blocks, k)[1]
    union = context_parallel.check_mode(mode) == "union"

    def local(q, keys, w, starts, ends, k_scale, key_rows, blocks):
      values_RK, idx_RK = segmented_topk(
          self._local_logits(q, keys, w, starts, ends, k_scale, key_rows)[:, 0], blocks, k)
      if union:
        return idx_RK
      gather = lambda a: jax.lax.all_gather(a, sharding.CONTEXT, axis=1, tiled=True)[:, None]
      return context_parallel.merge_candidates(gather(values_RK), gather(idx_RK), k)[:, 0]

    # The blocks stay whole on every rank (they index the step's rows, not the pool).
    whole, pool = P(), sharding.POOL_SPEC
    in_specs = (whole, pool, whole, whole, whole, pool, whole, whole)
    out_spec = P(None, sharding.CONTEXT) if union else whole
    return sharding.shard_map(local, self.mesh, in_specs, out_spec)(
        q_NTGI, keys, w_NTG, starts_NT, ends_NT, k_scale, key_rows_NC, blocks)

  def dense_mha(self, q_BTHQ, k_BSHQ, v_BSHV, *, sm_scale: float, q_offset_B, kv_len_B,
                segment_ids_BT=None):
    """``Backend.dense_mha`` on the mesh (segmented: the one flat sequence whole on every
    data shard, ``sharding.FLAT_HEADS_SPEC``)."""
    if segment_ids_BT is None:
      fn = lambda q, k, v, off, n: self.backend.dense_mha(q, k, v, sm_scale=sm_scale,
                                                          q_offset_B=off, kv_len_B=n)
      return self._placed("dense_mha", fn, 5)(q_BTHQ, k_BSHQ, v_BSHV, q_offset_B, kv_len_B)
    fn = lambda q, k, v, off, n, seg: self.backend.dense_mha(
        q, k, v, sm_scale=sm_scale, q_offset_B=off, kv_len_B=n, segment_ids_BT=seg)
    return self._placed("segmented_mha", fn, 6)(q_BTHQ, k_BSHQ, v_BSHV, q_offset_B, kv_len_B,
                                                segment_ids_BT)

  def masked_mha(self, q_BTHQ, k_BSHQ, v_BSHV, topk_BTK, *, sm_scale: float, q_offset_B,
                 kv_len_B):
    """``Backend.masked_mha`` on the mesh (the top-k rows split with the batch)."""
    fn = lambda q, k, v, idx, off, n: self.backend.masked_mha(q, k, v, idx, sm_scale=sm_scale,
                                                              q_offset_B=off, kv_len_B=n)
    return self._placed("masked_mha", fn, 6)(q_BTHQ, k_BSHQ, v_BSHV, topk_BTK, q_offset_B,
                                             kv_len_B)
