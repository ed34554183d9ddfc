"""The third prefill route, MASKED_MHA: the MHA form over the causal keys, each query masked to
its top-k set. It equals SPARSE_MQA up to rounding, is taken only inside its window by a
dense-capable layer on a backend that declares it, and never appears in an MQA-only program."""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mla_jax as m
from mla_jax import testing as mt
from mla_jax.attention import MLAAttentionBase
from mla_jax.backends import XlaBackend
from mla_jax.backends.pallas import PallasTritonBackend
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.routing import PrefillRoute, resolve_prefill_route
from mla_jax.step_plan import StepPlan
from mla_jax.traces import summarize
from pallas_kernels import dense_mha_reference, sparse_mqa_reference
from pallas_kernels.dense_mha import dense_mha
from tests.helpers import XlaNoDenseBackend, call, fresh_cache, make_pair, tiny_no_indexer
from tests.test_traces import _generation_programs

TOPK = m.tiny().indexer.topk
MAX = 40  # a small window for the route tables: TOPK < cached + new <= MAX
WINDOW = XlaBackend(masked_mha_max_tokens=MAX)
ROUTES = {"mla_dense_mha", "mla_masked_mha", "mla_sparse_mqa", "mla_dense_mqa"}


# ---- the reference: masked MHA equals sparse MQA -------------------------------------------

def _both_forms(seed, *, T, S, H=4, A=16, R=8, N=8, V=8, K=6):
  """Random latent rows and weights in both forms, plus a causal top-k with -1 padding."""
  ks = jax.random.split(jax.random.key(seed), 6)
  c_kv_SA = jax.random.normal(ks[0], (S, A))
  k_pe_SR = jax.random.normal(ks[1], (S, R))
  w_uk_HNA = jax.random.normal(ks[2], (H, N, A)) / np.sqrt(A)
  w_uv_HVA = jax.random.normal(ks[3], (H, V, A)) / np.sqrt(A)
  q_nope_THN = jax.random.normal(ks[4], (T, H, N))
  q_pe_THR = jax.random.normal(ks[5], (T, H, R))
  offset = S - T
  rng = np.random.default_rng(seed)
  topk_TK = np.full((T, K), -1, np.int32)
  for t in range(T):
    causal = offset + t + 1
    picks = rng.choice(causal, size=min(K, causal), replace=False)
    topk_TK[t, :len(picks)] = picks
  k_SHQ = jnp.concatenate([jnp.einsum("sa,hna->shn", c_kv_SA, w_uk_HNA),
                           jnp.broadcast_to(k_pe_SR[:, None], (S, H, R))], -1)
  v_SHV = jnp.einsum("sa,hva->shv", c_kv_SA, w_uv_HVA)
  q_THQ = jnp.concatenate([q_nope_THN, q_pe_THR], -1)
  q_THL = jnp.concatenate([jnp.einsum("thn,hna->tha", q_nope_THN, w_uk_HNA), q_pe_THR], -1)
  kv_SL = jnp.concatenate([c_kv_SA, k_pe_SR], -1)
  return dict(q_THQ=q_THQ, k_SHQ=k_SHQ, v_SHV=v_SHV, q_THL=q_THL, kv_SL=kv_SL,
              w_uv_HVA=w_uv_HVA, topk_TK=jnp.asarray(topk_TK), offset=offset, A=A)


def _masked_and_sparse(f, topk_TK, scale=0.3):
  return _both_routes(**{**f, "topk_TK": topk_TK}, scale=scale)


@functools.partial(jax.jit, static_argnames=("offset", "A", "scale"))  # eager: many dispatches
def _both_routes(*, topk_TK, q_THQ, k_SHQ, v_SHV, q_THL, kv_SL, w_uv_HVA, offset, A, scale):
  masked, masked_lse = dense_mha_reference(q_THQ, k_SHQ, v_SHV, sm_scale=scale, q_offset=offset,
                                           kv_len=k_SHQ.shape[0], topk_TK=topk_TK)
  lat, sparse_lse = sparse_mqa_reference(q_THL, kv_SL, topk_TK, sm_scale=scale, d_v=A)
  sparse = jnp.einsum("tha,hva->thv", lat, w_uv_HVA)
  return masked, masked_lse, sparse, sparse_lse


@pytest.mark.parametrize("seed, T, S", [(0, 12, 12), (1, 9, 30), (2, 1, 17)])
def test_masked_reference_equals_sparse_mqa(seed, T, S):
  f = _both_forms(seed, T=T, S=S)
  masked, masked_lse, sparse, sparse_lse = _masked_and_sparse(f, f["topk_TK"])
  assert mt.relative_error(masked, sparse) < 1e-5
  np.testing.assert_allclose(masked_lse, sparse_lse, rtol=1e-5)


