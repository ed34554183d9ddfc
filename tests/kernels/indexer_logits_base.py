"""The indexer logits suite, run over every implementation (``test_indexer_logits.py``).

Against a float64 NumPy computation and the jnp reference (bf16, fp32, and fp8 keys with
per-key scales), keys outside a query's window poisoned with NaN/inf, bad inputs and
degenerate sizes.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.testing import relative_error
from pallas_kernels.block_config import IndexerLogitsKernelConfig, SparseMQAKernelConfig
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference
from tests.kernels import common
from tests.kernels.numpy_reference import numpy_indexer_logits

sds = jax.ShapeDtypeStruct
F32, BF16, F16, I32, FP8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.float8_e4m3fn
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, FP8: 1e-5}  # fp8 vs the dequantized float64 result


def make_inputs(seed, T, G, I, S, dtype, window="causal"):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((T, G, I)), dtype)
  k = jnp.asarray(rng.standard_normal((S, I)), dtype)
  w = jnp.asarray(rng.standard_normal((T, G)), jnp.float32)
  if window == "causal":  # the prefill pattern: each row sees keys [0, S - T + t + 1)
    starts = np.zeros(T)
    ends = np.clip(S - T + 1 + np.arange(T), 0, S)
  else:  # random windows, some empty, some past S
    starts = rng.integers(0, S, T)
    ends = starts + rng.integers(0, S, T)
  k_scale = jnp.asarray(rng.uniform(0.5, 2.0, S), jnp.float32) if dtype == FP8 else None
  return q, k, w, jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32), k_scale


CASES = (
    dict(testcase_name="t1_s1", T=1, G=4, S=1),
    dict(testcase_name="t3_s100_random_windows", T=3, G=4, S=100, window="random"),
    dict(testcase_name="t64_s1000", T=64, G=16, S=1000),
    dict(testcase_name="t257_s1000_random_windows", T=257, G=4, S=1000, window="random"),
)

# ---- hidden keys: T 5, S 40, windows inside [0, 20); tiles of 16 ---------------------------
# Tile columns 32-47 lie past every window (skipped); 16-31 straddle the last window's end.

MASKING_CONFIG = IndexerLogitsKernelConfig(block_t=16, block_s=16)
STARTS = np.array([0, 3, 5, 0, 10], np.int32)
ENDS = np.array([4, 9, 5, 12, 20], np.int32)
MASKING_CASES = {
    # name: (poisoned array, rows, query rows whose in-window logits may change)
    "keys_outside_every_window": ("k", list(range(20, 40)), []),
    "key_scales_outside_every_window": ("scale", list(range(20, 40)), []),
    "key_inside_some_windows": ("k", [2], [0, 3]),       # rows 1, 2, 4 do not see key 2
    "own_query_row": ("q", [1], [1]),
    "own_weight_row": ("w", [4], [4]),
}


def masking_inputs(seed=2):
  rng = np.random.default_rng(seed)
  return dict(q=rng.standard_normal((5, 4, 32)).astype(np.float32),
              k=rng.standard_normal((40, 32)).astype(np.float32),
              w=rng.standard_normal((5, 4)).astype(np.float32),
              scale=rng.uniform(0.5, 2.0, 40).astype(np.float32))


# ---- bad inputs: (case, changed arguments, error, the argument the message must name) ------

VALID = dict(q=sds((3, 4, 32), F32), k=sds((50, 32), F32), w=sds((3, 4), F32),
             starts=sds((3,), I32), ends=sds((3,), I32), k_scale_S=None)
BAD_INPUTS = [
    ("q_rank", dict(q=sds((3, 128), F32)), ValueError, "q_TGI"),
    ("no_heads", dict(q=sds((3, 0, 32), F32), w=sds((3, 0), F32)), ValueError, "q_TGI"),
    ("k_width", dict(k=sds((50, 64), F32)), ValueError, "k_SI"),
    ("w_shape", dict(w=sds((3, 5), F32)), ValueError, "w_TG"),
    ("starts_int16", dict(starts=sds((3,), jnp.int16)), TypeError, "starts_T"),
    ("ends_length", dict(ends=sds((4,), I32)), ValueError, "ends_T"),
    ("mixed_dtypes", dict(k=sds((50, 32), BF16)), TypeError, "k_SI"),
    ("fp16_q", dict(q=sds((3, 4, 32), F16), k=sds((50, 32), F16)), TypeError, "q_TGI"),
    ("int_w", dict(w=sds((3, 4), I32)), TypeError, "w_TG"),
    ("k_scale_length", dict(k_scale_S=sds((49,), F32)), ValueError, "k_scale_S"),
    ("k_scale_int", dict(k_scale_S=sds((50,), I32)), TypeError, "k_scale_S"),
]


class IndexerLogitsTestBase(common.KernelTestBase):

  KERNEL = staticmethod(indexer_logits)
  REFERENCE = staticmethod(indexer_logits_reference)
  POSITIONAL = ("q", "k", "w", "starts", "ends")

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{jnp.dtype(dt).name}", dtype=dt)
      for c in CASES for dt in (jnp.float32, jnp.bfloat16, FP8)
      if dt == jnp.float32 or c["testcase_name"] in ("t3_s100_random_windows", "t64_s1000")
  )
  def test_matches_float64_and_reference(self, T, G, S, dtype, window="causal"):
    I = 32
    q, k, w, starts, ends, k_scale = make_inputs(T + S, T, G, I, S, dtype, window)
    got = self.fn()(q, k, w, starts, ends, k_scale_S=k_scale)
    chex.assert_shape(got, (T, S))
    chex.assert_type(got, jnp.float32)
    got = np.asarray(got, np.float64)
    want = numpy_indexer_logits(q, k, w, starts, ends, k_scale)
    self.assertFalse(np.isnan(got).any())  # NaN-poisoned output: every tile was written
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    inside = np.isfinite(want)
    if inside.any():
      err = np.linalg.norm(got[inside] - want[inside]) / np.linalg.norm(want[inside])
      self.assertLess(err, RTOL[dtype])
    ref = self.reference()(q, k, w, starts, ends, k_scale_S=k_scale)
    np.testing.assert_allclose(got, np.asarray(ref, np.float64), rtol=2e-2, atol=2e-2)

  @parameterized.named_parameters(("float32", jnp.float32, 1e-5), ("bfloat16", jnp.bfloat16, 2e-2))
  def test_matches_loop_on_ragged_windows(self, dtype, tol):
    rng = np.random.default_rng(5)
    t, g, i, s = 7, 4, 32, 23
    q, k, w = rng.standard_normal((t, g, i)), rng.standard_normal((s, i)), rng.standard_normal((t, g))
    starts = np.array([0, 0, 3, 5, 0, 10, 22], np.int32)
    ends = np.array([1, 5, 9, 5, 23, 12, 23], np.int32)
    out = self.fn()(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(w, jnp.float32),
                    jnp.asarray(starts), jnp.asarray(ends))
    ref = numpy_indexer_logits(q, k, w, starts, ends, None)
    out = np.asarray(out, np.float64)
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    finite = np.isfinite(ref)
    assert relative_error(out[finite], ref[finite]) < tol

  def test_applies_fp8_key_scales(self):
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float8_e4m3fn)
    k = jnp.asarray(rng.standard_normal((5, 16)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 5), jnp.float32)
    starts, ends = jnp.zeros(3, jnp.int32), jnp.full(3, 5, jnp.int32)
    plain = self.fn()(q, k, w, starts, ends)
    scaled = self.fn()(q, k, w, starts, ends, k_scale_S=scale)
    np.testing.assert_allclose(scaled, plain * scale[None, :], rtol=1e-6)

  def test_backend_batched_matches_reference(self):
    args = [make_inputs(b, 5, 4, 32, 40, jnp.bfloat16, "random")[:5] for b in range(2)]
    batched = [jnp.stack(xs) for xs in zip(*args)]
    got = self.backend().indexer_logits(*batched)
    chex.assert_trees_all_close(got, jax.jit(jax.vmap(self.REFERENCE))(*batched), rtol=1e-5,
                                atol=1e-5)

  # ---- NaN and inf in keys outside a query's window never reach it -------------------------

  @parameterized.named_parameters(common.named_product(
      case={c: c for c in MASKING_CASES}, poison=common.POISONS))
  def test_keys_outside_a_window_stay_hidden(self, case, poison):
    which, rows, affected_rows = MASKING_CASES[case]
    fn = self.jitted(MASKING_CONFIG)
    clean_in = masking_inputs()
    bad_in = {name: x.copy() for name, x in clean_in.items()}
    bad_in[which][rows] = poison

    def call(x):
      return fn(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["w"]), jnp.asarray(STARTS),
                jnp.asarray(ENDS), k_scale_S=jnp.asarray(x["scale"]))

    got, clean = np.asarray(call(bad_in), np.float64), np.asarray(call(clean_in), np.float64)
    cols = np.arange(40)
    inside = (cols[None, :] >= STARTS[:, None]) & (cols[None, :] < ENDS[:, None])
    np.testing.assert_array_equal(np.isneginf(got), ~inside)  # outside: exactly -inf
    # A poisoned key row or scale touches its own column; a q or w row its own row.
    touched = np.zeros_like(inside)
    if which in ("k", "scale"):
      touched[np.ix_(affected_rows, rows)] = True
    else:
      touched[affected_rows] = True
    touched &= inside
    np.testing.assert_array_equal(got[~touched], clean[~touched])
    truth = numpy_indexer_logits(clean_in["q"], clean_in["k"], clean_in["w"], STARTS, ENDS,
                                 clean_in["scale"])
    kept = inside & ~touched
    np.testing.assert_allclose(got[kept], truth[kept], rtol=1e-5, atol=1e-5)

  # ---- bad inputs and degenerate sizes -----------------------------------------------------

  @parameterized.named_parameters(common.bad_input_cases(VALID, BAD_INPUTS))
  def test_refuses_bad_input(self, args, error, argument):
    self.assert_refused_like_the_reference(args, error, argument)

  def test_valid_arguments_pass(self):
    self.assert_accepted(VALID)

  @parameterized.named_parameters(("no_keys", 3, 0), ("no_tokens", 0, 20))
  def test_degenerate_sizes(self, T, S):
    args = (jnp.ones((T, 4, 32), F32), jnp.ones((S, 32), F32), jnp.ones((T, 4), F32),
            jnp.zeros((T,), I32), jnp.full((T,), S, I32))
    logits = self.fn()(*args)
    assert logits.shape == (T, S) and logits.dtype == F32


class IndexerLogitsKernelTestBase(IndexerLogitsTestBase):
  """The suite, and what only the kernel has: a block config, refused if another op's."""

  def test_refuses_a_foreign_config(self):
    self.assert_kernel_refuses_config(VALID, SparseMQAKernelConfig())
