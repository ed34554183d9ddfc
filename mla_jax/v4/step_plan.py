"""DeepSeek-V4's step plan: what each layer selects among compressed entries, decided once.

A ``V4StepPlan`` is to V4 what ``mla_jax.step_plan.StepPlan`` is to V3.2: every static
decision of one compiled step, frozen and hashable (a ``jit`` static argument, a
compile-cache key), resolved in Python from the layers' classes and the caches' capacity by
``compressed_selection``, the one function that reads the classes' declarations. Each layer
then runs its plan's selection and nothing else (``V4Attention.__call__``).

A plan cannot exist for a class that does not declare what it asks: a selection among
compressed entries for a layer without a compressor, a scored one for a layer that does not
score, a complete one without scoring for a scoring layer that does not declare
``skips_complete_scoring``. ``selection_violations`` walks a traced step program for what it
actually holds, layer by layer (the engine's programs included): the positive control is a
class whose declaration and computation disagree.
"""

from __future__ import annotations

import dataclasses

from mla_jax import checks
from mla_jax.traces import ProgramSummary, scopes_within
from mla_jax.v4.attention import CompressedSelection, compressed_selection

SELECTION_SCOPES = frozenset(s.scope for s in CompressedSelection)


@dataclasses.dataclass(frozen=True)
class V4StepPlan:
  """What one V4 step does, for every layer.

  Attributes:
    num_new_tokens: tokens per row-sequence (1 in a flat step, ``segmented``).
    num_cached_tokens: static bound of the cached lengths, or None (unknown until run time).
    kv_rows: positions any row may read: each layer reads entries ``[0, kv_rows // m)``.
    capacity: positions the caches hold per sequence; the selections follow it.
    selections: each layer's ``CompressedSelection``.
    layer_classes: each layer's attention class, which the plan was resolved for.
    segmented: an engine's flat step (each row one token of the sequence its segment names).
  """

  num_new_tokens: int
  num_cached_tokens: int | None
  kv_rows: int
  capacity: int
  selections: tuple[CompressedSelection, ...]
  layer_classes: tuple[type, ...]
  segmented: bool = False

  def __post_init__(self):
    checks.static_int(self.num_new_tokens, "num_new_tokens", minimum=1)
    if self.num_cached_tokens is not None:
      checks.static_int(self.num_cached_tokens, "num_cached_tokens", minimum=0)
    checks.static_int(self.capacity, "capacity", minimum=1)
    checks.static_int(self.kv_rows, "kv_rows", minimum=1, maximum=self.capacity)
    if len(self.selections) != len(self.layer_classes):
      raise ValueError(f"{len(self.selections)} selections for {len(self.layer_classes)} "
                       "layers")
    for cls, selection in zip(self.layer_classes, self.selections):
      problem = _undeclared(cls, selection)
      if problem:
        raise ValueError(f"a step plan cannot select {selection.name} for {cls.__name__}: "
                         f"{problem}")
    if self.segmented and self.num_new_tokens != 1:
      raise ValueError("a segmented step plan has one token per row, not "
                       f"{self.num_new_tokens}")


def _undeclared(cls, selection: CompressedSelection) -> str | None:
  """Why ``cls``'s declarations do not allow ``selection`` (None: they do)."""
  if selection is CompressedSelection.NONE:
    return "it has a compressor" if cls.compressed else None
  if not cls.compressed:
    return "it has no compressor (compressed = False)"
  if selection is CompressedSelection.SCORED and not cls.scored:
    return "it does not score (scored = False)"
  if selection is CompressedSelection.ALL and cls.scored and not cls.skips_complete_scoring:
    return "it scores and does not declare skips_complete_scoring"
  return None


def plan_v4_step(layers, *, num_new_tokens: int, num_cached_tokens: int | None,
                 capacity: int, kv_rows: int | None = None,
                 segmented: bool = False) -> V4StepPlan:
  """The plan of one step over ``layers`` (attention modules) with caches of ``capacity``
  positions: each layer's selection among the entries they hold (``compressed_selection``);
  ``kv_rows`` defaults to the capacity."""
  layers = tuple(layers)
  capacity = checks.static_int(capacity, "capacity", minimum=1)
  return V4StepPlan(
      num_new_tokens=num_new_tokens, num_cached_tokens=num_cached_tokens,
      kv_rows=capacity if kv_rows is None else kv_rows, capacity=capacity,
      selections=tuple(compressed_selection(layer, entries(layer, capacity))
                       for layer in layers),
      layer_classes=tuple(type(layer) for layer in layers), segmented=segmented)


def entries(layer, capacity: int) -> int:
  """Compressed entries a layer's cache holds per sequence of ``capacity`` positions."""
  return capacity // layer.ratio if layer.compressed else 0


def layer_scope(index: int) -> str:
  """The named scope of main layer ``index``'s computations (what the walk reads)."""
  return f"v4_layer_{index}"


def selection_violations(layers, capacity: int, summary: ProgramSummary) -> list[str]:
  """The selection contract on a traced step program, layer by layer (each layer's scopes,
  ``layer_scope``): what each layer must hold by its class's declarations and the caches'
  ``capacity`` (``compressed_selection``), against what it holds. Every layer holds the
  window (``v4_window``); a sliding layer no compressor; an HCA layer all entries and no
  indexer; a CSA layer scores (``v4_indexer``, ``v4_compressed_scored``) unless its class
  declares ``skips_complete_scoring`` and the cache holds no more entries than top-k, where
  it takes every entry unscored. Returns one line per violation (empty: none)."""
  problems = []
  for i, layer in enumerate(layers):
    held = scopes_within(summary, layer_scope(i))
    want = compressed_selection(layer, entries(layer, capacity))
    name = f"layer {i} ({type(layer).__name__})"
    if "v4_window" not in held:
      problems.append(f"{name}: no window attention")
    if ("v4_compressor" in held) != layer.compressed:
      problems.append(f"{name}: a compressor {'missing' if layer.compressed else 'held'}")
    expected = set() if want is CompressedSelection.NONE else {want.scope}
    if held & SELECTION_SCOPES != expected:
      problems.append(f"{name}: selects {sorted(held & SELECTION_SCOPES)}, its class "
                      f"declares {want.name}")
    if ("v4_indexer" in held) != (want is CompressedSelection.SCORED):
      problems.append(f"{name}: {'scores' if 'v4_indexer' in held else 'does not score'}, "
                      f"its class declares {want.name}")
  return problems