def test_masked_reference_rules_for_minus_one_nan_and_empty_rows():
  f = _both_forms(3, T=8, S=8)
  topk_TK = np.asarray(f["topk_TK"]).copy()
  topk_TK[2] = -1                    # an empty row: out 0, LSE +inf on both routes
  topk_TK[5, 0] = 99                 # out of range: ignored like -1
  poisoned = 1                       # a causal row that no query selects
  topk_TK[topk_TK == poisoned] = -1
  topk_TK = jnp.asarray(topk_TK)
  for name in ("k_SHQ", "v_SHV", "kv_SL"):
    f[name] = f[name].at[poisoned].set(jnp.nan)
  masked, masked_lse, sparse, sparse_lse = _masked_and_sparse(f, topk_TK)
  assert bool(jnp.isfinite(masked).all()) and bool(jnp.isfinite(sparse).all())
  assert not bool(masked[2].any()) and bool(jnp.isinf(masked_lse[2]).all())
  assert not bool(sparse[2].any()) and bool(jnp.isinf(sparse_lse[2]).all())
  keep = np.arange(8) != 2
  assert mt.relative_error(masked[keep], sparse[keep]) < 1e-5
  # A selected NaN row poisons the rows that select it, on both routes.
  selected = topk_TK.at[6, 0].set(poisoned)
  masked, _, sparse, _ = _masked_and_sparse(f, selected)
  assert bool(jnp.isnan(masked[6]).any()) and bool(jnp.isnan(sparse[6]).any())
  assert bool(jnp.isfinite(masked[7]).all())


def test_pallas_masked_kernel_equals_sparse_mqa():
  """The masked kernel (interpret mode) against the sparse MQA reference over the same rows."""
  f = _both_forms(4, T=9, S=30)
  masked, masked_lse = dense_mha(f["q_THQ"], f["k_SHQ"], f["v_SHV"], sm_scale=0.3,
                                 q_offset=f["offset"], kv_len=30, topk_TK=f["topk_TK"],
                                 interpret=True)
  _, _, sparse, sparse_lse = _masked_and_sparse(f, f["topk_TK"])
  assert mt.relative_error(masked, sparse) < 1e-5
  np.testing.assert_allclose(masked_lse, sparse_lse, rtol=1e-5)


def test_pallas_masked_layer_equals_sparse_mqa():
  """A cached prefix and a ragged batch through the Pallas backend's masked kernel."""
  pallas = PallasTritonBackend(interpret=True)
  dense, mqa = make_pair(seed=3, backend=pallas)
  cached, new = 5, 20
  assert dense.prefill_route(new, cached) is PrefillRoute.MASKED_MHA
  cache = fresh_cache(dense.config, 2)
  cache = call(mqa, mt.random_hidden(8, (2, cached, dense.config.hidden_size)), cache).cache
  x = mt.random_hidden(9, (2, new, dense.config.hidden_size))
  new_lens = jnp.array([new, new - 6], jnp.int32)
  masked = call(dense, x, cache, new_lens=new_lens)
  sparse = call(mqa, x, cache, new_lens=new_lens)
  real = np.arange(new)[None, :] < np.asarray(new_lens)[:, None]
  assert mt.relative_error(np.asarray(masked.out_BTD)[real], np.asarray(sparse.out_BTD)[real]) < 1e-5


# ---- the layer and the model: masked equals sparse on fresh random inputs -------------------

# Each case on one RoPE pairing (False: GLM's indexer RoPE, True: DeepSeek's); both pairings
# see a fresh and a cached prefill, ragged or not (all eight pairs cost a minute more of CI).
@pytest.mark.parametrize("rope_interleave, cached, new, ragged",
                         [(False, 0, TOPK + 1, False), (True, 0, 33, True),
                          (True, 5, 20, False), (False, 2 * TOPK, 7, True)])
