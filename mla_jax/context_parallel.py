"""Context parallelism: an engine's page pools split over the mesh's ``context`` axis.

Each of the ``C`` context ranks holds one block of every pool's rows (``sharding.POOL_SPEC``;
``PagedLayerCache`` puts page p in block ``p % C``, docs/scaling.md). Writes and the few row
gathers outside attention are partitioned by XLA (a masked local scatter; a masked gather and
an all-reduce). The two reads that scale with the context run here, under ``shard_map``, each
rank over its own rows only:

* the indexer (``MeshOps.ragged_topk``): each rank scores its own keys and keeps its own
  top-k of them. ``exact`` mode then all-gathers the ``k x C`` candidates (ids and scores in
  one collective, never rows; ``gather_candidates``) and takes the global top-k, equal to one
  device's (``merge_candidates``);
  ``union`` mode keeps each rank's own top-k, ``C x k`` indices in all, and exchanges nothing.
* the sparse MQA (``MeshOps.sparse_mqa``): the weights split their heads over
  ``tensor`` x ``context`` (``sharding.TENSOR_RANKS``), so each rank first all-gathers its
  tensor group's query heads over ``context``, attends with all of them over the selected
  rows it holds (a partial softmax), and the partial outputs merge by their log-sum-exp into
  each rank's own heads by a reduce-scatter (``merge_partials``). In union mode every rank
  attends over its own top-k.

Nothing here decides a route: the context axis changes where rows live, never what a step
computes (``StepPlan.context_topk`` only says how a sparse step selects).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mla_jax.partial_softmax import combined_lse
from mla_jax.sharding import CONTEXT

CONTEXT_TOPK_MODES = ("exact", "union")


def check_mode(mode) -> str:
  if mode not in CONTEXT_TOPK_MODES:
    raise ValueError(f"unknown context top-k mode {mode!r}; modes are "
                     f"{', '.join(CONTEXT_TOPK_MODES)}")
  return mode


def num_rows(pool) -> int:
  """The rows of a pool (an array, or fp8 parts that all lead with the rows)."""
  return jax.tree.leaves(pool)[0].shape[0]


def local_rows(rows, num_local: int):
  """Global pool rows -> this rank's rows of its block of ``num_local`` (-1: another rank's,
  or none). Inside ``shard_map`` over ``context`` only."""
  local = rows - jax.lax.axis_index(CONTEXT) * num_local
  return jnp.where((rows >= 0) & (local >= 0) & (local < num_local), local, -1)


def merge_partials(out_BTHV, lse_BTH, has_rows_BT, wire_dtype=None):
  """One softmax over every rank's rows from each rank's partial one, each rank keeping its
  own heads: ``out_BTHV`` / ``lse_BTH`` are this rank's partial attention of its tensor
  group's H heads over the rows it holds (``has_rows_BT``: it attended at least one row for
  that query; its LSE is then finite). Returns ``(out [B, T, H / C, V], lse [B, T, H / C])``
  of this rank's block of the heads (rank c the c-th), as the heads' spec holds them.

  The ranks all-gather their LSEs (H floats a query), scale their partial outputs by
  ``exp(lse - global lse)`` and reduce-scatter them over the heads (vLLM's DCP merge): each
  rank receives (C - 1) / C of one output, where an all-reduce would move twice that.
  ``wire_dtype`` is what the partial outputs cross the links in (default: their own dtype,
  bf16 in a bf16 model; docs/scaling.md measures its error). A query no rank attended gets
  out 0 and LSE +inf, as one device's op gives it."""
  dtype = out_BTHV.dtype
  lse_BTH = jnp.where(has_rows_BT[..., None], lse_BTH, -jnp.inf)
  lse_BTH_all = combined_lse(jax.lax.all_gather(lse_BTH, CONTEXT))
  share_BTH = jnp.exp(lse_BTH - lse_BTH_all)  # 0 on a rank without rows, or without any
  part_BTHV = share_BTH[..., None] * out_BTHV.astype(jnp.float32)
  part_BTHV = part_BTHV.astype(dtype if wire_dtype is None else wire_dtype)
  own_BThV = jax.lax.psum_scatter(part_BTHV, CONTEXT, scatter_dimension=2, tiled=True)
  heads = own_BThV.shape[2]
  own_lse_BTh = jax.lax.dynamic_slice_in_dim(lse_BTH_all, jax.lax.axis_index(CONTEXT) * heads,
                                             heads, axis=2)
  return own_BThV.astype(dtype), own_lse_BTh


def gather_candidates(values_RK, idx_RK):
  """Every rank's top-k candidates side by side, ``(values [R, C x k], positions [R, C x k])``
  (rank c's in columns ``[c k, (c + 1) k)``): one all-gather over ``context`` of the scores'
  bits beside the positions (a collective's latency, not two)."""
  bits_RK = jax.lax.bitcast_convert_type(values_RK.astype(jnp.float32), jnp.int32)
  both_RN2 = jax.lax.all_gather(jnp.stack([bits_RK, idx_RK.astype(jnp.int32)], axis=-1),
                                CONTEXT, axis=1, tiled=True)
  return jax.lax.bitcast_convert_type(both_RN2[..., 0], jnp.float32), both_RN2[..., 1]


def merge_candidates(values_BTN, idx_BTN, k: int):
  """The top-k of candidates (each rank's running top-k, laid side by side: values and key
  positions, -inf / -1 padded): exactly ``indexer.topk_indices`` over all their keys. Ordered
  by value, then by position, as ``lax.top_k`` orders one device's scores (ties go to the
  lower position). -1 where fewer than k finite candidates exist."""
  last = jnp.iinfo(jnp.int32).max
  neg_BTN = -values_BTN  # -inf padding sorts last
  order_BTN = jnp.where(idx_BTN < 0, last, idx_BTN)
  neg_BTN, _, idx_BTN = jax.lax.sort((neg_BTN, order_BTN, idx_BTN), num_keys=2)
  neg_BTK, idx_BTK = neg_BTN[..., :k], idx_BTN[..., :k]
  return jnp.where(neg_BTK == jnp.inf, -1, idx_BTK)
