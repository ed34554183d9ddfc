"""The bad-input matrix: every public entry point refuses bad input with the right exception
type and a message naming the offending argument, field or file, and a refused call leaves the
caches and files it was given as they were.

Kernels (``tests/kernels/``), checkpoint files and saves (``test_checkpoint_files.py``)
and Hugging Face configs (``test_hf_config.py``) keep their own matrices; this one covers
configs, modules, caches, routing, the model, checked runs under ``jit``, generation and the
command line.
"""

import dataclasses
import functools
import hashlib
import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mla_jax as m
from mla_jax import checks, cli
from mla_jax.checkpoints import CheckpointError, load_pretrained, save_pretrained
from mla_jax.models.config import MoEConfig, tiny_lm
from mla_jax.models.lm import ModelCache
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference
from tests.helpers import lm, make_pair

NAN, INF = float("nan"), float("inf")
TOPK = m.tiny().indexer.topk


@functools.lru_cache(maxsize=None)
def _layer():
  return make_pair()[1]  # a DeepseekV32Attention on the XLA backend


def _model():
  return lm(tiny_lm())


def _host(tree):
  return jax.tree.map(np.array, tree)


def _refused(call, error, match, *given):
  """``call()`` raises ``error`` matching ``match`` and leaves ``given`` (pytrees) unchanged."""
  before = [_host(g) for g in given]
  with pytest.raises(error, match=match):
    call()
  for b, g in zip(before, given):
    chex.assert_trees_all_equal(_host(g), b)


def _cache(lengths=(0,), capacity=16, keys=True, dtype=jnp.float32, key_dim=32, latent_dim=80):
  """A hand-built cache (random rows), as a user might assemble one."""
  b = len(lengths)
  rng = np.random.default_rng(0)
  return m.LayerCache(
      latent_BSL=jnp.asarray(rng.standard_normal((b, capacity, latent_dim)), dtype),
      index_keys_BSI=(jnp.asarray(rng.standard_normal((b, capacity, key_dim)), dtype)
                      if keys else None),
      num_cached_B=jnp.asarray(lengths, jnp.int32))


# ---- configs --------------------------------------------------------------------------------

