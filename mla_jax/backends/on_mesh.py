"""A backend's attention ops placed on a device mesh (or on one device, without a mesh).

The backend is kernels only; this wrapper adds where they run. On a mesh each op runs under
``shard_map`` with the specs of ``mla_jax.sharding.OP_SPECS``: the batch over ``data`` and
query heads over ``tensor``. That is also what lets the Pallas kernels, which XLA cannot
partition itself, run on a mesh.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import AbstractMesh, Mesh

from mla_jax import sharding
from mla_jax.backends.base import Backend


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

  def _placed(self, op: str, fn, num_args: int):
    in_specs, out_specs = sharding.OP_SPECS[op]
    return sharding.shard_map(fn, self.mesh, in_specs[:num_args], out_specs)

  def sparse_mqa(self, q_BTHL, kv_BSL, topk_BTK, *, sm_scale: float, d_v: int,
                 batched_rows: bool = True):
    """``Backend.sparse_mqa`` on the mesh (a shared pool, ``batched_rows`` False, is
    replicated: every data shard's sequences index it)."""
    fn = lambda q, kv, idx: self.backend.sparse_mqa(q, kv, idx, sm_scale=sm_scale, d_v=d_v,
                                                    batched_rows=batched_rows)
    return self._placed("sparse_mqa" if batched_rows else "sparse_mqa_pool", fn, 3)(
        q_BTHL, kv_BSL, topk_BTK)

  def indexer_logits(self, q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT, *, k_scale_BS=None,
                     key_rows_BS=None):
    """``Backend.indexer_logits`` on the mesh; fp8 key scales are split like the keys (a
    shared pool, ``key_rows_BS`` given, is replicated with its scales)."""
    fn = lambda q, k, w, s, e, ks, rows: self.backend.indexer_logits(
        q, k, w, s, e, k_scale_BS=ks, key_rows_BS=rows)
    op = "indexer_logits" if key_rows_BS is None else "indexer_logits_pool"
    return self._placed(op, fn, 7)(q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT, k_scale_BS,
                                   key_rows_BS)

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
