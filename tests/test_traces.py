"""The traced program is the route: assert on scopes, primitives and kernels."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import mla_jax as m
from mla_jax import checks
from mla_jax import testing as mt
from mla_jax.decoding.steps import Progress
from mla_jax.models.config import tiny_lm
from mla_jax.generation import programs
from mla_jax.traces import summarize, summarize_jaxpr, traced_kernels, traced_scopes
from tests.conftest import module_backends
from tests.helpers import XlaNoDenseBackend, fresh_cache, make_pair, tiny_no_indexer

TOPK = m.tiny().indexer.topk
LENGTHS = (1, TOPK - 1, TOPK, TOPK + 1, 4 * TOPK)
ROUTE_SCOPES = {"mla_dense_mha", "mla_masked_mha", "mla_sparse_mqa", "mla_dense_mqa",
                "indexer_score", "indexer_cache_update"}
# Past the top-k the dense-capable class takes the masked route (within each backend's default
# masked_mha_max_tokens, above every length here).
MASKED = {"indexer_cache_update", "indexer_score", "mla_masked_mha"}
SPARSE = {"indexer_cache_update", "indexer_score", "mla_sparse_mqa"}
MASKED_KERNELS = {"indexer_logits", "masked_mha_prefill"}  # the masked route on Pallas


def _past_topk(backend):
  """The dense-capable class's scopes for a prefill past the top-k on ``backend``."""
  return MASKED if backend.supports_masked_mha_prefill else SPARSE


def _nnx_jit_prefill(layer, x, cache):
  return nnx.jit(lambda layer, x, cache: layer(x, cache, num_cached_tokens=0))(layer, x, cache)


def _jax_jit_prefill(layer):
  graphdef, state = nnx.split(layer)
  return jax.jit(lambda state, x, cache: nnx.merge(graphdef, state)(
      x, cache, num_cached_tokens=0)), state


def _summaries(layer, length):
  x = mt.random_hidden(0, (1, length, layer.config.hidden_size))
  cache = fresh_cache(layer.config)
  jitted, state = _jax_jit_prefill(layer)
  return [summarize(_nnx_jit_prefill, layer, x, cache), summarize(jitted, state, x, cache)]


def _no_runtime_routing(summary):
  return summary.primitives["cond"] == 0 and summary.primitives["switch"] == 0


@pytest.mark.parametrize("backend", module_backends())
@pytest.mark.parametrize("length", LENGTHS)
def test_mqa_only_layer_never_compiles_dense_mha(backend, length):
  _, mqa = make_pair(backend=backend)
  for summary in _summaries(mqa, length):
    assert summary.scopes & ROUTE_SCOPES == {"indexer_cache_update", "indexer_score",
                                             "mla_sparse_mqa"}
    assert _no_runtime_routing(summary)
    assert "dense_mha_prefill" not in summary.kernels
    if backend.name == "pallas_triton":
      assert set(summary.kernels) == {"indexer_logits", "sparse_mqa_attention"}


@pytest.mark.parametrize("backend", module_backends())
@pytest.mark.parametrize("length", LENGTHS)
def test_dense_capable_layer_scores_only_when_sparse(backend, length):
  dense, _ = make_pair(backend=backend)
  short = length <= TOPK
  expected = ({"indexer_cache_update", "mla_dense_mha"} if short else _past_topk(backend))
  for summary in _summaries(dense, length):
    assert summary.scopes & ROUTE_SCOPES == expected
    assert _no_runtime_routing(summary)
    if backend.name == "pallas_triton":
      assert set(summary.kernels) == ({"dense_mha_prefill"} if short else MASKED_KERNELS)


def test_backend_without_dense_kernel_keeps_dense_capable_layer_sparse():
  dense, _ = make_pair(backend=XlaNoDenseBackend())
  for summary in _summaries(dense, 3):
    assert summary.scopes & ROUTE_SCOPES == {"indexer_cache_update", "indexer_score",
                                             "mla_sparse_mqa"}


def test_forced_mqa_and_decode_score():
  dense, _ = make_pair()
  x = mt.random_hidden(1, (1, 3, dense.config.hidden_size))
  forced = traced_scopes(lambda x, c: dense(x, c, num_cached_tokens=0, force_mqa=True), x,
                         fresh_cache(dense.config))
  decode = traced_scopes(nnx.jit(lambda layer, x, c: layer(x, c)), dense, x,
                         fresh_cache(dense.config))  # traced lengths: unknown, so MQA
  for scopes in (forced, decode):
    assert "indexer_score" in scopes and "mla_dense_mha" not in scopes


def test_dense_mqa_scope_without_indexer():
  layer = m.MLAAttention(tiny_no_indexer(), rngs=nnx.Rngs(0), backend=XlaNoDenseBackend())
  scopes = traced_scopes(lambda x, c: layer(x, c), mt.random_hidden(2, (1, 5, 128)),
                         fresh_cache(layer.config))
  assert scopes & ROUTE_SCOPES == {"mla_dense_mqa"}