def test_masked_layer_equals_sparse_mqa(rope_interleave, cached, new, ragged):
  config = dataclasses.replace(m.tiny(), indexer=dataclasses.replace(
      m.tiny().indexer, rope_interleave=rope_interleave))
  dense, mqa = make_pair(config, seed=cached + new)
  assert dense.prefill_route(new, cached) is PrefillRoute.MASKED_MHA
  b = 2
  cache = fresh_cache(config, b)
  if cached:
    prefix = mt.random_hidden(7, (b, cached, config.hidden_size))
    cache = call(mqa, prefix, cache).cache
  x = mt.random_hidden(cached + new, (b, new, config.hidden_size))
  new_lens = jnp.array([new, new - 3 if ragged else new], jnp.int32)
  masked = call(dense, x, cache, new_lens=new_lens)  # jitted: eager dispatch cost the most
  sparse = call(mqa, x, cache, new_lens=new_lens)
  forced = call(dense, x, cache, new_lens=new_lens, force_mqa=True)
  real = np.arange(new)[None, :] < np.asarray(new_lens)[:, None]
  assert bool((masked.topk_BTK == sparse.topk_BTK).all())
  for other in (sparse, forced):
    assert mt.relative_error(np.asarray(masked.out_BTD)[real],
                             np.asarray(other.out_BTD)[real]) < 1e-5
  assert bool(jnp.isfinite(masked.out_BTD).all())


@pytest.mark.parametrize("indexer_types", [None, ("full", "shared")])  # IndexShare
def test_masked_model_equals_sparse_mqa(indexer_types):
  model = CausalLM(dataclasses.replace(tiny_lm("dense-capable"), indexer_types=indexer_types),
                   rngs=nnx.Rngs(0), backend="xla")
  mt.randomize_params(model, 2)
  length = 3 * TOPK
  assert set(model.prefill_routes(length, 0)) == {PrefillRoute.MASKED_MHA}
  ids = jnp.asarray(np.random.default_rng(5).integers(0, 256, size=(2, length)), jnp.int32)
  forward = nnx.jit(lambda mdl, i, c, force: mdl(i, c, num_cached_tokens=0, force_mqa=force)[0],
                    static_argnums=3)
  masked = forward(model, ids, model.init_cache(2, 64), False)
  sparse = forward(model, ids, model.init_cache(2, 64), True)
  assert mt.relative_error(masked, sparse) < 1e-5


# ---- the route table ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layers():
  return {cls: cls(m.tiny(), rngs=nnx.Rngs(0), backend="xla")
          for cls in (m.MLAAttention, m.DeepseekV32Attention)}


@pytest.mark.parametrize("cached, new, expected", [
    (0, TOPK, PrefillRoute.DENSE_MHA),
    (0, TOPK + 1, PrefillRoute.MASKED_MHA),    # the top-k boundary, one token apart
    (TOPK, 1, PrefillRoute.MASKED_MHA),        # cached tokens count
    (0, MAX, PrefillRoute.MASKED_MHA),         # the threshold is inclusive
    (0, MAX + 1, PrefillRoute.SPARSE_MQA),
    (MAX - 3, 4, PrefillRoute.SPARSE_MQA),
    (None, 1, PrefillRoute.SPARSE_MQA),        # unknown cached length: conservative
    (None, TOPK + 1, PrefillRoute.SPARSE_MQA),
])
def test_route_table(layers, cached, new, expected):
  dense, mqa = layers[m.MLAAttention], layers[m.DeepseekV32Attention]
  kwargs = dict(num_new_tokens=new, num_cached_tokens=cached)
  assert resolve_prefill_route(dense, WINDOW, **kwargs) is expected
  assert resolve_prefill_route(dense, WINDOW, force_mqa=True, **kwargs) is PrefillRoute.SPARSE_MQA
  off = PrefillRoute.SPARSE_MQA if expected is PrefillRoute.MASKED_MHA else expected
  assert resolve_prefill_route(dense, XlaBackend(masked_mha_max_tokens=0), **kwargs) is off
  assert resolve_prefill_route(dense, XlaNoDenseBackend(masked_mha_max_tokens=MAX),
                               **kwargs) is PrefillRoute.SPARSE_MQA
  assert resolve_prefill_route(mqa, WINDOW, **kwargs) is PrefillRoute.SPARSE_MQA
  assert resolve_prefill_route(dense, PallasTritonBackend(interpret=True,
                                                         masked_mha_max_tokens=MAX),
                               **kwargs) is expected
  assert expected.needs_topk is (expected is not PrefillRoute.DENSE_MHA)


def test_default_window_and_no_indexer(layers):
  dense = layers[m.MLAAttention]
  limit = XlaBackend().masked_mha_max_tokens
  assert limit > TOPK
  assert dense.prefill_route(limit) is PrefillRoute.MASKED_MHA
  assert dense.prefill_route(limit + 1) is PrefillRoute.SPARSE_MQA
  no_indexer = m.MLAAttention(tiny_no_indexer(), rngs=nnx.Rngs(0), backend=WINDOW)
  assert no_indexer.prefill_route(MAX - 1) is PrefillRoute.DENSE_MHA  # no top-k: no mask
  assert PrefillRoute.MASKED_MHA.scope == "mla_masked_mha"
  with pytest.raises(ValueError, match="masked_mha_max_tokens must be an int >= 0"):
    XlaBackend(masked_mha_max_tokens=-1)
  with pytest.raises(TypeError, match="masked_mha_max_tokens must be a static int"):
    XlaBackend(masked_mha_max_tokens=1.5)


