"""Each kernel and its reference refuse the same bad inputs with the same error, naming the
argument, and agree on the degenerate sizes (K = 0, S = 0, T = 0)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.backends.pallas import PallasTritonBackend
from mla_jax.backends.xla import XlaBackend
from pallas_kernels.block_config import (DenseMHAKernelConfig, IndexerLogitsKernelConfig,
                                         SparseMQAKernelConfig)
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference
from pallas_kernels.sparse_mqa import sparse_mqa, sparse_mqa_reference

sds = jax.ShapeDtypeStruct
F32, BF16, F16, I32, FP8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.float8_e4m3fn

# op: (kernel, reference, positional argument names, valid arguments)
OPS = {
    "sparse_mqa": (sparse_mqa, sparse_mqa_reference, ("q", "kv", "topk"), dict(
        q=sds((3, 4, 80), F32), kv=sds((50, 80), F32), topk=sds((3, 7), I32),
        sm_scale=0.1, d_v=64)),
    "sparse_mqa_fp8": (sparse_mqa, sparse_mqa_reference, ("q", "kv", "topk"), dict(
        q=sds((3, 4, 80), F32), kv=Fp8LatentRows(sds((50, 64), FP8), sds((50, 1), F32),
                                                  sds((50, 16), BF16)),
        topk=sds((3, 7), I32), sm_scale=0.1, d_v=64)),
    "dense_mha": (dense_mha, dense_mha_reference, ("q", "k", "v"), dict(
        q=sds((3, 2, 48), F32), k=sds((20, 2, 48), F32), v=sds((20, 2, 32), F32),
        sm_scale=0.2, q_offset=0, kv_len=20)),
    "indexer_logits": (indexer_logits, indexer_logits_reference,
                       ("q", "k", "w", "starts", "ends"), dict(
        q=sds((3, 4, 32), F32), k=sds((50, 32), F32), w=sds((3, 4), F32),
        starts=sds((3,), I32), ends=sds((3,), I32), k_scale_S=None)),
}

# (op, case, changed arguments, error, the argument the message must name)
BAD_INPUTS = [
    ("sparse_mqa", "q_rank", dict(q=sds((3, 80), F32)), ValueError, "q_THL"),
    ("sparse_mqa", "kv_width", dict(kv=sds((50, 64), F32)), ValueError, "kv_SL"),
    ("sparse_mqa", "topk_rows", dict(topk=sds((4, 7), I32)), ValueError, "topk_TK"),
    ("sparse_mqa", "topk_int16", dict(topk=sds((3, 7), jnp.int16)), TypeError, "topk_TK"),
    ("sparse_mqa", "int_q", dict(q=sds((3, 4, 80), I32), kv=sds((50, 80), I32)), TypeError,
     "q_THL"),
    ("sparse_mqa", "mixed_dtypes", dict(kv=sds((50, 80), BF16)), TypeError, "kv_SL"),
    ("sparse_mqa", "d_v_zero", dict(d_v=0), ValueError, "d_v"),
    ("sparse_mqa", "d_v_past_width", dict(d_v=81), ValueError, "d_v"),
    ("sparse_mqa", "d_v_float", dict(d_v=64.0), TypeError, "d_v"),
    ("sparse_mqa", "sm_scale_nan", dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    ("sparse_mqa", "sm_scale_negative", dict(sm_scale=-0.1), ValueError, "sm_scale"),
    ("sparse_mqa", "sm_scale_string", dict(sm_scale="0.1"), TypeError, "sm_scale"),
    ("sparse_mqa", "sm_scale_vector", dict(sm_scale=np.array([0.1])), TypeError, "sm_scale"),
    ("sparse_mqa", "q_not_an_array", dict(q="q"), TypeError, "q_THL"),
    ("sparse_mqa_fp8", "d_v_not_latent", dict(d_v=48), ValueError, "d_v"),
    ("sparse_mqa_fp8", "width", dict(q=sds((3, 4, 96), F32)), ValueError, "kv_SL"),
    ("sparse_mqa_fp8", "bf16_values", dict(kv=Fp8LatentRows(
        sds((50, 64), BF16), sds((50, 1), F32), sds((50, 16), BF16))), TypeError, "kv_SL.values"),
    ("sparse_mqa_fp8", "bf16_scales", dict(kv=Fp8LatentRows(
        sds((50, 64), FP8), sds((50, 1), BF16), sds((50, 16), BF16))), TypeError, "kv_SL.scales"),
    ("sparse_mqa_fp8", "uneven_tiles", dict(kv=Fp8LatentRows(
        sds((50, 64), FP8), sds((50, 3), F32), sds((50, 16), BF16))), ValueError, "kv_SL"),
    ("sparse_mqa_fp8", "row_counts", dict(kv=Fp8LatentRows(
        sds((50, 64), FP8), sds((49, 1), F32), sds((50, 16), BF16))), ValueError, "kv_SL"),
    ("sparse_mqa_fp8", "fp16_q", dict(q=sds((3, 4, 80), F16)), TypeError, "q_THL"),
    ("dense_mha", "q_rank", dict(q=sds((3, 48), F32)), ValueError, "q_THQ"),
    ("dense_mha", "k_heads", dict(k=sds((20, 3, 48), F32)), ValueError, "k_SHQ"),
    ("dense_mha", "v_rows", dict(v=sds((21, 2, 32), F32)), ValueError, "v_SHV"),
    ("dense_mha", "v_width_zero", dict(v=sds((20, 2, 0), F32)), ValueError, "v_SHV"),
    ("dense_mha", "int_q", dict(q=sds((3, 2, 48), I32)), TypeError, "q_THQ"),
    ("dense_mha", "mixed_dtypes", dict(v=sds((20, 2, 32), BF16)), TypeError, "v_SHV"),
    ("dense_mha", "kv_len_float", dict(kv_len=2.5), TypeError, "kv_len"),
    ("dense_mha", "kv_len_bool", dict(kv_len=True), TypeError, "kv_len"),
    ("dense_mha", "kv_len_vector", dict(kv_len=np.array([20, 20])), TypeError, "kv_len"),
    ("dense_mha", "q_offset_float_array", dict(q_offset=np.float32(0)), TypeError, "q_offset"),
    ("dense_mha", "q_offset_past_int32", dict(q_offset=2**40), ValueError, "q_offset"),
    ("dense_mha", "q_offset_negative", dict(q_offset=-2), ValueError, "q_offset"),
    ("dense_mha", "q_offset_negative_numpy", dict(q_offset=np.int32(-1)), ValueError,
     "q_offset"),
    ("dense_mha", "sm_scale_zero", dict(sm_scale=0.0), ValueError, "sm_scale"),
    ("dense_mha", "sm_scale_inf", dict(sm_scale=float("inf")), ValueError, "sm_scale"),
    ("indexer_logits", "q_rank", dict(q=sds((3, 128), F32)), ValueError, "q_TGI"),
    ("indexer_logits", "no_heads", dict(q=sds((3, 0, 32), F32), w=sds((3, 0), F32)), ValueError,
     "q_TGI"),
    ("indexer_logits", "k_width", dict(k=sds((50, 64), F32)), ValueError, "k_SI"),
    ("indexer_logits", "w_shape", dict(w=sds((3, 5), F32)), ValueError, "w_TG"),
    ("indexer_logits", "starts_int16", dict(starts=sds((3,), jnp.int16)), TypeError, "starts_T"),
    ("indexer_logits", "ends_length", dict(ends=sds((4,), I32)), ValueError, "ends_T"),
    ("indexer_logits", "mixed_dtypes", dict(k=sds((50, 32), BF16)), TypeError, "k_SI"),
    ("indexer_logits", "fp16_q", dict(q=sds((3, 4, 32), F16), k=sds((50, 32), F16)), TypeError,
     "q_TGI"),
    ("indexer_logits", "int_w", dict(w=sds((3, 4), I32)), TypeError, "w_TG"),
    ("indexer_logits", "k_scale_length", dict(k_scale_S=sds((49,), F32)), ValueError, "k_scale_S"),
    ("indexer_logits", "k_scale_int", dict(k_scale_S=sds((50,), I32)), TypeError, "k_scale_S"),
]


def raised(fn, arrays, kwargs):
  """The exception ``fn`` raises on these inputs (traced abstractly: nothing is computed).

  A non-array argument cannot be traced, so it is passed as it is.
  """
  try:
    if all(isinstance(x, sds) for x in jax.tree.leaves(arrays)):
      jax.eval_shape(functools.partial(fn, **kwargs), *arrays)
    else:
      fn(*arrays, **kwargs)
  except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
    return e
  return None


@pytest.mark.parametrize("op, change, error, argument",
                         [pytest.param(op, change, error, arg, id=f"{op}-{case}")
                          for op, case, change, error, arg in BAD_INPUTS])
def test_kernel_and_reference_refuse_alike(op, change, error, argument):
  kernel, reference, positional, valid = OPS[op]
  args = {**valid, **change}
  arrays = [args.pop(name) for name in positional]
  errors = [raised(fn, arrays, args) for fn in (kernel, reference)]
  for e in errors:
    assert type(e) is error, f"{op}: expected {error.__name__}, got {e!r}"
    assert re.search(rf"\b{argument}\b", str(e)), f"message does not name {argument}: {e}"
  assert str(errors[0]) == str(errors[1])


@pytest.mark.parametrize("op", list(OPS))
def test_valid_arguments_pass(op):
  kernel, reference, positional, valid = OPS[op]
  args = dict(valid)
  arrays = [args.pop(name) for name in positional]
  for fn in (kernel, reference):
    assert raised(fn, arrays, args) is None


@pytest.mark.parametrize("op, config", [
    ("sparse_mqa", DenseMHAKernelConfig()),
    ("sparse_mqa_fp8", DenseMHAKernelConfig()),
    ("dense_mha", "fast"),
    ("indexer_logits", SparseMQAKernelConfig()),
])
def test_kernel_refuses_a_foreign_config(op, config):
  kernel, _, positional, valid = OPS[op]
  args = dict(valid)
  arrays = [args.pop(name) for name in positional]
  e = raised(kernel, arrays, {**args, "config": config})
  assert isinstance(e, TypeError) and "config" in str(e)


# ---- degenerate sizes: kernel (interpret) and reference give the same, without a kernel run ----

def both(kernel, reference, *args, **kwargs):
  return (kernel(*args, **kwargs, interpret=True), reference(*args, **kwargs))


def assert_no_attention(results, shape):
  """Every row sees nothing: out 0 of ``shape`` and LSE +inf, from the kernel and the reference."""
  for out, lse in results:
    assert out.shape == shape and lse.shape == shape[:2]
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.isposinf(np.asarray(lse)).all()


@pytest.mark.parametrize("T, S, K", [(3, 50, 0), (3, 0, 7), (0, 50, 7)],
                         ids=["no_topk_slots", "no_rows", "no_tokens"])
def test_sparse_mqa_degenerate_sizes(T, S, K):
  q = jnp.ones((T, 4, 80), F32)
  kv = jnp.ones((S, 80), F32)
  topk = jnp.zeros((T, K), I32)  # index 0 is out of range when S = 0
  assert_no_attention(both(sparse_mqa, sparse_mqa_reference, q, kv, topk, sm_scale=0.1, d_v=64),
                      (T, 4, 64))


@pytest.mark.parametrize("T, S, K", [(3, 50, 0), (3, 0, 7), (0, 50, 7)],
                         ids=["no_topk_slots", "no_rows", "no_tokens"])
def test_sparse_mqa_fp8_degenerate_sizes(T, S, K):
  rows = Fp8LatentRows(jnp.ones((S, 64), FP8), jnp.ones((S, 1), F32), jnp.ones((S, 16), BF16))
  topk = jnp.zeros((T, K), I32)
  assert_no_attention(both(sparse_mqa, sparse_mqa_reference, jnp.ones((T, 4, 80), F32), rows,
                           topk, sm_scale=0.1, d_v=64), (T, 4, 64))


def test_sparse_mqa_no_topk_slots_batched_and_default_config():
  assert SparseMQAKernelConfig.default_for(4, 0, 64).block_k >= 16  # no ZeroDivisionError
  q, kv, topk = jnp.ones((2, 3, 4, 80), F32), jnp.ones((2, 50, 80), F32), jnp.zeros((2, 3, 0), I32)
  for backend in (XlaBackend(), PallasTritonBackend(interpret=True)):
    out, lse = backend.sparse_mqa(q, kv, topk, sm_scale=0.1, d_v=64)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.isposinf(np.asarray(lse)).all()


@pytest.mark.parametrize("T, S", [(3, 0), (0, 20)], ids=["no_keys", "no_tokens"])
def test_dense_mha_degenerate_sizes(T, S):
  q, k, v = jnp.ones((T, 2, 48), F32), jnp.ones((S, 2, 48), F32), jnp.ones((S, 2, 32), F32)
  assert_no_attention(both(dense_mha, dense_mha_reference, q, k, v, sm_scale=0.2, q_offset=0,
                           kv_len=S), (T, 2, 32))


@pytest.mark.parametrize("T, S", [(3, 0), (0, 20)], ids=["no_keys", "no_tokens"])
def test_indexer_logits_degenerate_sizes(T, S):
  args = (jnp.ones((T, 4, 32), F32), jnp.ones((S, 32), F32), jnp.ones((T, 4), F32),
          jnp.zeros((T,), I32), jnp.full((T,), S, I32))
  for logits in both(indexer_logits, indexer_logits_reference, *args):
    assert logits.shape == (T, S) and logits.dtype == F32


def test_default_configs_accept_zero_sizes():
  for config in (SparseMQAKernelConfig.default_for(0, 0, 64),
                 IndexerLogitsKernelConfig.default_for(0, 0),
                 DenseMHAKernelConfig.default_for(0, 0, 48, 32)):
    assert config.num_warps >= 1
