"""One softmax from partial ones: the log-sum-exp merge.

An attention op over a set of rows returns ``(out, lse)``: the softmax-weighted values over
its rows and the natural-log sum of their exponentiated logits (LSE +inf and out 0 for a
query with no row: ``pallas_kernels.sparse_mqa_reference``). Attention over the union of
several disjoint sets of rows is then each part's output weighted by ``exp(lse_part - lse)``.
DeepSeek-V4 merges its window's parts and its compressed entries with a learned sink logit
(``mla_jax.v4.attention``). Context parallelism applies the same rule across the ranks of a
pool split over a mesh axis, with its own collectives (the LSEs all-gathered, the outputs
reduce-scattered over the heads: ``mla_jax.context_parallel.merge_partials``), on the same
``combined_lse``.
"""

from __future__ import annotations

import jax.numpy as jnp


def combined_lse(lses, *, sink=None):
  """The LSE over the union of disjoint parts' rows from their LSEs stacked on axis 0 (-inf:
  a part without rows), with ``sink`` (broadcast against them) as one more logit; +inf where
  no part has rows and there is no sink. A part's share of the merged output is
  ``exp(lse_part - combined)``: 0 for a part without rows."""
  top = jnp.max(lses, axis=0)
  if sink is not None:
    sink = jnp.broadcast_to(sink.astype(jnp.float32), top.shape)
    top = jnp.maximum(top, sink)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  total = jnp.exp(lses - top).sum(axis=0)
  if sink is not None:
    total = total + jnp.exp(sink - top)
  attended = total > 0
  return jnp.where(attended, top + jnp.log(jnp.where(attended, total, 1.0)), jnp.inf)


def merge(parts, *, sink=None):
  """``(out, lse)`` of one softmax over every part's rows: ``parts`` is a list of partial
  ``(out [..., V], lse [...])`` over disjoint rows. ``sink`` (broadcast against the LSEs):
  one more logit in the denominator with no value, as V4's per-head sinks. A part with no
  rows (LSE +inf) weighs nothing; a query without any row (and no sink) gets out 0 and LSE
  +inf. ``out`` is float32."""
  lses = jnp.stack([jnp.where(lse == jnp.inf, -jnp.inf, lse) for _, lse in parts])
  lse = combined_lse(lses, sink=sink)
  shares = jnp.exp(lses - lse)
  out = sum(w[..., None] * out.astype(jnp.float32) for w, (out, _) in zip(shares, parts))
  return out, lse
