"""The routing contract for DeepSeek-V4's layer types, on traced programs.

A layer's class fixes what it may select among compressed entries (``compressed_selection``):
sliding layers have none, HCA layers all, CSA layers the indexer's top-k, and skip scoring
(a complete selection of every valid entry) only because ``CompressedSparseAttention``
declares ``skips_complete_scoring`` and the cache holds no more entries than top-k. The traced
step of every class is walked for the scopes and kernels it contains.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import traces
from mla_jax.backends import XlaBackend
from mla_jax.v4.attention import (CompressedSelection, CompressedSparseAttention,
                                  HeavilyCompressedAttention, SlidingAttention,
                                  compressed_selection)
from mla_jax.v4.cache import V4Cache
from mla_jax.v4.config import CSA, HCA, MOE, SLIDING, tiny_v4_config
from mla_jax.v4.model import V4CausalLM
from mla_jax.v4.step_plan import selection_violations

ALL, SCORED, NONE = CompressedSelection.ALL, CompressedSelection.SCORED, CompressedSelection.NONE
SELECTION_SCOPES = {s.scope for s in CompressedSelection}


class AlwaysScoredCSA(CompressedSparseAttention):
  """A CSA layer that does not declare the skip: it must score at every capacity."""

  skips_complete_scoring: ClassVar[bool] = False


class MisdeclaredCSA(AlwaysScoredCSA):
  """Declares that it scores at every capacity, but selects every entry unscored: the
  deliberately mis-declared class the selection walk must catch."""

  def _select(self, selection, *args):
    return super()._select(CompressedSelection.ALL, *args)


def step_program(layer_type: str, capacity: int, *, num_new: int = 3, cls=None,
                 walk: bool = True):
  """Scopes and primitives of one step of a one-layer model of ``layer_type`` (its
  selections walked, ``selection_violations``)."""
  config = tiny_v4_config(layer_types=(layer_type,), mlp_layer_types=(MOE,))
  model = V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla")
  if cls is not None:
    model.model.layers[0].self_attn.__class__ = cls
  caches = model.init_cache(1, capacity)
  plan = model.step_plan(num_new, None, capacity=capacity)
  graphdef, state = nnx.split(model)

  def step(state, ids, caches):
    return nnx.merge(graphdef, state)(ids, caches, plan=plan)

  jaxpr = jax.make_jaxpr(step)(state, jnp.zeros((1, num_new), jnp.int32), caches)
  summary = traces.summarize_jaxpr(jaxpr)
  if walk:
    assert selection_violations(model.attentions, capacity, summary) == []
  return summary


@pytest.mark.parametrize("layer_type, capacity, expected", [
    (SLIDING, 64, NONE), (SLIDING, 8, NONE),
    (HCA, 64, ALL), (HCA, 16, ALL),
    (CSA, 64, SCORED),  # 16 entries > top-k 4
    (CSA, 16, ALL),  # 4 entries <= top-k 4: every entry fits, nothing to score
])
def test_traced_step_contains_only_its_class_selection(layer_type, capacity, expected):
  summary = step_program(layer_type, capacity)
  assert "v4_window" in summary.scopes
  present = summary.scopes & SELECTION_SCOPES
  assert present == ({expected.scope} if expected is not NONE else set())


def test_csa_without_the_declaration_scores_at_every_capacity():
  assert step_program(CSA, 16, cls=AlwaysScoredCSA).scopes & SELECTION_SCOPES == {
      SCORED.scope}


def test_the_selection_walk_catches_a_misdeclared_class():
  """Positive control: the walk that every V4 step program passes (here and in the engine,
  tests/test_v4_engine.py) refuses a class whose program skips the scoring it declares."""
  config = tiny_v4_config(layer_types=(CSA,), mlp_layer_types=(MOE,))
  model = V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla")
  model.model.layers[0].self_attn.__class__ = MisdeclaredCSA
  summary = step_program(CSA, 64, cls=MisdeclaredCSA, walk=False)
  assert selection_violations(model.attentions, 64, summary) == [
      "layer 0 (MisdeclaredCSA): does not score, its class declares SCORED"]


def test_selection_table():
  config = tiny_v4_config()
  layer = lambda cls: nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), backend=None))
  sliding, hca, csa = (layer(c) for c in (SlidingAttention, HeavilyCompressedAttention,
                                          CompressedSparseAttention))
  always = layer(AlwaysScoredCSA)
  topk = config.index_topk
  for capacity in (1, topk, topk + 1, 1000):
    assert compressed_selection(sliding, capacity) is NONE
    assert compressed_selection(hca, capacity) is ALL
    assert compressed_selection(always, capacity) is SCORED
    assert compressed_selection(csa, capacity) is (ALL if capacity <= topk else SCORED)


def test_capabilities_are_checked_at_class_definition():
  with pytest.raises(TypeError, match="skips_complete_scoring without scoring"):
    class SkippingHCA(HeavilyCompressedAttention):  # noqa: F841
      skips_complete_scoring: ClassVar[bool] = True
  with pytest.raises(TypeError, match="only a compressed layer can score"):
    class ScoringSliding(SlidingAttention):  # noqa: F841
      scored: ClassVar[bool] = True


@pytest.mark.parametrize("selection", [ALL, SCORED])
def test_selection_reads_only_written_entries(selection):
  """Every index a query gets is an entry complete at its position (< (pos + 1) // m) or -1,
  each at most once; the complete selection holds every such entry."""
  config = tiny_v4_config(layer_types=(CSA,), mlp_layer_types=(MOE,))
  layer = CompressedSparseAttention(config, rngs=nnx.Rngs(0), backend=XlaBackend())
  capacity = 16 if selection is ALL else 64
  b, t = 2, min(capacity, 30)
  cache = layer.init_cache(b, b, capacity, jnp.float32)  # sequence b: slot b, page b
  seqs = jnp.arange(b, dtype=jnp.int32)
  geo = V4Cache((cache,), jnp.zeros((b,), jnp.int32), seqs[:, None], seqs, capacity).geometry(
      t, jnp.full((b,), t))
  x = jax.random.normal(jax.random.key(0), (b * t, config.hidden_size))
  q_res = layer.q_a_norm(layer.q_a_proj(x))
  rows, _ = layer._select(selection, x, q_res, geo, cache, capacity)
  per_page = capacity // config.csa_ratio  # entry i of sequence b at row b * per_page + i
  rows = np.asarray(rows).reshape(b, t, -1)
  idx = np.where(rows >= 0, rows - np.arange(b)[:, None, None] * per_page, -1)
  pos = np.broadcast_to(np.arange(t), (b, t))
  visible = (pos + 1) // config.csa_ratio
  for bi in range(b):
    for ti in range(t):
      row = idx[bi, ti][idx[bi, ti] >= 0]
      assert len(set(row.tolist())) == len(row)
      assert (row < visible[bi, ti]).all()
      expected = min(visible[bi, ti], config.index_topk if selection is SCORED else
                     capacity // config.csa_ratio)
      assert len(row) == expected

