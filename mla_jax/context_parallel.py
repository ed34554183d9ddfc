"""Context parallelism: an engine's page pools split over the mesh's ``context`` axis.

Each of the ``C`` context ranks holds one block of every pool's rows (``sharding.POOL_SPEC``;
``PagedLayerCache`` puts page p in block ``p % C``, docs/scaling.md). Writes and the few row
gathers outside attention are partitioned by XLA (a masked local scatter; a masked gather and
an all-reduce). The two reads that scale with the context run here, under ``shard_map``, each
rank over its own rows only:

* the indexer (``MeshOps.ragged_topk``): each rank scores its own keys and keeps its own
  top-k of them. ``exact`` mode then all-gathers the ``k x C`` candidates (ids and scores,
  never rows) and takes the global top-k, equal to one device's (``merge_candidates``);
  ``union`` mode keeps each rank's own top-k, ``C x k`` indices in all, and exchanges nothing.
* the sparse MQA (``MeshOps.sparse_mqa``): each rank attends over the selected rows it holds,
  with a partial softmax, and the partial outputs merge by their log-sum-exp
  (``partial_softmax.merge``). In union mode every rank attends over its own top-k.

Nothing here decides a route: the context axis changes where rows live, never what a step
computes (``StepPlan.context_topk`` only says how a sparse step selects).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
