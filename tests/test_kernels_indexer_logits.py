"""Indexer logits kernel (interpret mode) vs a float64 NumPy computation and the jnp reference."""


import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.backends.pallas import PallasTritonBackend
from mla_jax.backends.xla import XlaBackend
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference
from tests.numpy_kernels import numpy_indexer_logits

FP8 = jnp.float8_e4m3fn
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


class IndexerLogitsKernelTest(chex.TestCase):

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{jnp.dtype(dt).name}", dtype=dt)
      for c in CASES for dt in (jnp.float32, jnp.bfloat16, FP8)
      if dt == jnp.float32 or c["testcase_name"] in ("t3_s100_random_windows", "t64_s1000")
  )
  def test_matches_float64_and_reference(self, T, G, S, dtype, window="causal"):
    I = 32
    q, k, w, starts, ends, k_scale = make_inputs(T + S, T, G, I, S, dtype, window)
    got = indexer_logits(q, k, w, starts, ends, k_scale_S=k_scale, interpret=True)
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
    ref = indexer_logits_reference(q, k, w, starts, ends, k_scale_S=k_scale)
    np.testing.assert_allclose(got, np.asarray(ref, np.float64), rtol=2e-2, atol=2e-2)

  def test_backend_batched_matches_xla(self):
    args = [make_inputs(b, 5, 4, 32, 40, jnp.bfloat16, "random")[:5] for b in range(2)]
    batched = [jnp.stack(xs) for xs in zip(*args)]
    got = PallasTritonBackend(interpret=True).indexer_logits(*batched)
    want = XlaBackend().indexer_logits(*batched)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
