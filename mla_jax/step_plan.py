"""The step plan: every static decision of one compiled step, made once and read by each layer.

A ``StepPlan`` is resolved in Python from static values (the layers' and the backend's
capabilities, the static token counts, the cache bound) before anything is traced, and then
passed down to every layer in place of loose keyword arguments. A layer never decides again:
it validates its inputs, projects, writes its caches, and runs the one function of
``plan.route``; the other routes are never traced.

The plan is frozen and hashable, so it can be a static argument of ``jax.jit`` and a key of a
compile cache. It records the layer classes and the backend class it was resolved for, and a
dense (or masked) route for any of them that cannot run it is refused when the plan is built, so no
plan that would misroute an MQA-only model (vLLM #52512, docs/design.md §6) can exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from mla_jax import checks, context_parallel, sharding
from mla_jax.cache import bucket_rows
from mla_jax.routing import PrefillRoute, route_for_layers, static_count

INDEXER_LOSSES = (None, "dense", "sparse")
# The MHA-form routes and the capability each needs on every layer class and the backend.
_MHA_CAPABILITY = {PrefillRoute.DENSE_MHA: "supports_dense_mha_prefill",
                   PrefillRoute.MASKED_MHA: "supports_masked_mha_prefill"}


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """What one step does, for every layer of a model (or for one standalone layer).

  Attributes:
    route: the model-wide route of this step (``routing.resolve_prefill_route``).
    num_new_tokens: tokens per sequence in this step (the static T of its inputs).
    num_cached_tokens: static upper bound of every sequence's cached length, or None when it is
      only known at run time (decode); the dense route needs it (it reads that many rows).
    kv_rows: cache rows that attention and the indexer read; rows past it are never touched.
    layer_classes: the attention classes the plan was resolved for.
    backend_class: the backend class the plan was resolved for.
    indexer_loss: training only: ``None | "dense" | "sparse"`` (``MLAAttentionBase``).
    carry_topk: IndexShare (GLM-5.2): each full layer hands its top-k to the shared layers
      after it. True only on a route that selects top-k in a model with shared layers.
    segmented: a flat step (the engine's): every row is one token of the sequence its cache
      view's ``segment_ids_B`` names, at the position its ``num_cached_B`` gives, so
      ``num_new_tokens`` is 1 and ``num_cached_tokens`` is per sequence: 0 when every sequence
      starts empty (the only case with an MHA route: ``DENSE_MHA`` over this step's rows,
      masked to each sequence), None otherwise. See ``plan_flat_step``.
    key_chunk: a segmented plan's indexer scores its keys this many positions at a time, up
      to the longest row's reach only (``Indexer.select_in_key_chunks``), so ``kv_rows`` can
      be the whole capacity without costing its scoring.
    context_topk: how a segmented plan's indexer selects over a page pool split on a mesh's
      ``context`` axis (``mla_jax.context_parallel``): ``"exact"`` (the global top-k, as one
      device) or ``"union"`` (each rank's own top-k). It never changes the route.
  """

  route: PrefillRoute
  num_new_tokens: int
  num_cached_tokens: int | None
  kv_rows: int
  layer_classes: tuple[type, ...]
  backend_class: type
  indexer_loss: str | None = None
  carry_topk: bool = False
  segmented: bool = False
  key_chunk: int | None = None
  context_topk: str = "exact"

  def __post_init__(self):
    context_parallel.check_mode(self.context_topk)
    if not isinstance(self.route, PrefillRoute):
      raise TypeError(f"route must be a PrefillRoute, got {self.route!r}")
    checks.static_int(self.num_new_tokens, "num_new_tokens", minimum=1)
    if self.num_cached_tokens is not None:
      checks.static_int(self.num_cached_tokens, "num_cached_tokens", minimum=0)
    checks.static_int(self.kv_rows, "kv_rows", minimum=1)
    if self.indexer_loss not in INDEXER_LOSSES:
      raise ValueError(f"indexer_loss must be one of {INDEXER_LOSSES}, got "
                       f"{self.indexer_loss!r}")
    if not self.layer_classes:
      raise ValueError("a step plan needs the layer classes it is resolved for")
    if self.route in _MHA_CAPABILITY:
      flag = _MHA_CAPABILITY[self.route]
      unable = [cls.__name__ for cls in (*self.layer_classes, self.backend_class)
                if not getattr(cls, flag)]
      if unable:
        raise ValueError(f"a {self.route.name} step plan cannot be built for "
                         f"{', '.join(unable)}: it declares {flag} = False")
      if self.num_cached_tokens is None:
        raise ValueError(f"a {self.route.name} step plan needs a static cached-token bound")
    if self.segmented:
      self._check_segmented()
    elif self.key_chunk is not None:
      raise ValueError("key_chunk is for segmented step plans (a page pool's flat step)")
    if self.carry_topk and not self.route.needs_topk:
      raise ValueError(f"carry_topk needs a route that selects top-k, not {self.route.name}")
    if (self.num_cached_tokens is not None
        and self.num_cached_tokens + self.num_new_tokens > self.kv_rows):
      raise ValueError(f"kv_rows={self.kv_rows} is fewer than the {self.num_cached_tokens} "
                       f"cached + {self.num_new_tokens} new rows this step can reach")

  def _check_segmented(self) -> None:
    if self.num_new_tokens != 1:
      raise ValueError(f"a segmented step plan has one token per row, not {self.num_new_tokens}")
    if self.route is PrefillRoute.MASKED_MHA:
      raise ValueError("a segmented step plan has no MASKED_MHA route (its MHA form reads only "
                       "this step's rows)")
    if self.route is PrefillRoute.DENSE_MHA and self.num_cached_tokens != 0:
      raise ValueError("a segmented DENSE_MHA step plan needs every sequence fresh "
                       "(num_cached_tokens 0)")
    if self.indexer_loss is not None:
      raise ValueError("a segmented step plan is for inference: it takes no indexer loss")
    if self.key_chunk is not None:
      checks.static_int(self.key_chunk, "key_chunk", minimum=1)

  @property
  def bounds_num_cached(self) -> bool:
    """Whether ``num_cached_tokens`` bounds every row's cached length (a segmented plan's is per
    sequence: its rows' lengths are their positions)."""
    return self.num_cached_tokens is not None and not self.segmented

  def check_layer(self, layer) -> None:
    """Refuses a plan resolved for other classes (it could carry a route they cannot run)."""
    if type(layer) not in self.layer_classes or not isinstance(layer.backend,
                                                               self.backend_class):
      raise ValueError(f"this step plan was resolved for {_names(self.layer_classes)} on "
                       f"{self.backend_class.__name__}, not {type(layer).__name__} on "
                       f"{type(layer.backend).__name__}")


def _names(classes) -> str:
  return ", ".join(cls.__name__ for cls in classes)


def static_num_cached(num_cached_tokens, num_cached_B) -> int | None:
  """The static cached-token bound of a call: ``num_cached_tokens`` when given, else the
  longest of concrete ``num_cached_B`` (an eager call), else None (traced: unknown until run)."""
  bound = static_count(num_cached_tokens, "num_cached_tokens")
  if bound is None and not checks.is_traced(num_cached_B):
    bound = int(sharding.fetch(num_cached_B).max())
  return bound


def step_route(layers, backend, *, num_new_tokens: int, num_cached_tokens,
               force_mqa: bool = False) -> PrefillRoute:
  """The model-wide route of a step over ``layers``: an MHA route (dense or masked) only if
  every layer can take it.

  (So a GLM shared-indexer layer never reuses indices that a skipped layer did not compute.)
  ``routing.route_for_layers`` checks the counts: static ints, None cached is unknown.
  """
  return route_for_layers(layers, backend, num_new_tokens=num_new_tokens,
                          num_cached_tokens=num_cached_tokens, force_mqa=force_mqa)


def plan_step(layers: Iterable, backend, *, num_new_tokens: int, num_cached_tokens,
              capacity: int, kv_rows: int | None = None, force_mqa: bool = False,
              indexer_loss: str | None = None, shares_topk: bool = False) -> StepPlan:
  """The plan of one step over ``layers`` (attention modules, all with the same config).

  The route is model-wide: unless every layer (and the backend) can take an MHA route (dense
  or masked), all take the MQA one, so a shared-indexer layer never follows a full layer that skipped
  scoring. ``kv_rows`` defaults to the rows this step can reach rounded up to a bucket
  (``cache.bucket_rows``) when the cached bound is known, else ``capacity``.
  ``shares_topk``: the model has IndexShare layers that read a full layer's top-k.
  """
  layers = tuple(layers)
  capacity = checks.static_int(capacity, "capacity", minimum=1)
  route = step_route(layers, backend, num_new_tokens=num_new_tokens,
                     num_cached_tokens=num_cached_tokens, force_mqa=force_mqa)
  new = int(num_new_tokens)
  num_cached_tokens = static_count(num_cached_tokens, "num_cached_tokens")
  if kv_rows is None:
    kv_rows = (capacity if num_cached_tokens is None
               else bucket_rows(num_cached_tokens + new, capacity))
  elif not checks.is_int(kv_rows) or not 0 < kv_rows <= capacity:
    raise ValueError(f"kv_rows must be an int in [1, capacity={capacity}], got {kv_rows!r}")
  return StepPlan(route=route, num_new_tokens=new, num_cached_tokens=num_cached_tokens,
                  kv_rows=int(kv_rows),
                  layer_classes=tuple(dict.fromkeys(type(layer) for layer in layers)),
                  backend_class=type(backend), indexer_loss=indexer_loss,
                  carry_topk=shares_topk and route.needs_topk)


def plan_flat_step(layers: Iterable, backend, *, fresh_tokens: int | None, kv_rows: int,
                   key_chunk: int | None = None, shares_topk: bool = False,
                   context_topk: str = "exact") -> StepPlan:
  """The plan of an engine's flat step over ``layers``: one token per row, each row's
  sequence named by its cache view's segment ids (``StepPlan.segmented``).

  ``fresh_tokens``: when every sequence of the step starts empty, a static bound on the
  tokens any one of them holds (the dense route may then apply: ``routing.route_for_layers``
  with ``segmented``); None when any sequence has cached rows or decodes, and the route is
  then the MQA one, as in decode. ``kv_rows`` bounds the cache rows any row reads;
  ``key_chunk``, ``context_topk``: see ``StepPlan``.
  """
  layers = tuple(layers)
  fresh = static_count(fresh_tokens, "fresh_tokens")
  route = route_for_layers(layers, backend, num_new_tokens=fresh or 1,
                           num_cached_tokens=0 if fresh else None, segmented=True)
  return StepPlan(route=route, num_new_tokens=1, num_cached_tokens=0 if fresh else None,
                  kv_rows=checks.static_int(kv_rows, "kv_rows", minimum=1),
                  layer_classes=tuple(dict.fromkeys(type(layer) for layer in layers)),
                  backend_class=type(backend), carry_topk=shares_topk and route.needs_topk,
                  segmented=True, key_chunk=key_chunk, context_topk=context_topk)