def test_no_masked_plan_for_a_class_or_backend_without_the_capability():
  fields = dict(route=PrefillRoute.MASKED_MHA, num_new_tokens=20, num_cached_tokens=0, kv_rows=32,
                backend_class=XlaBackend)
  StepPlan(layer_classes=(m.MLAAttention,), **fields)
  for classes, backend, unable in (((m.DeepseekV32Attention,), XlaBackend, "DeepseekV32"),
                                   ((m.MLAAttention,), XlaNoDenseBackend, "XlaNoDense")):
    with pytest.raises(ValueError, match=f"MASKED_MHA step plan cannot be built for {unable}"):
      StepPlan(layer_classes=classes, **{**fields, "backend_class": backend})
  with pytest.raises(ValueError, match="MASKED_MHA step plan needs a static cached-token"):
    StepPlan(layer_classes=(m.MLAAttention,), **{**fields, "num_cached_tokens": None})


# ---- capabilities ---------------------------------------------------------------------------

def test_masked_capability_defaults_to_the_dense_one():
  assert m.MLAAttention.supports_masked_mha_prefill is True
  assert m.DeepseekV32Attention.supports_masked_mha_prefill is False
  assert not hasattr(m.DeepseekV32Attention, "forward_masked_mha")
  assert XlaBackend.supports_masked_mha_prefill is True
  assert XlaNoDenseBackend.supports_masked_mha_prefill is False
  assert PallasTritonBackend.supports_masked_mha_prefill is True

  class Inherits(m.MLAAttention):
    pass

  class OptsOut(m.MLAAttention):
    supports_masked_mha_prefill: ClassVar[bool] = False

  class InheritsOptOut(OptsOut):
    pass

  assert Inherits.supports_masked_mha_prefill is True
  assert OptsOut.supports_masked_mha_prefill is False
  assert InheritsOptOut.supports_masked_mha_prefill is False
  layer = OptsOut(m.tiny(), rngs=nnx.Rngs(0), backend="xla")
  assert layer.masked_prefill_backend is None and layer.dense_prefill_backend is not None
  assert layer.prefill_route(TOPK + 1) is PrefillRoute.SPARSE_MQA


def test_declaring_masked_support_without_the_method_is_rejected():
  with pytest.raises(TypeError, match="forward_masked_mha"):
    class Broken(m.DeepseekV32Attention):  # noqa: F841 - the definition itself must fail
      supports_masked_mha_prefill: ClassVar[bool] = True

  with pytest.raises(TypeError, match="forward_masked_mha"):
    class AlsoBroken(MLAAttentionBase):  # noqa: F841
      supports_masked_mha_prefill: ClassVar[bool] = True

  with pytest.raises(TypeError, match="without supports_dense_mha_prefill"):
    class MaskedOnly(m.MLAAttention):  # noqa: F841
      supports_dense_mha_prefill: ClassVar[bool] = False
      supports_masked_mha_prefill: ClassVar[bool] = True

  with pytest.raises(TypeError, match="_masked_mha"):
    class BrokenBackend(XlaNoDenseBackend):  # noqa: F841
      supports_dense_mha_prefill: ClassVar[bool] = True
      supports_masked_mha_prefill: ClassVar[bool] = True
      _masked_mha = m.Backend._masked_mha

  with pytest.raises(NotImplementedError, match="masked MHA"):
    m.Backend._masked_mha(XlaNoDenseBackend(), None, None, None, None, sm_scale=1.0,
                          q_offset=0, kv_len=0)


# ---- traced programs ------------------------------------------------------------------------

def _abstract_lm(attention, backend):
  """A CausalLM with abstract weights: the tests that only trace need no initialized one."""
  return nnx.eval_shape(lambda: CausalLM(tiny_lm(attention), rngs=nnx.Rngs(0), backend=backend))


def _layer_summary(layer, length, cached=0):
  cache = fresh_cache(layer.config)
  if cached:
    cache = dataclasses.replace(cache, num_cached_B=jnp.array([cached], jnp.int32))
  x = mt.random_hidden(length, (1, length, layer.config.hidden_size))
  return summarize(nnx.jit(lambda layer, x, c: layer(x, c, num_cached_tokens=cached).out_BTD),
                   layer, x, cache)


