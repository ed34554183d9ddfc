"""The step plan: resolved once per step, hashable, and impossible to build with a dense route
for a layer class or backend that cannot run dense."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import mla_jax as m
from mla_jax.backends import XlaBackend
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.routing import PrefillRoute
from mla_jax.step_plan import StepPlan, plan_step
from mla_jax.traces import traced_scopes
from tests.helpers import XlaNoDenseBackend, call

TOPK = m.tiny().indexer.topk


def _plan(**overrides):
  fields = dict(route=PrefillRoute.DENSE_MHA, num_new_tokens=4, num_cached_tokens=0, kv_rows=8,
                layer_classes=(m.MLAAttention,), backend_class=XlaBackend)
  return StepPlan(**{**fields, **overrides})


@pytest.mark.parametrize("layer_classes, backend_class, unable", [
    ((m.DeepseekV32Attention,), XlaBackend, "DeepseekV32Attention"),
    ((m.MLAAttention, m.DeepseekV32Attention), XlaBackend, "DeepseekV32Attention"),
    ((m.MLAAttention,), XlaNoDenseBackend, "XlaNoDenseBackend"),
])
def test_no_dense_plan_can_be_built_without_the_capability(layer_classes, backend_class, unable):
  with pytest.raises(ValueError, match=f"DENSE_MHA step plan cannot be built for {unable}"):
    _plan(layer_classes=layer_classes, backend_class=backend_class)


def _abstract_lm(attention):
  """Abstract weights (nnx.eval_shape): a plan is made from the model's structure alone."""
  return nnx.eval_shape(lambda: CausalLM(tiny_lm(attention), rngs=nnx.Rngs(0), backend="xla"))


def test_no_dense_plan_can_be_built_for_an_mqa_only_model():
  """Every way to get a plan for DeepSeek-V3.2's model gives a route that scores, and a dense
  plan made by hand for its classes is refused at construction."""
  model = _abstract_lm("mqa-only")
  for length in (1, TOPK - 1, TOPK, TOPK + 1):
    plan = model.step_plan(length, 0, capacity=64)
    assert plan.route is PrefillRoute.SPARSE_MQA and plan.route.needs_topk
    assert plan.layer_classes == (m.DeepseekV32Attention,)
  with pytest.raises(ValueError, match="cannot be built for DeepseekV32Attention"):
    dataclasses.replace(plan, route=PrefillRoute.DENSE_MHA)


def test_plan_is_resolved_model_wide_and_hashable():
  model = _abstract_lm("dense-capable")
  short = model.step_plan(TOPK, 0, capacity=64)
  assert short.route is PrefillRoute.DENSE_MHA
  assert short.kv_rows == 64  # the bucket of TOPK rows, capped at the capacity
  assert model.step_plan(TOPK + 1, 0, capacity=64).route is PrefillRoute.MASKED_MHA
  decode = model.step_plan(1, None, capacity=64)
  assert decode.route is PrefillRoute.SPARSE_MQA and decode.kv_rows == 64
  assert hash(short) == hash(model.step_plan(TOPK, 0, capacity=64))
  assert {short: 1}[model.step_plan(TOPK, 0, capacity=64)] == 1  # usable as a jit static
  assert model.prefill_routes(TOPK, 0) == [short.route] * model.config.num_layers


def test_plan_checks_its_static_values():
  with pytest.raises(ValueError, match="kv_rows=3 is fewer than the 0 cached \\+ 4 new"):
    _plan(kv_rows=3)
  with pytest.raises(ValueError, match="needs a static cached-token bound"):
    _plan(num_cached_tokens=None)
  with pytest.raises(ValueError, match="indexer_loss must be one of"):
    _plan(route=PrefillRoute.SPARSE_MQA, indexer_loss="kl")
  with pytest.raises(ValueError, match="carry_topk needs a route that selects top-k"):
    _plan(carry_topk=True)
  with pytest.raises(TypeError, match="route must be a PrefillRoute"):
    _plan(route="dense_mha")
  with pytest.raises(ValueError, match="kv_rows must be an int in \\[1, capacity=8\\]"):
    plan_step([m.MLAAttention(m.tiny(), rngs=nnx.Rngs(0), backend="xla")], XlaBackend(),
              num_new_tokens=2, num_cached_tokens=0, capacity=8, kv_rows=9)


def test_a_layer_refuses_a_plan_made_for_other_classes_or_tokens():
  config = m.tiny()
  dense = m.MLAAttention(config, rngs=nnx.Rngs(0), backend="xla")
  mqa = m.DeepseekV32Attention(config, rngs=nnx.Rngs(0), backend="xla")
  x = jax.random.normal(jax.random.key(0), (1, 4, config.hidden_size))
  cache = m.init_layer_cache(config, 1, 8)
  dense_plan = dense.step_plan(4, 0, capacity=8)
  assert dense_plan.route is PrefillRoute.DENSE_MHA
  with pytest.raises(ValueError, match="resolved for MLAAttention on XlaBackend, not "
                                       "DeepseekV32Attention"):
    mqa(x, cache, plan=dense_plan)
  with pytest.raises(ValueError, match="for 3 new tokens, x holds 4"):
    dense(x, cache, plan=dense.step_plan(3, 0, capacity=8))
  with pytest.raises(ValueError, match="either a plan or the static settings"):
    dense(x, cache, plan=dense_plan, force_mqa=True)


def test_the_plan_alone_decides_what_is_traced():
  """A layer given a plan traces that plan's route and nothing else (the kwargs-built plan of
  the same call gives the same program)."""
  config = m.tiny()
  dense = m.MLAAttention(config, rngs=nnx.Rngs(0), backend="xla")
  x = jax.random.normal(jax.random.key(0), (1, 4, config.hidden_size))
  cache = m.init_layer_cache(config, 1, 8)
  forced = dense.step_plan(4, 0, capacity=8, force_mqa=True)
  scopes = traced_scopes(lambda x, c: dense(x, c, plan=forced).out_BTD, x, cache)
  assert {"mla_sparse_mqa", "indexer_score"} <= scopes and "mla_dense_mha" not in scopes
  scopes = traced_scopes(lambda x, c: dense(x, c, plan=dense.step_plan(4, 0, capacity=8))
                         .out_BTD, x, cache)
  assert "mla_dense_mha" in scopes and not scopes & {"mla_sparse_mqa", "indexer_score"}
  # Jitted: the eager layer calls were most of this test's time.
  out = nnx.jit(lambda layer, x, c: layer(x, c, plan=forced).out_BTD)(dense, x, cache)
  assert jnp.allclose(out, call(dense, x, cache, force_mqa=True).out_BTD)
