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
from mla_jax.v4.config import CSA, HCA, MOE, SLIDING, tiny_v4_config
from mla_jax.v4.model import V4CausalLM

ALL, SCORED, NONE = CompressedSelection.ALL, CompressedSelection.SCORED, CompressedSelection.NONE
SELECTION_SCOPES = {s.scope for s in CompressedSelection}


class AlwaysScoredCSA(CompressedSparseAttention):
  """A CSA layer that does not declare the skip: it must score at every capacity."""

  skips_complete_scoring: ClassVar[bool] = False


def step_program(layer_type: str, capacity: int, *, num_new: int = 3, cls=None):
  """Scopes and primitives of one step of a one-layer model of ``layer_type``."""
  config = tiny_v4_config(layer_types=(layer_type,), mlp_layer_types=(MOE,))
  model = V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla")
  if cls is not None:
    model.model.layers[0].self_attn.__class__ = cls
  caches = model.init_cache(1, capacity)
  graphdef, state = nnx.split(model)

  def step(state, ids, caches, start):
    return nnx.merge(graphdef, state)(ids, caches, start)

  jaxpr = jax.make_jaxpr(step)(state, jnp.zeros((1, num_new), jnp.int32), caches,
                               jnp.zeros((1,), jnp.int32))
  return traces.summarize_jaxpr(jaxpr)


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
  b, t, start = 2, min(capacity, 30), np.zeros(2, np.int32)
  cache = layer.init_cache(b, capacity, jnp.float32)
  x = jax.random.normal(jax.random.key(0), (b, t, config.hidden_size))
  pos = start[:, None] + np.arange(t)
  q_res = layer.q_a_norm(layer.q_a_proj(x))
  idx = np.asarray(layer._select(selection, x, q_res, jnp.asarray(pos), jnp.asarray(start),
                                 dict(cache)))
  visible = (pos + 1) // config.csa_ratio
  for bi in range(b):
    for ti in range(t):
      row = idx[bi, ti][idx[bi, ti] >= 0]
      assert len(set(row.tolist())) == len(row)
      assert (row < visible[bi, ti]).all()
      expected = min(visible[bi, ti], config.index_topk if selection is SCORED else
                     capacity // config.csa_ratio)
      assert len(row) == expected