def test_traced_kernels_empty_on_xla():
  dense, _ = make_pair()
  x = mt.random_hidden(3, (1, 5, dense.config.hidden_size))
  assert traced_kernels(lambda x, c: dense(x, c), x, fresh_cache(dense.config)) == ()


def test_walker_sees_inside_cond_scan_and_custom_vjp():
  @jax.custom_vjp
  def f(x):
    with jax.named_scope("in_custom_vjp"):
      return x * 2

  f.defvjp(lambda x: (f(x), None), lambda _, g: (g,))

  def program(x):
    def body(carry, _):
      with jax.named_scope("in_scan"):
        return carry + 1, None

    y, _ = jax.lax.scan(body, x, None, length=2)
    y = jax.lax.cond(y.sum() > 0, lambda v: v, lambda v: -v, y)
    with jax.named_scope("outer"):
      return f(jax.jit(lambda v: v * 3)(y))

  summary = summarize(program, jax.numpy.ones(3))
  assert {"in_custom_vjp", "in_scan", "outer"} <= summary.scopes
  assert summary.primitives["cond"] == 1


def test_pallas_backend_without_dense_kernel_compiles_only_sparse_kernels():
  import dataclasses
  from typing import ClassVar

  from mla_jax.backends.pallas import PallasTritonBackend

  @dataclasses.dataclass(frozen=True)
  class PallasSparseOnly(PallasTritonBackend):
    name: ClassVar[str] = "pallas_sparse_only"
    supports_dense_mha_prefill: ClassVar[bool] = False

  dense, _ = make_pair(backend=PallasSparseOnly(interpret=True))
  assert dense.dense_prefill_backend is None
  for summary in _summaries(dense, 3):
    assert set(summary.kernels) == {"indexer_logits", "sparse_mqa_attention"}
    assert "mla_dense_mha" not in summary.scopes


def _prefill_after(layer, cached: int, new: int):
  """Summary of a jitted step of ``new`` tokens after ``cached`` rows (static bound)."""
  cache = dataclasses.replace(fresh_cache(layer.config), num_cached_B=jnp.array([cached]))
  step = nnx.jit(lambda layer, x, c: layer(x, c, num_cached_tokens=cached))
  return summarize(step, layer, mt.random_hidden(5, (1, new, layer.config.hidden_size)), cache)


@pytest.mark.parametrize("backend", module_backends())
@pytest.mark.parametrize("cached, new", [(4, 3), (TOPK - 3, 3), (TOPK - 3, 4), (2 * TOPK, 2)])
def test_cached_prefixes_route_on_the_total_length(backend, cached, new):
  """With a cached prefix the dense-capable class goes dense only while cached + new <= top-k;
  the MQA-only class never does."""
  dense, mqa = make_pair(backend=backend)
  short = cached + new <= TOPK
  dense_summary, mqa_summary = _prefill_after(dense, cached, new), _prefill_after(mqa, cached, new)
  assert dense_summary.scopes & ROUTE_SCOPES == (
      {"indexer_cache_update", "mla_dense_mha"} if short else _past_topk(backend))
  assert mqa_summary.scopes & ROUTE_SCOPES == {"indexer_cache_update", "indexer_score",
                                               "mla_sparse_mqa"}
  for summary in (dense_summary, mqa_summary):
    assert _no_runtime_routing(summary)
  assert "dense_mha_prefill" not in mqa_summary.kernels
  if backend.name == "pallas_triton":
    assert set(dense_summary.kernels) == ({"dense_mha_prefill"} if short else
                                          MASKED_KERNELS)


@pytest.mark.parametrize("backend", module_backends())
@pytest.mark.parametrize("tokens", [1, 3])
def test_mqa_only_decode_steps_score_and_never_compile_dense(backend, tokens):
  """Decode (and multi-token verification) steps: traced lengths, so MQA for both classes."""
  for layer in make_pair(backend=backend):
    x = mt.random_hidden(6, (2, tokens, layer.config.hidden_size))
    summary = summarize(nnx.jit(lambda layer, x, c: layer(x, c)), layer, x,
                        fresh_cache(layer.config, 2))
    assert summary.scopes & ROUTE_SCOPES == {"indexer_cache_update", "indexer_score",
                                             "mla_sparse_mqa"}
    assert _no_runtime_routing(summary)
    if backend.name == "pallas_triton":
      assert set(summary.kernels) == {"indexer_logits", "sparse_mqa_attention"}


@functools.lru_cache(maxsize=None)
def _lm(attention: str, backend_name: str):
  """Abstract weights (nnx.eval_shape): the tests here trace and compile, never run."""
  return nnx.eval_shape(lambda: m.CausalLM(tiny_lm(attention), rngs=nnx.Rngs(0),
                                           backend=backend_name))


