"""One softmax from partial ones: the log-sum-exp merge.

An attention op over a set of rows returns ``(out, lse)``: the softmax-weighted values over
its rows and the natural-log sum of their exponentiated logits (LSE +inf and out 0 for a
query with no row: ``pallas_kernels.sparse_mqa_reference``). Attention over the union of
several disjoint sets of rows is then each part's output weighted by ``exp(lse_part - lse)``.
DeepSeek-V4 merges its window's parts and its compressed entries with a learned sink logit
(``mla_jax.v4.attention``). Context parallelism applies the same rule across the ranks of a
pool split over a mesh axis, with its own collectives (the LSEs all-gathered, the outputs
reduce-scattered over the heads: ``mla_jax.context_parallel.merge_partials``).
"""

from __future__ import annotations

import jax.numpy as jnp


def merge(parts, *, sink=None):
  """``(out, lse)`` of one softmax over every part's rows: ``parts`` is a list of partial
  ``(out [..., V], lse [...])`` over disjoint rows. ``sink`` (broadcast against the LSEs):
  one more logit in the denominator with no value, as V4's per-head sinks. A part with no rows (LSE +inf) weighs nothing; a query
  without any row (and no sink) gets out 0 and LSE +inf. ``out`` is float32."""
  lses = jnp.stack([jnp.where(lse == jnp.inf, -jnp.inf, lse) for _, lse in parts])
  top = jnp.max(lses, axis=0)
  if sink is not None:
    sink = jnp.broadcast_to(sink.astype(jnp.float32), top.shape)
    top = jnp.maximum(top, sink)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp(lses - top)
  total = weights.sum(axis=0)
  out = sum(w[..., None] * out.astype(jnp.float32) for w, (out, _) in zip(weights, parts))
  if sink is not None:
    total = total + jnp.exp(sink - top)
  attended = total > 0
  total = jnp.where(attended, total, 1.0)
  out = jnp.where(attended[..., None], out / total[..., None], 0.0)
  return out, jnp.where(attended, top + jnp.log(total), jnp.inf)
