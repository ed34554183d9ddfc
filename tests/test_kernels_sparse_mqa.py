"""Sparse MQA kernel (interpret mode) vs a float64 NumPy computation and the jnp reference.

Interpret mode fills fresh float outputs with NaN, so "finite everywhere" also proves that
every output element (padded head rows included) was written by the kernel.
"""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.backends.pallas import PallasTritonBackend
from mla_jax import fp8_cache
from mla_jax.backends.xla import XlaBackend
from pallas_kernels.block_config import SparseMQAKernelConfig
from pallas_kernels.fp8_rows import dequantize_rows
from pallas_kernels.sparse_mqa import sparse_mqa, sparse_mqa_reference
from tests.numpy_kernels import assert_attention_matches, numpy_dequantize_rows, numpy_sparse_mqa

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
LSE_ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-3}


def make_inputs(seed, T, H, K, S, D, dtype, pattern="random"):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((T, H, D)), dtype)
  kv = jnp.asarray(rng.standard_normal((S, D)), dtype)
  if pattern == "random":  # includes -1 padding and out-of-range indices
    topk = rng.integers(-1, S + 3, (T, K))
  elif pattern == "valid":
    topk = rng.integers(0, S, (T, K))
  elif pattern == "padded":  # causal-style: a valid prefix, then -1
    topk = np.where(np.arange(K)[None, :] < rng.integers(1, K + 1, (T, 1)), rng.integers(0, S, (T, K)), -1)
  elif pattern == "empty_rows":  # every other row has no valid index (-1 and >= S mixed)
    topk = rng.integers(0, S, (T, K))
    topk[::2] = np.where(np.arange(K) % 2 == 0, -1, S + np.arange(K))[None, :]
  else:
    raise ValueError(pattern)
  return q, kv, jnp.asarray(topk, jnp.int32)


def assert_matches(out, lse, q, kv, topk, sm_scale, d_v, dtype):
  assert_attention_matches(out, lse, *numpy_sparse_mqa(q, kv, topk, sm_scale, d_v),
                           rtol=RTOL[dtype], lse_rtol=LSE_ATOL[dtype], lse_atol=LSE_ATOL[dtype])


CASES = (
    dict(testcase_name="t1_h1_k1_s1", T=1, H=1, K=1, S=1, pattern="valid"),
    dict(testcase_name="t3_h4_k7_s100", T=3, H=4, K=7, S=100),
    dict(testcase_name="t3_h5_k7_s100_head_overhang", T=3, H=5, K=7, S=100),
    dict(testcase_name="t64_h16_k64_s1000", T=64, H=16, K=64, S=1000),
    dict(testcase_name="t3_h128_k200_s1000", T=3, H=128, K=200, S=1000, pattern="padded"),
    dict(testcase_name="t257_h4_k64_s100", T=257, H=4, K=64, S=100),
    dict(testcase_name="t1_h16_k200_s100_kv_smaller_than_topk", T=1, H=16, K=200, S=100),
    dict(testcase_name="t4_h16_k64_s1000_empty_rows", T=4, H=16, K=64, S=1000, pattern="empty_rows"),
)

# bf16 reruns only where the rounding path differs; each case costs a fresh interpret compile.
BF16_CASES = ("t3_h4_k7_s100", "t64_h16_k64_s1000", "t4_h16_k64_s1000_empty_rows")