def _generation_programs(model, prompt_len: int):
  """Summaries of the programs ``generate`` compiles: its prefill and a decode dispatch (two
  steps, reading the live rows of the cache)."""
  graphdef, state = nnx.split(model)
  caches = model.init_cache(1, prompt_len + 4)
  ids, lens = jnp.ones((1, prompt_len), jnp.int32), jnp.array([prompt_len], jnp.int32)
  seed = jnp.uint32(0)
  capacity = prompt_len + 4
  prefill = programs.trace(graphdef, state, caches, ids, lens, seed,
                           settings=programs.PrefillSettings(
                               model.step_plan(prompt_len, 0, capacity=capacity)))
  decode_plan = model.step_plan(1, None, capacity=capacity, kv_rows=prompt_len + 2)
  decode = programs.trace(graphdef, state, caches, lens, Progress.start(jnp.ones((1,), bool), 1),
                          seed,
                          jnp.int32(1), jnp.int32(4),
                          settings=programs.DecodeSettings(decode_plan, steps=2))
  return summarize_jaxpr(prefill.jaxpr), summarize_jaxpr(decode.jaxpr)


@pytest.mark.parametrize("backend_name", ["xla", "pallas"])
@pytest.mark.parametrize("prompt_len", [3, TOPK, TOPK + 1])
def test_generate_programs_follow_the_routes(backend_name, prompt_len):
  """The compiled prefill and decode of ``generate`` (every layer, through the scanned layer
  groups): the MQA-only model never compiles dense MHA, the dense-capable one only in a
  prefill of at most top-k tokens, and every decode step scores."""
  sparse = {"indexer_cache_update", "indexer_score", "mla_sparse_mqa"}
  for attention in ("mqa-only", "dense-capable"):
    prefill, decode = _generation_programs(_lm(attention, backend_name), prompt_len)
    dense_prefill = attention == "dense-capable" and prompt_len <= TOPK
    past_topk = MASKED if attention == "dense-capable" else sparse
    assert prefill.scopes & ROUTE_SCOPES == (
        {"indexer_cache_update", "mla_dense_mha"} if dense_prefill else past_topk), attention
    assert decode.scopes & ROUTE_SCOPES == sparse, attention
    assert _no_runtime_routing(prefill) and _no_runtime_routing(decode)
    if backend_name == "pallas":
      assert set(decode.kernels) == {"indexer_logits", "sparse_mqa_attention"}
      assert set(prefill.kernels) == (
          {"dense_mha_prefill"} if dense_prefill else
          MASKED_KERNELS if attention == "dense-capable" else
          {"indexer_logits", "sparse_mqa_attention"})


def _generation_traces(model, checked: bool):
  """``generate``'s prefill and a decode dispatch, traced."""
  graphdef, state = nnx.split(model)
  caches = model.init_cache(1, 8)
  ids, lens = jnp.ones((1, 3), jnp.int32), jnp.array([3], jnp.int32)
  seed = jnp.uint32(0)
  prefill = programs.trace(graphdef, state, caches, ids, lens, seed,
                           settings=programs.PrefillSettings(model.step_plan(3, 0, capacity=8),
                                                             checked=checked))
  decode = programs.trace(graphdef, state, caches, lens, Progress.start(jnp.ones((1,), bool), 1),
                          seed,
                          jnp.int32(1), jnp.int32(4),
                          settings=programs.DecodeSettings(model.step_plan(1, None, capacity=8),
                                                           steps=2, checked=checked))
  return prefill, decode


def _instructions(lowered) -> list[str]:
  """The compiled program's instructions, sorted, without names' numbering, metadata and
  source tables (which follow the traced program, dead code included)."""
  text = re.sub(r", metadata=\{[^}]*\}", "", lowered.compile().as_text())
  text = re.sub(r"(\.\d+\b|(?<=region_)\d+)", "", text)
  return sorted(line for line in text.splitlines()
                if not re.match(r"^(\d+ |FileNames|FunctionNames|FileLocations|StackFrames)", line))


def test_run_time_checks_compile_to_nothing_unless_checked(monkeypatch):
  """The default programs carry no checks: no effects (an effect sends every call through
  jax's Python dispatch path) and the same instructions as with every ``debug_check`` removed;
  the checked ones differ (they carry the error state out)."""
  model = _lm("mqa-only", "xla")
  traces = _generation_traces(model, checked=False)
  assert all(not traced.jaxpr.effects for traced in traces)
  default = [traced.lower() for traced in traces]
  checked = [traced.lower() for traced in _generation_traces(model, checked=True)]
  assert all(c.as_text() != d.as_text() for c, d in zip(checked, default))
  monkeypatch.setattr(checks.checkify, "debug_check", lambda *args, **kwargs: None)
  stripped = [traced.lower() for traced in _generation_traces(model, checked=False)]
  for d, s in zip(default, stripped):
    assert _instructions(d) == _instructions(s)