def _moe(**changes):
  return MoEConfig(**{**dict(num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
                      **changes})


CONFIG_CASES = {
    "mla_qk_rope_odd": (lambda: dataclasses.replace(m.tiny(), qk_rope_head_dim=15),
                        "qk_rope_head_dim"),
    "mla_heads_bool": (lambda: dataclasses.replace(m.tiny(), num_heads=True), "num_heads"),
    "mla_max_positions_float": (lambda: dataclasses.replace(m.tiny(), max_position_embeddings=4.0e3),
                                "max_position_embeddings"),
    "mla_rope_not_a_config": (lambda: dataclasses.replace(m.tiny(), rope={"theta": 1.0}),
                              "rope"),
    "rope_theta_nan": (lambda: m.RopeConfig(theta=NAN), "rope.theta"),
    "rope_theta_inf": (lambda: m.RopeConfig(theta=INF), "rope.theta"),
    "mla_latent_norm_eps_nan": (lambda: dataclasses.replace(m.tiny(), latent_norm_eps=NAN),
                                "latent_norm_eps"),
    "model_rms_norm_eps_inf": (lambda: dataclasses.replace(tiny_lm(), rms_norm_eps=INF),
                               "rms_norm_eps"),
    "rope_yarn_dict": (lambda: m.RopeConfig(yarn={"factor": 4.0}), "rope.yarn"),
    "yarn_factor_below_one": (lambda: m.YarnConfig(factor=0.5), "yarn.factor"),
    "yarn_original_zero": (lambda: m.YarnConfig(original_max_position_embeddings=0),
                           "yarn.original_max_position_embeddings"),
    "yarn_beta_slow_inf": (lambda: m.YarnConfig(beta_slow=INF), "yarn.beta_slow"),
    "indexer_hadamard_needs_pow2": (lambda: m.IndexerConfig(head_dim=48), "indexer.head_dim"),
    "indexer_norm_eps_nan": (lambda: m.IndexerConfig(norm_eps=NAN), "indexer.norm_eps"),
    "indexer_use_hadamard_int": (lambda: m.IndexerConfig(use_hadamard=1), "indexer.use_hadamard"),
    "model_vocab_zero": (lambda: dataclasses.replace(tiny_lm(), vocab_size=0), "vocab_size"),
    "model_indexer_types_length": (lambda: dataclasses.replace(tiny_lm(),
                                                               indexer_types=("full",)),
                                   "indexer_types"),
    "model_mla_not_a_config": (lambda: dataclasses.replace(tiny_lm(), mla=m.tiny().__dict__),
                               "mla"),
    "moe_experts_per_token_too_many": (lambda: _moe(num_experts_per_tok=9),
                                       "moe.num_experts_per_tok"),
    "moe_scaling_inf": (lambda: _moe(routed_scaling_factor=INF), "moe.routed_scaling_factor"),
}


@pytest.mark.parametrize("build, field", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_configs(build, field):
  with pytest.raises(ValueError, match=f"^{field} must be"):
    build()


# ---- module construction and routing --------------------------------------------------------

def _route_under_jit(layer):
  """Routes with a traced token count (the layer is built outside the trace)."""
  return jax.jit(lambda n: layer.prefill_route(n, 0))(4)


MODULE_BUILD_CASES = {
    "attention_config_dict": (lambda: m.MLAAttention({"hidden_size": 128}, rngs=nnx.Rngs(0)),
                              TypeError, "config must be an MLAConfig"),
    "attention_chunk_bool": (lambda: m.MLAAttention(m.tiny(), rngs=nnx.Rngs(0), backend="xla",
                                                    index_chunk_size=True),
                             ValueError, "index_chunk_size"),
    "attention_param_dtype_int": (lambda: m.MLAAttention(m.tiny(), rngs=nnx.Rngs(0),
                                                         backend="xla", param_dtype=jnp.int8),
                                  TypeError, "param_dtype must be a floating dtype"),
    "attention_backend_name": (lambda: m.MLAAttention(m.tiny(), rngs=nnx.Rngs(0), backend="cuda"),
                               ValueError, "backend must be one of"),
    "attention_shares_topk_without_indexer": (
        lambda: m.MLAAttention(dataclasses.replace(m.tiny(), indexer=None), rngs=nnx.Rngs(0),
                               backend="xla", shares_topk=True), ValueError, "shares_topk"),
    "attention_rngs_none": (lambda: m.MLAAttention(m.tiny(), rngs=None, backend="xla"),
                            TypeError, "rngs must be an nnx.Rngs"),
    "model_rngs_int": (lambda: m.CausalLM(tiny_lm(), rngs=0, backend="xla"), TypeError,
                       "rngs must be an nnx.Rngs"),
    "model_grouped_matmul_name": (lambda: m.CausalLM(tiny_lm(), rngs=nnx.Rngs(0), backend="xla",
                                                     grouped_matmul="cutlass"),
                                  ValueError, "grouped_matmul must be one of"),
    "model_config_type": (lambda: m.CausalLM(m.tiny(), rngs=nnx.Rngs(0)), TypeError,
                          "config must be a ModelConfig"),
    "model_param_dtype_bool": (lambda: m.CausalLM(tiny_lm(), rngs=nnx.Rngs(0), backend="xla",
                                                  param_dtype=bool),
                               TypeError, "param_dtype must be a floating dtype"),
    "model_layer_index": (lambda: _model().layer_module(2), IndexError, "layer 2 out of range"),
    "route_cached_string": (lambda: _layer().prefill_route(4, "0"), TypeError,
                            "num_cached_tokens must be a static int or None, got str"),
    "route_cached_float": (lambda: _layer().prefill_route(4, 0.0), TypeError,
                           "num_cached_tokens must be a static int or None, got float"),
    "route_cached_bool": (lambda: _layer().prefill_route(4, False), TypeError,
                          "num_cached_tokens must be a static int or None, got bool"),
    "route_cached_negative": (lambda: _layer().prefill_route(4, -1), ValueError,
                              "num_cached_tokens must be >= 0"),
    "resolve_cached_string": (lambda: m.resolve_prefill_route(
        _layer(), m.XlaBackend(), num_new_tokens=4, num_cached_tokens="0"), TypeError,
                              "num_cached_tokens must be a static int or None, got str '0'"),
    "route_new_none": (lambda: m.resolve_prefill_route(_layer(), m.XlaBackend(),
                                                       num_new_tokens=None, num_cached_tokens=0),
                       TypeError, "num_new_tokens"),
    "route_new_traced": (lambda: _route_under_jit(_layer()), TypeError,
                         "num_new_tokens must be a static int"),
}


@pytest.mark.parametrize("build, error, match", MODULE_BUILD_CASES.values(),
                         ids=MODULE_BUILD_CASES.keys())
def test_module_construction_and_routing(build, error, match):
  with pytest.raises(error, match=match):
    build()


# ---- caches ---------------------------------------------------------------------------------

CACHE_BUILD_CASES = {
    "capacity_bool": (lambda: m.init_layer_cache(m.tiny(), 1, True), ValueError, "capacity"),
    "batch_zero": (lambda: m.init_layer_cache(m.tiny(), 0, 8), ValueError, "batch_size"),
    "capacity_past_positions": (lambda: m.init_layer_cache(m.tiny(), 1, 4097), ValueError,
                                "max_position_embeddings 4096"),
    "layer_dtype_int32": (lambda: m.init_layer_cache(m.tiny(), 1, 8, jnp.int32), TypeError,
                          "cache dtype must be a floating dtype, got int32"),
    "layer_dtype_name": (lambda: m.init_layer_cache(m.tiny(), 1, 8, "float99"), ValueError,
                         "cache dtype must be one of"),
    "model_dtype_int8": (lambda: _model().init_cache(1, 8, jnp.int8), TypeError,
                         "cache dtype must be a floating dtype, got int8"),
    "model_dtype_bool": (lambda: _model().init_cache(1, 8, jnp.bool_), TypeError,
                         "cache dtype must be a floating dtype"),
}


@pytest.mark.parametrize("build, error, match", CACHE_BUILD_CASES.values(),
                         ids=CACHE_BUILD_CASES.keys())
def test_cache_construction(build, error, match):
  with pytest.raises(error, match=match):
    build()


X5 = np.random.default_rng(1).standard_normal((1, 5, 128)).astype(np.float32)

# (inputs: () -> (x, cache, keyword arguments), error, match); all eager calls
LAYER_CALL_CASES = {
    "x_int": (lambda: (X5.astype(np.int32), _cache(), {}), TypeError, "x must be a floating"),
    "x_width": (lambda: (X5[..., :64], _cache(), {}), ValueError, "x must be"),
    "cache_not_a_cache": (lambda: (X5, {"latent_BSL": 0}, {}), TypeError,
                          "cache must be a LayerCache"),
    "cache_latent_int": (lambda: (X5, _cache(dtype=jnp.int32), {}), TypeError,
                         "cache.latent_BSL dtype must be a floating dtype"),
    "cache_keys_width": (lambda: (X5, _cache(key_dim=16), {}), ValueError,
                         r"cache.index_keys_BSI must be \[1, 16, 32\]"),
    "cache_keys_missing": (lambda: (X5, _cache(keys=False), {}), ValueError,
                           "cache.index_keys_BSI must be present"),
    "cache_lengths_float": (lambda: (X5, dataclasses.replace(
        _cache(), num_cached_B=jnp.zeros((1,), jnp.float32)), {}), TypeError,
                            "cache.num_cached_B must be int"),
    "cache_lengths_negative": (lambda: (X5, _cache(lengths=(-3,)), {}), checks.CheckError,
                               "cache lengths must be >= 0, got -3"),
    "cache_overflow": (lambda: (X5, _cache(lengths=(12,)), {}), checks.CheckError,
                       "would hold 17 tokens, more than the cache capacity 16"),
    "positions_past_max": (lambda: (X5, _cache(lengths=(4094,), capacity=4200), {}),
                           checks.CheckError, "position 4098, past max_position_embeddings 4096"),
    "new_lens_too_long": (lambda: (X5, _cache(), dict(new_lens_B=jnp.array([6]))),
                          checks.CheckError, r"new_lens must lie in \[0, 5\]"),
    "new_lens_negative": (lambda: (X5, _cache(), dict(new_lens_B=jnp.array([-1]))),
                          checks.CheckError, r"new_lens must lie in \[0, 5\]"),
    "new_lens_float": (lambda: (X5, _cache(), dict(new_lens_B=jnp.array([5.0]))), ValueError,
                       "new_lens must be int"),
    "cached_bound_below_cache": (lambda: (X5, _cache(lengths=(4,)), dict(num_cached_tokens=2)),
                                 checks.CheckError, "num_cached_tokens=2 but the cache already "
                                 "holds 4 tokens"),
    "cached_bound_string": (lambda: (X5, _cache(), dict(num_cached_tokens="0")), TypeError,
                            "num_cached_tokens must be a static int or None"),
    "batch_empty": (lambda: (X5[:0], _cache(lengths=()), {}), ValueError,
                    r"the batch is empty \(batch size 0\)"),
}


@pytest.mark.parametrize("inputs, error, match", LAYER_CALL_CASES.values(),
                         ids=LAYER_CALL_CASES.keys())
def test_layer_calls(inputs, error, match):
  x, cache, kwargs = inputs()
  _refused(lambda: _layer()(jnp.asarray(x), cache, **kwargs), error, match, cache)


def test_an_empty_top_k_row_is_refused_eagerly():
  shared = m.DeepseekV32Attention(m.tiny(), rngs=nnx.Rngs(0), backend="xla", shares_topk=True)
  cache = _cache(keys=False)
  unfilled = jnp.full((1, 5, TOPK), -1, jnp.int32)
  _refused(lambda: shared(jnp.asarray(X5), cache, shared_topk_BTK=unfilled), checks.CheckError,
           "query row 0 of sequence 0 has no valid top-k index", cache)


# ---- kernels through a backend (the batched entry points) ----------------------------------

_Q, _KV, _TOPK = np.zeros((1, 3, 4, 80), np.float32), np.zeros((1, 50, 80), np.float32), \
    np.zeros((1, 3, 7), np.int32)
_DQ, _DK, _DV = (np.zeros((1, 3, 2, 48), np.float32), np.zeros((1, 20, 2, 48), np.float32),
                 np.zeros((1, 20, 2, 32), np.float32))
_I32 = lambda *v: np.asarray(v, np.int32)


def _sparse(**changes):
  args = {**dict(q_BTHL=_Q, kv_BSL=_KV, topk_BTK=_TOPK, sm_scale=0.1, d_v=64), **changes}
  return m.XlaBackend().sparse_mqa(**args)


def _dense(**changes):
  args = {**dict(q_BTHQ=_DQ, k_BSHQ=_DK, v_BSHV=_DV, sm_scale=0.2, q_offset_B=_I32(0),
                 kv_len_B=_I32(20)), **changes}
  return m.XlaBackend().dense_mha(**args)


def _scores(**changes):
  args = {**dict(q_BTGI=np.zeros((1, 3, 4, 32), np.float32), k_BSI=np.zeros((1, 50, 32),
                 np.float32), w_BTG=np.zeros((1, 3, 4), np.float32),
                 starts_BT=np.zeros((1, 3), np.int32), ends_BT=np.full((1, 3), 50, np.int32)),
          **changes}
  return m.XlaBackend().indexer_logits(**args)


KERNEL_CASES = {
    "sparse_dtypes_mixed": (lambda: _sparse(kv_BSL=_KV.astype(jnp.bfloat16)), TypeError,
                            "kv_SL dtype bfloat16 differs from q_THL dtype float32"),
    "sparse_d_v_zero": (lambda: _sparse(d_v=0), ValueError, r"d_v must lie in \[1, L=80\]"),
    "sparse_topk_float": (lambda: _sparse(topk_BTK=_TOPK.astype(np.float32)), TypeError,
                          "topk_TK must be int32"),
    "sparse_scale_nan": (lambda: _sparse(sm_scale=NAN), ValueError,
                         "sm_scale must be finite and positive"),
    "sparse_batch_mismatch": (lambda: _sparse(kv_BSL=np.zeros((2, 50, 80), np.float32)),
                              ValueError, "sparse_mqa: kv_BSL must lead with the batch axis"),
    "dense_kv_len_float": (lambda: _dense(kv_len_B=np.full((1,), 2.5, np.float32)), TypeError,
                           "kv_len must be an integer"),
    "dense_batch_mismatch": (lambda: _dense(q_offset_B=_I32(0, 0)), ValueError,
                             "dense_mha: q_offset_B must lead with the batch axis"),
    "scores_ends_float": (lambda: _scores(ends_BT=np.zeros((1, 3), np.float32)), TypeError,
                          "ends_T must be int32"),
    # One sequence's op (the backend vmaps it, so the batch's offsets reach it traced):
    # without the check these query rows saw no key and came out 0 with LSE +inf.
    "dense_q_offset_negative": (lambda: dense_mha_reference(
        _DQ[0], _DK[0], _DV[0], sm_scale=0.2, q_offset=-2, kv_len=20), ValueError,
                                "dense_mha: q_offset must be >= 0, got -2"),
    "dense_kernel_q_offset_negative": (lambda: dense_mha(
        _DQ[0], _DK[0], _DV[0], sm_scale=0.2, q_offset=np.int64(-2), kv_len=20, interpret=True),
                                       ValueError, "dense_mha: q_offset must be >= 0, got -2"),
}


@pytest.mark.parametrize("build, error, match", KERNEL_CASES.values(), ids=KERNEL_CASES.keys())
def test_kernels_through_a_backend(build, error, match):
  with pytest.raises(error, match=match):
    build()


# ---- the model ------------------------------------------------------------------------------

MODEL_CALL_CASES = {
    "ids_float": (lambda: jnp.array([[1.0, 2.0]]), TypeError,
                  "token ids must be an int array, got dtype float32"),
    "ids_bool": (lambda: jnp.array([[True, False]]), TypeError, "token ids must be an int array"),
    "ids_rank_one": (lambda: jnp.array([1, 2]), ValueError, r"token ids must be an int array \["),
    "ids_list": (lambda: [[1, 2]], ValueError, "token ids must be an int array"),
    "ids_past_vocab": (lambda: jnp.array([[1, 260]]), checks.IdOutOfRangeError,
                       r"token ids must lie in \[0, 260\), got values in \[1, 260\]"),
    "ids_negative": (lambda: jnp.array([[-1, 2]]), checks.IdOutOfRangeError,
                     r"token ids must lie in \[0, 260\)"),
    "overflow": (lambda: jnp.ones((1, 9), jnp.int32), checks.CheckError,
                 "would hold 9 tokens, more than the cache capacity 8"),
    "batch_empty": (lambda: jnp.ones((0, 2), jnp.int32), ValueError,
                    r"token ids hold no sequence: the batch is empty \(batch size 0\)"),
}


@pytest.mark.parametrize("ids, error, match", MODEL_CALL_CASES.values(),
                         ids=MODEL_CALL_CASES.keys())
def test_model_calls(ids, error, match):
  caches = _model().init_cache(1, 8)
  _refused(lambda: _model()(ids(), caches), error, match, caches)


@pytest.mark.parametrize("new_lens, error, match", [
    ([3], checks.CheckError, r"new_lens must lie in \[0, 2\], got values in \[3, 3\]"),
    ([-1], checks.CheckError, r"new_lens must lie in \[0, 2\]"),
    ([2, 2], ValueError, r"new_lens must be int \[1\]"),
    ([1.0], ValueError, r"new_lens must be int \[1\]")],
    ids=["past_tokens", "negative", "batch", "float"])
def test_model_new_lens(new_lens, error, match):
  """Refused eagerly at the model, before the layer scans (where the lengths are traced)."""
  caches = _model().init_cache(1, 8)
  _refused(lambda: _model()(jnp.ones((1, 2), jnp.int32), caches, new_lens_B=jnp.asarray(new_lens)),
           error, match, caches)


def test_a_model_cache_missing_a_group_is_refused():
  """The first group's caches alone under the 2-group layout ran layer 0 only (the model
  zips groups with its stacks), with silently wrong logits."""
  caches = _model().init_cache(1, 8)
  with pytest.raises(ValueError, match=r"ModelCache: group 1 \(layers 1..1\) of its layout "
                                       r"has no caches: 1 group\(s\) of caches for 2"):
    ModelCache(caches.groups[:1], caches.layout)
  with pytest.raises(ValueError, match=r"ModelCache: group 2 has caches but no place"):
    ModelCache(caches.groups + caches.groups[:1], caches.layout)
  with pytest.raises(ValueError, match=r"ModelCache: group 0 \(layers 0..0\) holds 2 layer "
                                       r"cache\(s\), but its unit has 1 layer\(s\)"):
    ModelCache((caches.groups[0] * 2, caches.groups[1]), caches.layout)


def test_a_model_cache_with_too_few_repetitions_is_refused():
  deeper = m.CausalLM(dataclasses.replace(tiny_lm(), num_layers=3), rngs=nnx.Rngs(0),
                      backend="xla")  # groups: layer 0, then layers 1..2 as 2 repetitions
  caches = deeper.init_cache(1, 8)
  one_rep = ModelCache((caches.groups[0], jax.tree.map(lambda a: a[:1], caches.groups[1])),
                       caches.layout)
  _refused(lambda: deeper(jnp.ones((1, 2), jnp.int32), one_rep), ValueError,
           r"caches: group 1 \(layers 1..2\), unit position 0 stacks \[1\] repetitions, but "
           "the group has 2", one_rep)


def test_caches_of_another_model_are_refused():
  other = m.CausalLM(dataclasses.replace(tiny_lm(), num_layers=3), rngs=nnx.Rngs(0),
                     backend="xla")
  caches = other.init_cache(1, 8)
  _refused(lambda: _model()(jnp.ones((1, 2), jnp.int32), caches), ValueError,
           "caches must be the ModelCache of this model's init_cache", caches)


# ---- under jit, run checked -----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _jitted_layer_call():
  return nnx.jit(lambda layer, x, cache, lens, shared: layer(
      x, cache, new_lens_B=lens, shared_topk_BTK=shared).out_BTD)


# (layer kind, inputs: () -> (x, cache, new_lens, shared top-k), error, match)
CHECKED_CASES = {
    "overflow": ("full", lambda: (X5, _cache(lengths=(12,)), [5], None), checks.CheckError,
                 "sequence 0 would hold 17 tokens, more than the cache capacity 16"),
    "new_lens_past_tokens": ("full", lambda: (X5, _cache(), [6], None), checks.CheckError,
                             r"new_lens must lie in \[0, 5\], got values in \[6, 6\]"),
    "new_lens_negative": ("full", lambda: (X5, _cache(), [-2], None), checks.CheckError,
                          r"new_lens must lie in \[0, 5\]"),
    "lengths_negative": ("full", lambda: (X5, _cache(lengths=(-1,)), [5], None),
                         checks.CheckError, "cache lengths must be >= 0, got -1"),
    "positions_past_max": ("full", lambda: (X5, _cache(lengths=(4094,), capacity=4200), [5],
                                            None), checks.CheckError,
                           "would write position 4098, past max_position_embeddings 4096"),
    "empty_top_k_row": ("shared", lambda: (X5, _cache(keys=False), [5],
                                           jnp.full((1, 5, TOPK), -1, jnp.int32)),
                        checks.CheckError, "query row 0 of sequence 0 has no valid top-k"),
}


@pytest.mark.parametrize("kind, inputs, error, match", CHECKED_CASES.values(),
                         ids=CHECKED_CASES.keys())
def test_checked_layer_calls_under_jit(kind, inputs, error, match):
  layer = (_layer() if kind == "full" else
           m.DeepseekV32Attention(m.tiny(), rngs=nnx.Rngs(0), backend="xla", shares_topk=True))
  x, cache, lens, shared = inputs()
  args = (layer, jnp.asarray(x), cache, jnp.asarray(lens, jnp.int32), shared)
  _refused(lambda: checks.checked(_jitted_layer_call())(*args), error, match, cache)
  jax.block_until_ready(_jitted_layer_call()(*args))  # unchecked, the same call runs silently


@pytest.mark.parametrize("ids, match", [
    (jnp.array([[1, 999]], jnp.int32), r"token ids must lie in \[0, 260\), got values in "
                                       r"\[1, 999\]"),
    (jnp.ones((1, 9), jnp.int32), "would hold 9 tokens, more than the cache capacity 8")],
    ids=["ids_past_vocab", "overflow"])
def test_checked_model_calls_under_jit(ids, match):
  step = nnx.jit(lambda model, ids, caches: model(ids, caches))
  caches = _model().init_cache(1, 8)
  _refused(lambda: checks.checked(step)(_model(), ids, caches), checks.CheckError, match, caches)


# ---- generation -----------------------------------------------------------------------------

GENERATE_CASES = {
    "temperature_nan": (dict(temperature=NAN), ValueError, "temperature must be a finite"),
    "temperature_inf": (dict(temperature=INF), ValueError, "temperature must be a finite"),
    "temperature_negative": (dict(temperature=-0.5), ValueError, "temperature"),
    "temperature_string": (dict(temperature="1"), TypeError, "temperature must be a float"),
    "temperature_bool": (dict(temperature=True), TypeError, "temperature must be a float"),
    "top_p_nan": (dict(top_p=NAN), ValueError, "top_p"),
    "top_p_above_one": (dict(top_p=1.5), ValueError, "top_p"),
    "seed_huge": (dict(seed=2**70), ValueError, r"seed must be an int in \[0, 2\*\*32\)"),
    "seed_negative": (dict(seed=-1), ValueError, "seed"),
    "seed_float": (dict(seed=1.0), ValueError, "seed"),
    "seed_bool": (dict(seed=True), ValueError, "seed"),
    "max_new_tokens_bool": (dict(max_new_tokens=True), ValueError, "max_new_tokens"),
    "max_new_tokens_float": (dict(max_new_tokens=2.0), ValueError, "max_new_tokens"),
    "prompt_floats": (dict(prompt_ids=[[1.0, 2.0]]), TypeError,
                      "prompt 0 holds float values"),
    "prompt_bools": (dict(prompt_ids=[[True, False]]), TypeError, "prompt 0 holds bool values"),
    "prompt_strings": (dict(prompt_ids=[["a", "b"]]), TypeError, "prompt 0 holds str values"),
    "prompt_a_string": (dict(prompt_ids=["hello"]), TypeError,
                        "prompt 0 must be a list of int ids, got str"),
    "prompts_a_string": (dict(prompt_ids="hello"), TypeError,
                         "prompt_ids must be a list of id lists"),
    "prompt_nested": (dict(prompt_ids=[[[1, 2]]]), TypeError, "prompt 0 holds list values"),
    "prompt_float_array": (dict(prompt_ids=np.ones((1, 3), np.float32)), TypeError,
                           "prompt_ids must be an int array"),
    "prompt_bool_array": (dict(prompt_ids=np.ones((1, 3), bool)), TypeError,
                          "prompt_ids must be an int array"),
    "prompt_3d_array": (dict(prompt_ids=np.ones((1, 1, 3), np.int32)), TypeError,
                        "prompt_ids must be an int array"),
    "prompt_past_vocab": (dict(prompt_ids=[[1, 260]]), ValueError,
                          r"prompt 0 has ids outside \[0, 260\)"),
    "capacity_past_positions": (dict(cache_capacity=5000), ValueError,
                                "cache_capacity 5000 exceeds max_position_embeddings 4096"),
    "capacity_bool": (dict(cache_capacity=True), ValueError, "cache_capacity must be None or"),
    "capacity_too_small": (dict(cache_capacity=4), ValueError,
                           "needs 6 cache rows, more than cache_capacity 4"),
    "positions_past_max": (dict(max_new_tokens=4095), ValueError,
                           "needs 4097 positions, more than max_position_embeddings 4096"),
    "cache_dtype_int": (dict(cache_dtype=jnp.int32), TypeError,
                        "cache_dtype must be a floating dtype, got int32"),
    "eos_past_vocab": (dict(eos_id=260), ValueError, r"eos_id must be an id in \[0, 260\)"),
    "eos_string": (dict(eos_id="a"), ValueError, "eos_id"),
    "eos_bool": (dict(eos_id=True), ValueError, "eos_id"),
    "checks_string": (dict(checks="yes"), TypeError, "checks must be a bool"),
    "steps_per_dispatch_bool": (dict(steps_per_dispatch=True), ValueError,
                                "steps_per_dispatch must be a positive int"),
    "steps_per_dispatch_zero": (dict(steps_per_dispatch=0), ValueError, "steps_per_dispatch"),
    "eos_list_with_bool": (dict(eos_id=[3, False]), ValueError, "eos_id"),
    "prompts_empty": (dict(prompt_ids=[]), ValueError, "prompt_ids holds no prompt"),
    "prompts_empty_array": (dict(prompt_ids=np.zeros((0, 3), np.int32)), ValueError,
                            "prompt_ids holds no prompt"),
    "model_an_attention_layer": (dict(model=_layer), TypeError,
                                 "model must be a CausalLM, got DeepseekV32Attention"),
    "max_new_tokens_numpy_zero": (dict(max_new_tokens=np.int64(0)), ValueError,
                                  "max_new_tokens must be a positive int"),
    "steps_per_dispatch_numpy_bool": (dict(steps_per_dispatch=np.bool_(True)), ValueError,
                                      "steps_per_dispatch must be a positive int"),
}


@pytest.mark.parametrize("changes, error, match", GENERATE_CASES.values(),
                         ids=GENERATE_CASES.keys())
def test_generate(changes, error, match):
  """``model`` in a case is a function building it (so collecting the cases builds nothing)."""
  kwargs = {**dict(model=_model, prompt_ids=[[1, 2]], max_new_tokens=4), **changes}
  kwargs["model"] = kwargs["model"]()
  with pytest.raises(error, match=match):
    m.generate(**kwargs)


# ---- checkpoints ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_files(tmp_path_factory):
  """The files of a saved tiny checkpoint (name -> bytes), written once per module."""
  directory = tmp_path_factory.mktemp("checkpoint")
  save_pretrained(_model(), directory)
  return {p.name: p.read_bytes() for p in directory.iterdir()}


# (config.json: a dict of changed fields, a raw text, or None; load_pretrained keywords,
#  error, match)
CHECKPOINT_CASES = {
    "dtype_int8": (None, dict(dtype="int8"), ValueError, "dtype must be one of"),
    "dtype_bool": (None, dict(dtype=bool), ValueError, "dtype must be one of"),
    "compute_dtype_int8": (None, dict(dtype="fp8", compute_dtype="int8"), ValueError,
                           "compute_dtype must be one of"),
    "compute_dtype_without_fp8": (None, dict(compute_dtype=jnp.float32), ValueError,
                                  "compute_dtype float32 differs from dtype bfloat16"),
    "attention_unknown": (None, dict(attention="mha"), ValueError, "attention must be one of"),
    "grouped_matmul_unknown": (None, dict(grouped_matmul="fast"), ValueError,
                               "grouped_matmul must be one of"),
    "config_a_list": ("[1, 2]", {}, CheckpointError, "config.json: must hold a JSON object"),
    "config_not_json": ("{not json", {}, CheckpointError, "config.json: invalid JSON"),
    "hidden_size_string": (dict(hidden_size="big"), {}, CheckpointError,
                           "config.json: config field 'hidden_size' must be an int"),
    "rms_norm_eps_string": (dict(rms_norm_eps="1e-6"), {}, CheckpointError,
                            "config field 'rms_norm_eps' must be a float"),
    "rms_norm_eps_inf": (dict(rms_norm_eps=INF), {}, CheckpointError,
                         "config field 'rms_norm_eps' must be finite"),
    "vocab_bool": (dict(vocab_size=True), {}, CheckpointError, "vocab_size"),
}


@pytest.mark.parametrize("config, kwargs, error, match", CHECKPOINT_CASES.values(),
                         ids=CHECKPOINT_CASES.keys())
def test_load_pretrained(tmp_path, saved_files, config, kwargs, error, match):
  for name, data in saved_files.items():
    (tmp_path / name).write_bytes(data)
  if isinstance(config, dict):
    config = json.dumps({**json.loads(saved_files["config.json"]), **config})
  if config is not None:
    (tmp_path / "config.json").write_text(config)
  before = _files(tmp_path)
  with pytest.raises(error, match=match):
    load_pretrained(tmp_path, backend="xla", **kwargs)
  assert _files(tmp_path) == before


def test_load_pretrained_missing_directory(tmp_path):
  with pytest.raises(CheckpointError, match=f"{tmp_path / 'nowhere'} is not a directory"):
    load_pretrained(tmp_path / "nowhere")
  assert not (tmp_path / "nowhere").exists()


# ---- the command line -----------------------------------------------------------------------

def _files(directory):
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


CLI_CASES = {
    "seed_huge": (["--seed", str(2**70)], "argument --seed: must be an int in"),
    "seed_text": (["--seed", "one"], "argument --seed: expected an int, got 'one'"),
    "temperature_nan": (["--temperature", "nan"], "argument --temperature: must be a finite"),
    "temperature_negative": (["--temperature", "-1"], "argument --temperature"),
    "top_p_zero": (["--top-p", "0"], r"argument --top-p: must be a finite number in \(0, 1\]"),
    "max_new_tokens_zero": (["--max-new-tokens", "0"], "argument --max-new-tokens: must be"),
    "prompt_len_negative": (["--prompt-len", "-2"], "argument --prompt-len"),
    "batch_zero": (["--batch", "0"], "argument --batch"),
    "backend_name": (["--backend", "cuda"], "argument --backend: invalid choice"),
    "process_id_negative": (["--process-id", "-1"], "argument --process-id"),
    "temperature_inf": (["--temperature", "inf"], "argument --temperature: must be a finite"),
    "top_p_nan": (["--top-p", "nan"], "argument --top-p: must be a finite"),
    "dtype_int8": (["--dtype", "int8"], "argument --dtype: invalid choice"),
    "compute_dtype_fp8": (["--compute-dtype", "fp8"], "argument --compute-dtype: invalid choice"),
    "steps_float": (["--max-new-tokens", "2.5"], "argument --max-new-tokens: expected an int"),
}


@pytest.mark.parametrize("argv, match", CLI_CASES.values(), ids=CLI_CASES.keys())
def test_cli_arguments(argv, match, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["generate", *argv])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and "Traceback" not in err
  assert re.search(match, err), err


CLI_RUN_CASES = {
    "prompt_past_positions": (["--preset", "tiny", "--prompt-len", "5000",
                               "--max-new-tokens", "2"],
                              "needs 5002 positions, more than max_position_embeddings 4096"),
    "mesh_axis": (["--mesh", "data=1,pipeline=2"], "unknown mesh axis 'pipeline'"),
    "mesh_devices": (["--mesh", "data=3"], "needs 3 devices but 8 are available"),
    "coordinator_alone": (["--coordinator", "localhost:1234"],
                          "--coordinator, --num-processes and --process-id go together"),
    "compute_dtype_without_fp8": (["--compute-dtype", "float32"],
                                  "--compute-dtype applies to --dtype fp8"),
}


@pytest.mark.parametrize("argv, match", CLI_RUN_CASES.values(), ids=CLI_RUN_CASES.keys())
def test_cli_refuses_a_run(argv, match, capsys):
  try:
    code = cli.main(["generate", "--quiet", "--backend", "xla", *argv])
  except SystemExit as exit_info:
    code, message = 1, str(exit_info.code)
  else:
    message = capsys.readouterr().err
  assert code in (1, 2) and match in message


@pytest.mark.parametrize("content, match", [
    ('{"model_type": "llama"}', "model_type"),
    ("[1, 2]", "config.json"),
    ('{"model_type": "deepseek_v32", "hidden_size": "big"}', "hidden_size")],
    ids=["unknown_model_type", "config_a_list", "field_a_string"])
def test_cli_bad_checkpoint_leaves_its_files(tmp_path, capsys, content, match):
  save_pretrained(_model(), tmp_path)
  (tmp_path / "config.json").write_text(content)
  before = _files(tmp_path)
  assert cli.main(["generate", "--checkpoint", str(tmp_path), "--quiet", "--backend", "xla"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error:") and match in err and "Traceback" not in err
  assert _files(tmp_path) == before


def test_cli_missing_checkpoint_names_the_directory(tmp_path, capsys):
  missing = tmp_path / "nowhere"
  assert cli.main(["generate", "--checkpoint", str(missing), "--quiet"]) == 2
  assert str(missing) in capsys.readouterr().err
  assert not missing.exists()


# ---- the engine's settings and request ids -------------------------------------------------

ENGINE_CASES = {
    "log_interval_string": (dict(log_interval="10"), TypeError,
                            "log_interval must be a number of seconds or None, got str '10'"),
    "log_interval_negative": (dict(log_interval=-1.0), ValueError, "log_interval must be a finite"),
    "log_interval_nan": (dict(log_interval=NAN), ValueError, "log_interval must be a finite"),
    "seed_negative": (dict(seed=-1), ValueError, "seed"),
    "seed_float": (dict(seed=1.5), TypeError, "seed must be a static int, got float"),
    "eos_none": (dict(eos_token_ids=None), TypeError,
                 "eos_token_ids must be a sequence of token ids, got NoneType"),
    "eos_string": (dict(eos_token_ids="2"), TypeError, "eos_token_ids must be a sequence"),
    "eos_negative": (dict(eos_token_ids=[-1]), ValueError, "eos_token_ids entry"),
    "tokenizer_without_methods": (dict(tokenizer=object()), TypeError,
                                  r"tokenizer must have encode\(text\) and decode\(ids\)"),
    "prefix_caching_string": (dict(prefix_caching="yes"), TypeError,
                              "prefix_caching must be a bool"),
    "num_pages_zero": (dict(num_pages=0), ValueError, "num_pages"),
    "decode_steps_zero": (dict(decode_steps=0), ValueError, "decode_steps"),
}


@pytest.mark.parametrize("settings, error, match", ENGINE_CASES.values(), ids=ENGINE_CASES)
def test_engine_settings_are_refused_by_name(settings, error, match):
  from mla_jax.serving import Engine

  with pytest.raises(error, match=match):
    Engine(_model(), **{"num_pages": 4, "page_size": 8, "log_interval": None, **settings})


def test_unknown_request_ids_are_named():
  from mla_jax.serving import Engine

  engine = Engine(_model(), num_pages=4, page_size=8, log_interval=None)
  for call in (engine.release, engine.output, engine.abort):
    with pytest.raises(KeyError, match="no request with id 'nope'"):
      call("nope")
