"""Scanned layer groups: grouping, the HF name mapping of stacked parameters, equivalence with
running every layer on its own, and a traced program whose size does not grow with depth."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import testing as mt
from mla_jax.checkpoints import load_pretrained, save_pretrained
from mla_jax.models.config import LayerGroup, glm5_lm, layer_groups, tiny_lm
from mla_jax.models.hf_layout import hf_params
from mla_jax.models.lm import CausalLM
from mla_jax.traces import summarize
from tests.helpers import layer_by_layer


def _glm52_types(num_layers, freq=4, offset=3):
  return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared"
               for i in range(num_layers))


def test_full_size_groupings():
  glm52 = dataclasses.replace(glm5_lm(), indexer_types=_glm52_types(78))
  assert glm52.indexer_types.count("full") == 21
  assert layer_groups(glm52) == (LayerGroup(0, 1, 3), LayerGroup(3, 4, 18),
                                 LayerGroup(75, 1, 3))
  assert layer_groups(glm5_lm()) == (LayerGroup(0, 1, 3), LayerGroup(3, 1, 75))
  # A layer that starts no repetition is a group of its own.
  assert layer_groups(tiny_lm()) == (LayerGroup(0, 1, 1), LayerGroup(1, 1, 1))


def _indexshare_model(num_layers=9, attention="mqa-only"):
  """Dense layer 0, then MoE layers with a full/shared pattern: F F S S F S S F S ..."""
  config = dataclasses.replace(tiny_lm(attention), num_layers=num_layers,
                               indexer_types=_glm52_types(num_layers, freq=3, offset=3))
  model = CausalLM(config, rngs=nnx.Rngs(0), backend="xla")
  mt.randomize_params(model, 1)
  return model


_layer_by_layer = nnx.jit(layer_by_layer, static_argnames="capacity")


def test_scanned_groups_equal_layer_by_layer_and_round_trip(tmp_path):
  model = _indexshare_model()
  groups = model.layer_groups
  assert any(g.reps > 1 and g.unit_len > 1 for g in groups), groups
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)
  logits, _ = nnx.jit(lambda m, i, c: m(i, c, num_cached_tokens=0))(
      model, ids, model.init_cache(2, 32))
  np.testing.assert_allclose(logits, _layer_by_layer(model, ids, capacity=32), rtol=1e-5, atol=1e-5)
  params = hf_params(model)
  assert "model.layers.8.mlp.experts.7.down_proj.weight" in params
  assert not any(k.startswith("model.layers.3.self_attn.indexer") for k in params)  # shared
  np.testing.assert_array_equal(
      params["model.layers.5.self_attn.q_a_proj.weight"],
      np.asarray(model.layer_module(5).self_attn.q_a_proj.weight[...]))
  save_pretrained(model, tmp_path)
  loaded = load_pretrained(tmp_path, dtype=jnp.float32, backend="xla")
  for name, value in hf_params(loaded).items():
    np.testing.assert_array_equal(value, params[name], err_msg=name)


@pytest.mark.parametrize("attention", ["mqa-only", "dense-capable"])
def test_traced_program_does_not_grow_with_depth(attention):
  """A 4x deeper model traces to the same program: its layers run in the same scans."""

  def program(num_layers):
    config = dataclasses.replace(tiny_lm(attention), num_layers=num_layers)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), backend="xla"))
    ids = jnp.zeros((1, 8), jnp.int32)
    caches = jax.eval_shape(lambda: model.init_cache(1, 16))
    return summarize(nnx.jit(lambda m, i, c: m(i, c, num_cached_tokens=0)), model, ids, caches)

  shallow, deep = program(3), program(12)
  assert deep.primitives == shallow.primitives
  assert deep.kernel_primitives == shallow.kernel_primitives