def _layer_scopes(layer, length, cached=0):
  return _layer_summary(layer, length, cached).scopes


@pytest.mark.parametrize("length", [1, TOPK, TOPK + 1, 40, 90])
def test_mqa_only_layer_and_model_never_compile_masked(length):
  _, mqa = make_pair()
  assert _layer_scopes(mqa, length) & ROUTES == {"mla_sparse_mqa"}
  assert _layer_scopes(mqa, 3, cached=length) & ROUTES == {"mla_sparse_mqa"}
  model = _abstract_lm("mqa-only", "xla")
  ids = jnp.ones((1, length), jnp.int32)
  summary = summarize(nnx.jit(lambda mdl, i, c: mdl(i, c, num_cached_tokens=0)), model, ids,
                      model.init_cache(1, 96))
  assert summary.scopes & ROUTES == {"mla_sparse_mqa"} and "indexer_score" in summary.scopes


# One token apart on both sides of the window, on a backend whose threshold is MAX.
BOUNDARIES = [TOPK, TOPK + 1, MAX, MAX + 1]


def _expected_scope(attention, length):
  """The route scope of a fresh prefill of ``length`` tokens on the WINDOW backend."""
  if attention == "mqa-only":
    return "mla_sparse_mqa"
  return ("mla_dense_mha" if length <= TOPK else
          "mla_masked_mha" if length <= MAX else "mla_sparse_mqa")


@pytest.mark.parametrize("length", BOUNDARIES)
def test_layer_and_model_take_masked_exactly_inside_the_window(length):
  dense, mqa = make_pair(backend=WINDOW)
  for attention, layer in (("dense-capable", dense), ("mqa-only", mqa)):
    expected = _expected_scope(attention, length)
    scopes = _layer_scopes(layer, length)
    assert scopes & ROUTES == {expected}, attention
    assert ("indexer_score" in scopes) is (expected != "mla_dense_mha")
    model = _abstract_lm(attention, WINDOW)
    summary = summarize(nnx.jit(lambda mdl, i, c: mdl(i, c, num_cached_tokens=0)), model,
                        jnp.ones((1, length), jnp.int32), model.init_cache(1, 64))
    assert summary.scopes & ROUTES == {expected}, attention
    assert summary.primitives["cond"] == 0


@pytest.mark.parametrize("prompt_len", BOUNDARIES)
def test_generate_programs_keep_masked_to_its_window(prompt_len):
  for attention in ("mqa-only", "dense-capable"):
    prefill, decode = _generation_programs(_abstract_lm(attention, WINDOW), prompt_len)
    expected = _expected_scope(attention, prompt_len)
    assert prefill.scopes & ROUTES == {expected}, attention
    assert ("indexer_score" in prefill.scopes) is (expected != "mla_dense_mha")
    assert decode.scopes & ROUTES == {"mla_sparse_mqa"}, attention


def test_dense_capable_model_at_a_mid_length_takes_the_masked_route():
  model = _abstract_lm("dense-capable", "xla")
  ids = jnp.ones((1, 2 * TOPK), jnp.int32)
  summary = summarize(nnx.jit(lambda mdl, i, c: mdl(i, c, num_cached_tokens=0)), model, ids,
                      model.init_cache(1, 64))
  assert {"mla_masked_mha", "indexer_score"} <= summary.scopes
  assert not summary.scopes & {"mla_dense_mha", "mla_sparse_mqa"}
  assert summary.primitives["cond"] == 0


@pytest.mark.parametrize("backend", [XlaBackend(), PallasTritonBackend(interpret=True)],
                         ids=["xla", "pallas_interpret"])
def test_layers_at_a_mid_length_on_each_backend(backend):
  """Dense-capable: the masked route (on Pallas its kernel); MQA-only: never."""
  dense, mqa = make_pair(backend=backend)
  masked, sparse = _layer_summary(dense, 2 * TOPK), _layer_summary(mqa, 2 * TOPK)
  assert masked.scopes & ROUTES == {"mla_masked_mha"} and "indexer_score" in masked.scopes
  assert sparse.scopes & ROUTES == {"mla_sparse_mqa"} and "indexer_score" in sparse.scopes
  if backend.name == "pallas_triton":
    assert set(masked.kernels) == {"indexer_logits", "masked_mha_prefill"}
    assert set(sparse.kernels) == {"indexer_logits", "sparse_mqa_attention"}
