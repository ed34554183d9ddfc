"""The sparse MQA suite, run over every implementation (``test_sparse_mqa.py``).

Against a float64 NumPy computation and the jnp reference: float rows and fp8 rows (the
656-byte cache layout), hidden rows poisoned with NaN/inf, bad inputs and degenerate sizes.
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

from mla_jax import fp8_cache
from mla_jax.testing import relative_error
from pallas_kernels.block_config import DenseMHAKernelConfig, SparseMQAKernelConfig
from pallas_kernels.fp8_rows import Fp8LatentRows, dequantize_rows
from pallas_kernels.sparse_mqa import sparse_mqa, sparse_mqa_reference
from tests.kernels import common
from tests.kernels.numpy_reference import (assert_attention_matches, numpy_dequantize_rows,
                                           numpy_sparse_mqa)

sds = jax.ShapeDtypeStruct
F32, BF16, F16, I32, FP8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.float8_e4m3fn
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
LSE_ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-3}
FP8_RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


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


def make_fp8_inputs(seed, T, H, K, S, A, R, dtype, pattern="random"):
  q, kv, topk = make_inputs(seed, T, H, K, S, A + R, jnp.float32, pattern)
  # Rows of different magnitudes get different scales.
  kv = kv * jnp.asarray(10.0 ** np.random.default_rng(seed).uniform(-1, 0.5, (S, 1)), jnp.float32)
  return q.astype(dtype), fp8_cache.quantize_latent(kv, A), topk


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

FP8_CASES = (
    dict(testcase_name="tiny_one_tile_f32", T=3, H=5, K=7, S=100, A=64, R=16, dtype=jnp.float32),
    dict(testcase_name="tiny_one_tile_bf16", T=3, H=5, K=7, S=100, A=64, R=16,
         dtype=jnp.bfloat16),
    dict(testcase_name="odd_tile_empty_rows_f32", T=4, H=16, K=40, S=300, A=96, R=32,
         dtype=jnp.float32, pattern="empty_rows"),
    dict(testcase_name="dsv32_four_tiles_bf16", T=2, H=40, K=100, S=300, A=512, R=64,
         dtype=jnp.bfloat16),
)

# ---- hidden rows: T 4, H 5 (head blocks of 16 overhang), K 7 (slot blocks of 16), S 40 -------

MASKING_CONFIG = SparseMQAKernelConfig(block_h=16, block_k=16)
MASKING_TOPK = np.array([
    [3, -1, 9, 40, 12, 4, -1],       # -1 and >= S slots read row 0 (clamped)
    [5, 6, 7, 8, 52, -1, 11],
    [-1, -1, 40, 41, -1, -1, -1],    # an empty row
    [12, 13, 14, 3, 5, -1, 39],
], np.int32)
MASKING_CASES = {
    # name: (which array, which rows of it, tokens whose output may change)
    "row_no_slot_selects": ("kv", [20, 30, 38], []),
    "row_invalid_slots_clamp_to": ("kv", [0], []),
    "selected_row_shows": ("kv", [12], [0, 3]),
    "own_query_row": ("q", [1], [1]),
}
# fp8 rows of the same kv (A 64 + R 16, one scale tile): poison one part of some rows. e4m3 has
# NaN but no inf, so an inf "value" is poisoned through its scale (inf * 0 = NaN included).
FP8_PARTS = {"values": 0, "scales": 1, "rope": 2}


def masking_inputs(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(shape).astype(np.float32) for shape in ((4, 5, 80), (40, 80))]


# ---- bad inputs: (case, changed arguments, error, the argument the message must name) ------

VALID = dict(q=sds((3, 4, 80), F32), kv=sds((50, 80), F32), topk=sds((3, 7), I32), sm_scale=0.1,
             d_v=64)
VALID_FP8 = dict(VALID, kv=Fp8LatentRows(sds((50, 64), FP8), sds((50, 1), F32),
                                         sds((50, 16), BF16)))
BAD_INPUTS = [
    ("q_rank", dict(q=sds((3, 80), F32)), ValueError, "q_THL"),
    ("kv_width", dict(kv=sds((50, 64), F32)), ValueError, "kv_SL"),
    ("topk_rows", dict(topk=sds((4, 7), I32)), ValueError, "topk_TK"),
    ("topk_int16", dict(topk=sds((3, 7), jnp.int16)), TypeError, "topk_TK"),
    ("int_q", dict(q=sds((3, 4, 80), I32), kv=sds((50, 80), I32)), TypeError, "q_THL"),
    ("mixed_dtypes", dict(kv=sds((50, 80), BF16)), TypeError, "kv_SL"),
    ("d_v_zero", dict(d_v=0), ValueError, "d_v"),
    ("d_v_past_width", dict(d_v=81), ValueError, "d_v"),
    ("d_v_float", dict(d_v=64.0), TypeError, "d_v"),
    ("sm_scale_nan", dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    ("sm_scale_negative", dict(sm_scale=-0.1), ValueError, "sm_scale"),
    ("sm_scale_string", dict(sm_scale="0.1"), TypeError, "sm_scale"),
    ("sm_scale_vector", dict(sm_scale=np.array([0.1])), TypeError, "sm_scale"),
    ("q_not_an_array", dict(q="q"), TypeError, "q_THL"),
]
BAD_FP8_INPUTS = [
    ("d_v_not_latent", dict(d_v=48), ValueError, "d_v"),
    ("width", dict(q=sds((3, 4, 96), F32)), ValueError, "kv_SL"),
    ("bf16_values", dict(kv=Fp8LatentRows(
        sds((50, 64), BF16), sds((50, 1), F32), sds((50, 16), BF16))), TypeError, "kv_SL.values"),
    ("bf16_scales", dict(kv=Fp8LatentRows(
        sds((50, 64), FP8), sds((50, 1), BF16), sds((50, 16), BF16))), TypeError, "kv_SL.scales"),
    ("uneven_tiles", dict(kv=Fp8LatentRows(
        sds((50, 64), FP8), sds((50, 3), F32), sds((50, 16), BF16))), ValueError, "kv_SL"),
    ("row_counts", dict(kv=Fp8LatentRows(
        sds((50, 64), FP8), sds((49, 1), F32), sds((50, 16), BF16))), ValueError, "kv_SL"),
    ("fp16_q", dict(q=sds((3, 4, 80), F16)), TypeError, "q_THL"),
]
DEGENERATE = [dict(testcase_name="no_topk_slots", T=3, S=50, K=0),
              dict(testcase_name="no_rows", T=3, S=0, K=7),
              dict(testcase_name="no_tokens", T=0, S=50, K=7)]


class SparseMQATestBase(common.KernelTestBase):

  KERNEL = staticmethod(sparse_mqa)
  REFERENCE = staticmethod(sparse_mqa_reference)
  STATIC_ARGNAMES = ("sm_scale", "d_v")
  POSITIONAL = ("q", "kv", "topk")

  # ---- float rows against float64 and the reference -----------------------------------------

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{dt.__name__}", dtype=dt)
      for c in CASES for dt in (jnp.float32, jnp.bfloat16)
      if dt == jnp.float32 or c["testcase_name"] in BF16_CASES
  )
  def test_matches_float64_and_reference(self, T, H, K, S, dtype, pattern="random"):
    D, d_v, sm_scale = 80, 64, 0.11  # tiny MLA: 64 latent + 16 rope
    q, kv, topk = make_inputs(T * 7 + K, T, H, K, S, D, dtype, pattern)
    out, lse = self.fn()(q, kv, topk, sm_scale=sm_scale, d_v=d_v)
    chex.assert_shape(out, (T, H, d_v))
    chex.assert_type(out, dtype)
    chex.assert_shape(lse, (T, H))
    assert_matches(out, lse, q, kv, topk, sm_scale, d_v, dtype)
    ref_out, ref_lse = self.reference()(q, kv, topk, sm_scale=sm_scale, d_v=d_v)
    chex.assert_trees_all_close(
        (out.astype(jnp.float32), lse), (ref_out.astype(jnp.float32), ref_lse),
        rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
    )

  def test_deepseek_widths_bf16(self):
    # 576 = 512 latent + 64 rope; the default config of the real shape (block_h 32, block_k 32).
    q, kv, topk = make_inputs(5, 2, 40, 100, 300, 576, jnp.bfloat16)
    out, lse = self.fn()(q, kv, topk, sm_scale=576**-0.5, d_v=512)
    assert_matches(out, lse, q, kv, topk, 576**-0.5, 512, jnp.bfloat16)

  @chex.variants(with_jit=True, without_jit=True)
  def test_deterministic_and_variants(self):
    q, kv, topk = make_inputs(1, 3, 4, 7, 100, 80, jnp.float32)
    fn = self.variant(functools.partial(self.fn(jit=False), sm_scale=0.1, d_v=64))
    chex.assert_trees_all_equal(fn(q, kv, topk), fn(q, kv, topk))

  def test_explicit_config(self):
    q, kv, topk = make_inputs(2, 3, 20, 50, 100, 80, jnp.float32)
    config = SparseMQAKernelConfig(block_h=16, block_k=16, num_warps=4, num_stages=1)
    out, lse = self.fn(config)(q, kv, topk, sm_scale=0.1, d_v=64)
    assert_matches(out, lse, q, kv, topk, 0.1, 64, jnp.float32)

  def test_backend_batched_matches_reference(self):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 80)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 50, 80)), jnp.float32)
    topk = jnp.asarray(rng.integers(-1, 53, (2, 3, 7)), jnp.int32)
    got = self.backend().sparse_mqa(q, kv, topk, sm_scale=0.1, d_v=64)
    reference = jax.jit(jax.vmap(functools.partial(self.REFERENCE, sm_scale=0.1, d_v=64)))
    want = reference(q, kv, topk)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)

  # The same test runs from each implementation's class (hence differing_executors).
  @hypothesis.settings(max_examples=8, deadline=None, derandomize=True,
                       suppress_health_check=[hypothesis.HealthCheck.differing_executors])
  @hypothesis.given(
      T=st.integers(1, 4), H=st.integers(1, 20), K=st.integers(1, 40), S=st.integers(1, 60),
      pattern=st.sampled_from(["random", "valid", "padded", "empty_rows"]),
      seed=st.integers(0, 2**16),
  )
  def test_property_matches_float64(self, T, H, K, S, pattern, seed):
    q, kv, topk = make_inputs(seed, T, H, K, S, 80, jnp.float32, pattern)
    out, lse = self.fn()(q, kv, topk, sm_scale=0.09, d_v=64)
    assert_matches(out, lse, q, kv, topk, 0.09, 64, jnp.float32)

  @parameterized.parameters((1, 1, 1, 1), (5, 4, 37, 7), (9, 16, 100, 40))
  def test_invalid_and_empty_rows(self, t, h, s, k):
    rng = np.random.default_rng(t * 100 + k)
    d_v, d = 64, 80
    q, kv = rng.standard_normal((t, h, d)), rng.standard_normal((s, d))
    idx = rng.integers(-1, s + 5, size=(t, k)).astype(np.int32)  # -1 and out-of-range mixed in
    idx[0] = -1  # an empty row
    out, lse = self.fn()(jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32),
                         jnp.asarray(idx), sm_scale=0.3, d_v=d_v)
    ref_out, ref_lse = numpy_sparse_mqa(q, kv, idx, 0.3, d_v)
    chex.assert_shape((out, lse), ((t, h, d_v), (t, h)))
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert np.isposinf(np.asarray(lse[0])).all()
    if t > 1:
      assert relative_error(out[1:], ref_out[1:]) < 1e-5
      np.testing.assert_allclose(lse[1:], ref_lse[1:], rtol=1e-5)

  def test_all_minus_one_gives_zero_attention(self):
    """Why routing matters: a buffer the indexer never filled silently attends to nothing."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((6, 4, 80)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((10, 80)), jnp.float32)
    common.assert_no_attention(
        self.fn()(q, kv, jnp.full((6, 16), -1, jnp.int32), sm_scale=0.1, d_v=64), (6, 4, 64))

  def test_is_invariant_to_index_order(self):
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((3, 2, 80)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((50, 80)), jnp.float32)
    idx = jnp.asarray(rng.permutation(50)[:20].reshape(1, 20).repeat(3, 0), jnp.int32)
    fn = functools.partial(self.fn(), sm_scale=0.2, d_v=64)
    np.testing.assert_allclose(fn(q, kv, idx)[0], fn(q, kv, idx[:, ::-1])[0], rtol=1e-5,
                               atol=1e-6)

  # ---- fp8 rows (the 656-byte cache layout): gathered, then dequantized --------------------

  @parameterized.named_parameters(*FP8_CASES)
  def test_fp8_matches_float64_of_dequantized_rows_and_reference(self, T, H, K, S, A, R, dtype,
                                                                 pattern="random"):
    q, rows, topk = make_fp8_inputs(T + K + A, T, H, K, S, A, R, dtype, pattern)
    sm_scale = (A + R) ** -0.5
    out, lse = self.fn()(q, rows, topk, sm_scale=sm_scale, d_v=A)
    chex.assert_shape(out, (T, H, A))
    chex.assert_type(out, dtype)
    truth = numpy_sparse_mqa(q, numpy_dequantize_rows(rows), topk, sm_scale, A)
    assert_attention_matches(out, lse, *truth, rtol=FP8_RTOL[dtype], lse_rtol=LSE_ATOL[dtype],
                             lse_atol=LSE_ATOL[dtype])
    print(f"{self._testMethodName}: {self.IMPLEMENTATION} vs float64 of the dequantized rows, "
          f"relative error "
          f"{np.linalg.norm(np.asarray(out, np.float64) - truth[0]) / np.linalg.norm(truth[0]):.2e}")
    ref_out, ref_lse = self.reference()(q, rows, topk, sm_scale=sm_scale, d_v=A)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    chex.assert_trees_all_close((out.astype(jnp.float32), lse),
                                (ref_out.astype(jnp.float32), ref_lse), rtol=tol, atol=tol)

  def test_fp8_equals_reading_the_dequantized_rows(self):
    """Dequantized values are exact in float32, so reading fp8 rows is reading their
    dequantized float32 copy (to accumulation order)."""
    q, rows, topk = make_fp8_inputs(3, 3, 20, 50, 100, 64, 16, jnp.float32)
    fn = functools.partial(self.fn(SparseMQAKernelConfig(block_h=16, block_k=16)), sm_scale=0.1,
                           d_v=64)
    chex.assert_trees_all_close(fn(q, rows, topk), fn(q, dequantize_rows(rows, jnp.float32), topk),
                                rtol=1e-6, atol=1e-6)

  def test_fp8_backend_batched_matches_reference(self):
    batch = [make_fp8_inputs(b, 3, 4, 7, 50, 64, 16, jnp.float32) for b in range(2)]
    q, rows, topk = jax.tree.map(lambda *xs: jnp.stack(xs), *batch)
    got = self.backend().sparse_mqa(q, rows, topk, sm_scale=0.1, d_v=64)
    reference = jax.jit(jax.vmap(functools.partial(self.REFERENCE, sm_scale=0.1, d_v=64)))
    want = reference(q, rows, topk)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)

  # ---- NaN and inf in rows a query may not see never reach it ------------------------------

  @parameterized.named_parameters(common.named_product(
      case={c: c for c in MASKING_CASES}, poison=common.POISONS))
  def test_hidden_rows_stay_hidden(self, case, poison):
    which, rows, affected_tokens = MASKING_CASES[case]
    fn = self.jitted(MASKING_CONFIG, sm_scale=0.11, d_v=64)
    q, kv = masking_inputs()
    bad = {"q": q.copy(), "kv": kv.copy()}
    bad[which][rows] = poison
    topk = jnp.asarray(MASKING_TOPK)
    got = [np.asarray(x) for x in fn(jnp.asarray(bad["q"]), jnp.asarray(bad["kv"]), topk)]
    clean = fn(jnp.asarray(q), jnp.asarray(kv), topk)
    affected = np.isin(np.arange(4), affected_tokens)
    common.assert_only_affected_change(got, clean, affected)
    with np.errstate(invalid="ignore"):
      truth = numpy_sparse_mqa(bad["q"], bad["kv"], MASKING_TOPK, 0.11, 64)
    keep = ~affected
    assert_attention_matches(got[0][keep], got[1][keep], truth[0][keep], truth[1][keep],
                             rtol=1e-5, lse_rtol=1e-5, lse_atol=1e-5)

  @parameterized.named_parameters(common.named_product(
      case={c: c for c in MASKING_CASES if MASKING_CASES[c][0] == "kv"},
      part={p: p for p in FP8_PARTS}, poison=common.POISONS))
  def test_fp8_hidden_rows_stay_hidden(self, case, part, poison):
    _, rows, affected_tokens = MASKING_CASES[case]
    fn = self.jitted(MASKING_CONFIG, sm_scale=0.11, d_v=64)
    q, kv = masking_inputs()
    clean_rows = fp8_cache.quantize_latent(jnp.asarray(kv), 64)
    parts = [np.asarray(p).copy() for p in clean_rows]
    target = FP8_PARTS["scales"] if part == "values" and np.isinf(poison) else FP8_PARTS[part]
    parts[target][rows] = poison
    bad_rows = Fp8LatentRows(*(jnp.asarray(p) for p in parts))
    topk = jnp.asarray(MASKING_TOPK)
    got = [np.asarray(x) for x in fn(jnp.asarray(q), bad_rows, topk)]
    clean = fn(jnp.asarray(q), clean_rows, topk)
    affected = np.isin(np.arange(4), affected_tokens)
    common.assert_only_affected_change(got, clean, affected)
    truth = numpy_sparse_mqa(q, numpy_dequantize_rows(clean_rows), MASKING_TOPK, 0.11, 64)
    keep = ~affected
    assert_attention_matches(got[0][keep], got[1][keep], truth[0][keep], truth[1][keep],
                             rtol=1e-5, lse_rtol=1e-5, lse_atol=1e-5)

  # ---- bad inputs: refused as the reference refuses them, naming the argument --------------

  @parameterized.named_parameters(common.bad_input_cases(VALID, BAD_INPUTS) +
                                  common.bad_input_cases(VALID_FP8, BAD_FP8_INPUTS, "fp8_"))
  def test_refuses_bad_input(self, args, error, argument):
    self.assert_refused_like_the_reference(args, error, argument)

  @parameterized.named_parameters(("float_rows", VALID), ("fp8_rows", VALID_FP8))
  def test_valid_arguments_pass(self, valid):
    self.assert_accepted(valid)

  # ---- degenerate sizes: no kernel runs, every row sees nothing ----------------------------

  @parameterized.named_parameters(*DEGENERATE)
  def test_degenerate_sizes(self, T, S, K):
    q, kv = jnp.ones((T, 4, 80), F32), jnp.ones((S, 80), F32)
    topk = jnp.zeros((T, K), I32)  # index 0 is out of range when S = 0
    common.assert_no_attention(self.fn()(q, kv, topk, sm_scale=0.1, d_v=64), (T, 4, 64))

  @parameterized.named_parameters(*DEGENERATE)
  def test_fp8_degenerate_sizes(self, T, S, K):
    rows = Fp8LatentRows(jnp.ones((S, 64), FP8), jnp.ones((S, 1), F32), jnp.ones((S, 16), BF16))
    topk = jnp.zeros((T, K), I32)
    common.assert_no_attention(self.fn()(jnp.ones((T, 4, 80), F32), rows, topk, sm_scale=0.1,
                                         d_v=64), (T, 4, 64))

  def test_no_topk_slots_batched_and_default_config(self):
    self.assertGreaterEqual(SparseMQAKernelConfig.default_for(4, 0, 64).block_k, 16)  # no /0
    q, kv, topk = jnp.ones((2, 3, 4, 80), F32), jnp.ones((2, 50, 80), F32), jnp.zeros((2, 3, 0), I32)
    out, lse = self.backend().sparse_mqa(q, kv, topk, sm_scale=0.1, d_v=64)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.isposinf(np.asarray(lse)).all()


class SparseMQAKernelTestBase(SparseMQATestBase):
  """The suite, and what only the kernel has: a block config, which it refuses if it belongs to another op."""

  @parameterized.named_parameters(("float_rows", VALID), ("fp8_rows", VALID_FP8))
  def test_refuses_a_foreign_config(self, valid):
    self.assert_kernel_refuses_config(valid, DenseMHAKernelConfig())