class SparseMQAKernelTest(chex.TestCase):

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{dt.__name__}", dtype=dt)
      for c in CASES for dt in (jnp.float32, jnp.bfloat16)
      if dt == jnp.float32 or c["testcase_name"] in BF16_CASES
  )
  def test_matches_float64_and_reference(self, T, H, K, S, dtype, pattern="random"):
    D, d_v, sm_scale = 80, 64, 0.11  # tiny MLA: 64 latent + 16 rope
    q, kv, topk = make_inputs(T * 7 + K, T, H, K, S, D, dtype, pattern)
    out, lse = sparse_mqa(q, kv, topk, sm_scale=sm_scale, d_v=d_v, interpret=True)
    chex.assert_shape(out, (T, H, d_v))
    chex.assert_type(out, dtype)
    chex.assert_shape(lse, (T, H))
    assert_matches(out, lse, q, kv, topk, sm_scale, d_v, dtype)
    ref_out, ref_lse = sparse_mqa_reference(q, kv, topk, sm_scale=sm_scale, d_v=d_v)
    chex.assert_trees_all_close(
        (out.astype(jnp.float32), lse), (ref_out.astype(jnp.float32), ref_lse),
        rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
    )

  def test_deepseek_widths_bf16(self):
    # 576 = 512 latent + 64 rope; the default config of the real shape (block_h 32, block_k 32).
    q, kv, topk = make_inputs(5, 2, 40, 100, 300, 576, jnp.bfloat16)
    out, lse = sparse_mqa(q, kv, topk, sm_scale=576**-0.5, d_v=512, interpret=True)
    assert_matches(out, lse, q, kv, topk, 576**-0.5, 512, jnp.bfloat16)

  @chex.variants(with_jit=True, without_jit=True)
  def test_deterministic_and_variants(self):
    q, kv, topk = make_inputs(1, 3, 4, 7, 100, 80, jnp.float32)
    fn = self.variant(functools.partial(sparse_mqa, sm_scale=0.1, d_v=64, interpret=True))
    chex.assert_trees_all_equal(fn(q, kv, topk), fn(q, kv, topk))

  def test_explicit_config(self):
    q, kv, topk = make_inputs(2, 3, 20, 50, 100, 80, jnp.float32)
    config = SparseMQAKernelConfig(block_h=16, block_k=16, num_warps=4, num_stages=1)
    out, lse = sparse_mqa(q, kv, topk, sm_scale=0.1, d_v=64, config=config, interpret=True)
    assert_matches(out, lse, q, kv, topk, 0.1, 64, jnp.float32)

  def test_backend_batched_matches_xla(self):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 80)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 50, 80)), jnp.float32)
    topk = jnp.asarray(rng.integers(-1, 53, (2, 3, 7)), jnp.int32)
    got = PallasTritonBackend(interpret=True).sparse_mqa(q, kv, topk, sm_scale=0.1, d_v=64)
    want = XlaBackend().sparse_mqa(q, kv, topk, sm_scale=0.1, d_v=64)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(
    T=st.integers(1, 4), H=st.integers(1, 20), K=st.integers(1, 40), S=st.integers(1, 60),
    pattern=st.sampled_from(["random", "valid", "padded", "empty_rows"]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_float64(T, H, K, S, pattern, seed):
  q, kv, topk = make_inputs(seed, T, H, K, S, 80, jnp.float32, pattern)
  out, lse = sparse_mqa(q, kv, topk, sm_scale=0.09, d_v=64, interpret=True)
  assert_matches(out, lse, q, kv, topk, 0.09, 64, jnp.float32)


# ---- fp8 rows (the 656-byte cache layout): gathered, then dequantized in the kernel ----------

FP8_RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_fp8_inputs(seed, T, H, K, S, A, R, dtype, pattern="random"):
  q, kv, topk = make_inputs(seed, T, H, K, S, A + R, jnp.float32, pattern)
  # Rows of different magnitudes get different scales.
  kv = kv * jnp.asarray(10.0 ** np.random.default_rng(seed).uniform(-1, 0.5, (S, 1)), jnp.float32)
  return q.astype(dtype), fp8_cache.quantize_latent(kv, A), topk


FP8_CASES = (
    dict(testcase_name="tiny_one_tile_f32", T=3, H=5, K=7, S=100, A=64, R=16, dtype=jnp.float32),
    dict(testcase_name="tiny_one_tile_bf16", T=3, H=5, K=7, S=100, A=64, R=16,
         dtype=jnp.bfloat16),
    dict(testcase_name="odd_tile_empty_rows_f32", T=4, H=16, K=40, S=300, A=96, R=32,
         dtype=jnp.float32, pattern="empty_rows"),
    dict(testcase_name="dsv32_four_tiles_bf16", T=2, H=40, K=100, S=300, A=512, R=64,
         dtype=jnp.bfloat16),
)


class SparseMQAFp8RowsTest(chex.TestCase):

  @parameterized.named_parameters(*FP8_CASES)
  def test_matches_float64_of_dequantized_rows_and_reference(self, T, H, K, S, A, R, dtype,
                                                             pattern="random"):
    q, rows, topk = make_fp8_inputs(T + K + A, T, H, K, S, A, R, dtype, pattern)
    sm_scale = (A + R) ** -0.5
    out, lse = sparse_mqa(q, rows, topk, sm_scale=sm_scale, d_v=A, interpret=True)
    chex.assert_shape(out, (T, H, A))
    chex.assert_type(out, dtype)
    truth = numpy_sparse_mqa(q, numpy_dequantize_rows(rows), topk, sm_scale, A)
    assert_attention_matches(out, lse, *truth, rtol=FP8_RTOL[dtype], lse_rtol=LSE_ATOL[dtype],
                             lse_atol=LSE_ATOL[dtype])
    print(f"{self._testMethodName}: kernel vs float64 of the dequantized rows, relative error "
          f"{np.linalg.norm(np.asarray(out, np.float64) - truth[0]) / np.linalg.norm(truth[0]):.2e}")
    ref_out, ref_lse = sparse_mqa_reference(q, rows, topk, sm_scale=sm_scale, d_v=A)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    chex.assert_trees_all_close((out.astype(jnp.float32), lse),
                                (ref_out.astype(jnp.float32), ref_lse), rtol=tol, atol=tol)

  def test_equals_the_kernel_on_dequantized_rows(self):
    """Dequantized values are exact in float32, so reading fp8 rows is reading their
    dequantized float32 copy (to accumulation order)."""
    q, rows, topk = make_fp8_inputs(3, 3, 20, 50, 100, 64, 16, jnp.float32)
    config = SparseMQAKernelConfig(block_h=16, block_k=16)
    got = sparse_mqa(q, rows, topk, sm_scale=0.1, d_v=64, config=config, interpret=True)
    want = sparse_mqa(q, dequantize_rows(rows, jnp.float32), topk, sm_scale=0.1, d_v=64,
                      config=config, interpret=True)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)

  def test_backend_batched_matches_xla(self):
    batch = [make_fp8_inputs(b, 3, 4, 7, 50, 64, 16, jnp.float32) for b in range(2)]
    q, rows, topk = jax.tree.map(lambda *xs: jnp.stack(xs), *batch)
    got = PallasTritonBackend(interpret=True).sparse_mqa(q, rows, topk, sm_scale=0.1, d_v=64)
    want = XlaBackend().sparse_mqa(q, rows, topk, sm_scale=0.1, d_v=64)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)

