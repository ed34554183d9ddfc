"""Prefill routing: the only place that combines the module's and the backend's capabilities.

The decision is a pure Python function of static values (class-level capabilities, the
config's top-k, static token counts), so it is made while tracing: the branch not taken is
never compiled, and no ``cond`` decides a route at run time.

Three prefill routes for a DSA layer (docs/design.md §6):

* DENSE_MHA  - ``cached + new <= top-k``: every causal key is selected, so dense causal MHA is
  exact and the indexer's scoring is skipped;
* MASKED_MHA - ``top-k < cached + new <= backend.masked_mha_max_tokens``: the indexer scores and
  selects as on the sparse route, and attention runs in the MHA form over the causal keys,
  each query masked to its top-k set (fewer FLOPs per pair than the absorbed form);
* SPARSE_MQA - otherwise (and always for an unknown cached length): absorbed MQA over the
  selected rows.

The lesson of vLLM #52512 (docs/design.md §6): scoring was skipped by one component and dense MHA
chosen by another. Here the indexer's skip is a consequence of the route being DENSE_MHA,
which requires that both the layer class and the backend can run dense MHA. The masked route
needs its own capability on both sides too (``supports_masked_mha_prefill``, which defaults to
the dense one: see :func:`settle_masked_capability`).
"""

from __future__ import annotations

import enum

from mla_jax import checks


class PrefillRoute(enum.Enum):
  """How a prefill (or decode) step attends."""

  DENSE_MHA = "dense_mha"    # decompress per-head K/V, causal attention; no top-k needed
  MASKED_MHA = "masked_mha"  # indexer top-k; the MHA form over causal keys masked to the top-k
  SPARSE_MQA = "sparse_mqa"  # indexer scores and selects top-k; absorbed MQA over those rows
  DENSE_MQA = "dense_mqa"    # absorbed MQA over every causal row (MLA without an indexer)

  @property
  def needs_topk(self) -> bool:
    """Whether the indexer must score this step (the skip follows from this, nothing else)."""
    return self in (PrefillRoute.SPARSE_MQA, PrefillRoute.MASKED_MHA)

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


def masked_mha_allowed(layer, backend) -> bool:
  """Both the layer class and the backend declare masked-MHA prefill support."""
  return bool(layer.supports_masked_mha_prefill and backend.supports_masked_mha_prefill)


def settle_masked_capability(cls, *, implemented: bool, method: str) -> None:
  """Sets ``cls.supports_masked_mha_prefill`` from its declaration (``__init_subclass__``).

  A class (or its nearest ancestor) that declares the flag keeps that value; one that does not
  gets its dense capability, since the masked route is the dense MHA form plus a mask: a class
  that cannot run dense MHA cannot run masked either. Declaring True without ``method``
  (``implemented`` False), or without the dense capability, is a ``TypeError`` at class
  definition, so a capability can never name a path that does not exist.
  """
  if "supports_masked_mha_prefill" in vars(cls):  # declared in this class body
    cls._masked_mha_declared = bool(vars(cls)["supports_masked_mha_prefill"])
  declared = cls._masked_mha_declared
  capable = bool(cls.supports_dense_mha_prefill if declared is None else declared)
  if capable and not implemented:
    raise TypeError(f"{cls.__name__} declares supports_masked_mha_prefill = True but "
                    f"implements no {method} (masked MHA prefill path)")
  if capable and not cls.supports_dense_mha_prefill:
    raise TypeError(f"{cls.__name__} declares supports_masked_mha_prefill = True without "
                    "supports_dense_mha_prefill: the masked route is the dense MHA form")
  cls.supports_masked_mha_prefill = capable


def route_for_layers(layers, backend, *, num_new_tokens, num_cached_tokens,
                     force_mqa: bool = False, segmented: bool = False) -> PrefillRoute:
  """The one route of a step over ``layers`` (same config): an MHA route only if every layer
  (and the backend) can take it, so a shared-indexer layer never reads a skipped layer's
  top-k and routes stay model-wide. See :func:`resolve_prefill_route` for the rules.

  ``segmented``: a flat step of several sequences (``StepPlan.segmented``), where
  ``num_new_tokens`` bounds each sequence's new tokens. It has no masked route (its MHA form
  attends over this step's rows only, which hold every key of a fresh sequence and not the
  cached ones), so past the dense bound it takes the MQA route."""
  layers = tuple(layers)
  if not layers:
    raise ValueError("a step needs at least one attention layer")
  new = static_count(num_new_tokens, "num_new_tokens")
  if new is None:
    raise TypeError("num_new_tokens must be a static int, got None")
  num_cached_tokens = static_count(num_cached_tokens, "num_cached_tokens")
  known = not force_mqa and num_cached_tokens is not None
  dense_ok = known and all(dense_mha_allowed(layer, backend) for layer in layers)
  indexer = layers[0].config.indexer
  if indexer is None:
    return PrefillRoute.DENSE_MHA if dense_ok else PrefillRoute.DENSE_MQA
  if dense_ok and num_cached_tokens + new <= indexer.topk:
    return PrefillRoute.DENSE_MHA
  masked_ok = known and not segmented and all(masked_mha_allowed(layer, backend)
                                              for layer in layers)
  if masked_ok and indexer.topk < num_cached_tokens + new <= backend.masked_mha_max_tokens:
    return PrefillRoute.MASKED_MHA
  return PrefillRoute.SPARSE_MQA


def resolve_prefill_route(layer, backend, *, num_new_tokens, num_cached_tokens,
                          force_mqa: bool = False) -> PrefillRoute:
  """The route a prefill of ``num_new_tokens`` after ``num_cached_tokens`` takes.

  Args:
    layer: an attention module (or anything with ``supports_dense_mha_prefill``,
      ``supports_masked_mha_prefill`` and ``config.indexer``).
    backend: a ``Backend`` instance or class (a class reads its default
      ``masked_mha_max_tokens``).
    num_new_tokens: static count of tokens in this step (an int).
    num_cached_tokens: static upper bound of the cached context (an int), or None when
      unknown (decode); unknown means the conservative MQA route. Any other type is a
      ``TypeError``.
    force_mqa: take neither MHA route.

  Returns:
    With an indexer, for the total ``cached + new`` (``num_cached_tokens + num_new_tokens``):
    DENSE_MHA iff dense is allowed, not forced off, and ``cached + new <= index_topk``
    (inclusive: top-k then selects every causal key, so dense is exact); else MASKED_MHA iff
    masked is allowed, not forced off, and ``index_topk < cached + new <=
    backend.masked_mha_max_tokens`` (0 turns it off); otherwise SPARSE_MQA. Without an
    indexer: DENSE_MHA if dense is allowed and not forced off, else DENSE_MQA.
  """
  return route_for_layers([layer], backend, num_new_tokens=num_new_tokens,
                          num_cached_tokens=num_cached_tokens, force_mqa=force_mqa)
