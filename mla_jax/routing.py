"""Prefill routing: the only place that combines the module's and the backend's capabilities.

The decision is a pure Python function of static values (class-level capabilities, the
config's top-k, static token counts), so it is made while tracing: the branch not taken is
never compiled, and no ``cond`` decides a route at run time.

The lesson of vLLM #52512 (docs/design.md §6): scoring was skipped by one component and dense MHA
chosen by another. Here the indexer's skip is a consequence of the route being DENSE_MHA,
which requires that both the layer class and the backend can run dense MHA.
"""

from __future__ import annotations

import enum

from mla_jax import checks


class PrefillRoute(enum.Enum):
  """How a prefill (or decode) step attends."""

  DENSE_MHA = "dense_mha"    # decompress per-head K/V, causal attention; no top-k needed
  SPARSE_MQA = "sparse_mqa"  # indexer scores and selects top-k; absorbed MQA over those rows
  DENSE_MQA = "dense_mqa"    # absorbed MQA over every causal row (MLA without an indexer)

  @property
  def needs_topk(self) -> bool:
    """Whether the indexer must score this step (the skip follows from this, nothing else)."""
    return self is PrefillRoute.SPARSE_MQA

  @property
  def scope(self) -> str:
    """The ``jax.named_scope`` under which this route's attention is traced."""
    return "mla_" + self.value


def static_count(value, name: str) -> int | None:
  """A token count as a Python int >= 0; None (an unknown count) passes through.

  Only None means unknown: a string, float, bool or traced value is a ``TypeError`` (a traced
  count cannot route; pass it as a static argument, or None for the conservative route).
  """
  if value is None:
    return None
  if not checks.is_int(value):
    raise TypeError(f"{name} must be a static int or None, got {type(value).__name__} "
                    f"{value!r}")
  if value < 0:
    raise ValueError(f"{name} must be >= 0, got {value}")
  return int(value)


def dense_mha_allowed(layer, backend) -> bool:
  """Both the layer class and the backend declare dense-MHA prefill support."""
  return bool(layer.supports_dense_mha_prefill and backend.supports_dense_mha_prefill)


def resolve_prefill_route(layer, backend, *, num_new_tokens, num_cached_tokens,
                          force_mqa: bool = False) -> PrefillRoute:
  """The route a prefill of ``num_new_tokens`` after ``num_cached_tokens`` takes.

  Args:
    layer: an attention module (or anything with ``supports_dense_mha_prefill`` and
      ``config.indexer``).
    backend: a ``Backend`` instance or class.
    num_new_tokens: static count of tokens in this step (an int).
    num_cached_tokens: static upper bound of the cached context (an int), or None when
      unknown (decode); unknown means the conservative MQA route. Any other type is a
      ``TypeError``.
    force_mqa: never take the dense route.

  Returns:
    With an indexer: DENSE_MHA iff dense is allowed, not forced off, and the total
    ``num_cached_tokens + num_new_tokens <= index_topk`` (inclusive: top-k then selects
    every causal key, so dense is exact); otherwise SPARSE_MQA. Without an indexer: DENSE_MHA
    if dense is allowed and not forced off, else DENSE_MQA.
  """
  new = static_count(num_new_tokens, "num_new_tokens")
  if new is None:
    raise TypeError("num_new_tokens must be a static int, got None")
  cached = static_count(num_cached_tokens, "num_cached_tokens")
  dense_ok = dense_mha_allowed(layer, backend) and not force_mqa and cached is not None
  indexer = layer.config.indexer
  if indexer is None:
    return PrefillRoute.DENSE_MHA if dense_ok else PrefillRoute.DENSE_MQA
  if dense_ok and cached + new <= indexer.topk:
    return PrefillRoute.DENSE_MHA
  return PrefillRoute.SPARSE_MQA
