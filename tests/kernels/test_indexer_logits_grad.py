"""Gradients of the indexer logits: the Pallas-Triton backward (interpret mode) and the jnp
reference (the XLA backend's training path), against ``jax.grad`` of a float64 formula.

The cotangent is NaN wherever the logits are -inf, so a backward that multiplies by the mask
instead of replacing fails. Keys that no window scores hold NaN/inf in some cases: their
gradients must be exactly 0 and every other gradient what it is without them.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.fp8_cache import quantize_indexer_queries, quantize_keys
from mla_jax.testing import relative_error
from pallas_kernels.block_config import IndexerLogitsKernelConfig
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference
from pallas_kernels.indexer_logits_backward import (indexer_logits_dk, indexer_logits_dq,
                                                    sum_into_rows)
from tests.kernels import common

F32, BF16, I32, FP8 = jnp.float32, jnp.bfloat16, jnp.int32, jnp.float8_e4m3fn
RTOL = {F32: 1e-5, BF16: 2e-2}
FP8_DQ_RTOL = 7e-2  # dq is stored in fp8 (3 mantissa bits), rounded once from fp32
IMPLEMENTATIONS = {
    "pallas_triton": indexer_logits,  # skipped without a CUDA GPU
    "pallas_interpret": functools.partial(indexer_logits, interpret=True),
    "reference": indexer_logits_reference,
}
SMALL_BLOCKS = IndexerLogitsKernelConfig(block_t=16, block_s=16)


def windows(T, S):
  """Ragged windows: empty ones (start = end, start > end, past S), and keys [S - 8, S) that no
  window reaches."""
  rng = np.random.default_rng(T * S)
  starts = rng.integers(0, S // 2, T)
  ends = np.minimum(starts + rng.integers(1, S // 2, T), S - 8)
  starts[:3], ends[:3] = (4, 9, S + 2), (4, 2, S + 5)
  return jnp.asarray(starts, I32), jnp.asarray(ends, I32)


def inputs(seed, T, G, I, S, dtype, num_keys=None):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((T, G, I)), dtype)
  k = jnp.asarray(rng.standard_normal((num_keys or S, I)), dtype)
  w = jnp.asarray(rng.standard_normal((T, G)), F32)
  starts, ends = windows(T, S)
  ct = rng.standard_normal((T, S)).astype(np.float32)
  return q, k, w, starts, ends, ct


def scored(starts, ends, S):
  cols = np.arange(S)
  return (cols[None, :] >= np.asarray(starts)[:, None]) & (cols[None, :] < np.asarray(ends)[:, None])


def poisoned_cotangent(ct, logits):
  """The cotangent, NaN where the logits are -inf (what a careless consumer might send)."""
  return jnp.where(jnp.isneginf(logits), jnp.nan, ct)


def float64_grads(q, k, w, starts, ends, ct, scale=None, key_rows=None):
  """``(dq, dk, dw)`` of ``sum(logits * ct)`` over the scored pairs, in float64."""
  with jax.enable_x64(True):
    f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))

    def loss(q, k, w):
      has_key = jnp.ones(ct.shape[1], bool)
      if key_rows is not None:
        rows = jnp.asarray(key_rows)
        has_key = (rows >= 0) & (rows < k.shape[0])
        k = k[jnp.where(has_key, rows, 0)]
      dots = jnp.einsum("tgi,si->tgs", q, k)
      logits = jnp.einsum("tg,tgs->ts", w, jax.nn.relu(dots))
      if scale is not None:
        logits = logits * f64(scale)[None, :]
      inside = jnp.asarray(scored(starts, ends, ct.shape[1])) & has_key[None, :]
      return jnp.sum(jnp.where(inside, logits * f64(ct), 0.0))

    return tuple(np.asarray(g) for g in jax.grad(loss, (0, 1, 2))(f64(q), f64(k), f64(w)))


def vjp(fn, q, k, w, starts, ends, ct, **kwargs):
  """``(dq, dk, dw)`` of ``fn`` at the cotangent ``ct`` (NaN where the logits are -inf)."""
  logits, pullback = jax.vjp(lambda q, k, w: fn(q, k, w, starts, ends, **kwargs), q, k, w)
  return pullback(poisoned_cotangent(ct, logits))


class IndexerLogitsGradTest(chex.TestCase):

  def fn(self, impl):
    if impl == "pallas_triton" and not common.cuda_gpu_ready():
      self.skipTest("the Pallas-Triton kernel needs a CUDA GPU (sm80+)")
    return jax.jit(IMPLEMENTATIONS[impl])

  @parameterized.named_parameters(common.named_product(
      impl={name: name for name in IMPLEMENTATIONS},
      dtype={"float32": F32, "bfloat16": BF16}))
  def test_matches_float64(self, impl, dtype):
    T, G, I, S = 37, 4, 32, 70
    q, k, w, starts, ends, ct = inputs(0, T, G, I, S, dtype)
    got = vjp(self.fn(impl), q, k, w, starts, ends, ct)
    want = float64_grads(q, k, w, starts, ends, ct)
    for name, g, x, ref in zip(("dq", "dk", "dw"), got, (q, k, w), want):
      chex.assert_type(g, x.dtype)
      self.assertTrue(np.isfinite(np.asarray(g, np.float64)).all(), name)
      self.assertLess(relative_error(g, ref), RTOL[dtype], name)
    np.testing.assert_array_equal(np.asarray(got[1], np.float64)[S - 8:], 0.0)  # unscored keys

  @parameterized.named_parameters((name, name) for name in IMPLEMENTATIONS)
  def test_relu_has_zero_gradient_at_exactly_zero(self, impl):
    """Queries and keys of -1, 0, 1 make many dots exactly 0, where relu' is 0 (as
    ``jax.nn.relu``): random normal data never hits 0, so a backward taking relu' as 1 there
    passed every other case."""
    T, G, I, S = 37, 4, 32, 70
    rng = np.random.default_rng(3)
    _, _, w, starts, ends, ct = inputs(0, T, G, I, S, F32)
    q = jnp.asarray(rng.integers(-1, 2, (T, G, I)), F32)
    k = jnp.asarray(rng.integers(-1, 2, (S, I)), F32)
    dots = np.einsum("tgi,si->tgs", np.asarray(q), np.asarray(k))
    self.assertGreater((dots == 0).mean(), 0.05)
    got = vjp(self.fn(impl), q, k, w, starts, ends, ct)
    want = float64_grads(q, k, w, starts, ends, ct)
    for name, g, ref in zip(("dq", "dk", "dw"), got, want):
      self.assertLess(relative_error(g, ref), RTOL[F32], name)

  @parameterized.named_parameters(("float32", F32), ("bfloat16", BF16))
  def test_kernels_over_many_blocks(self, dtype):
    """16 x 16 blocks: several token and key blocks, some pairs of them never meeting."""
    T, G, I, S = 37, 2, 32, 90
    q, k, w, starts, ends, ct = inputs(1, T, G, I, S, dtype)
    ct = jnp.asarray(ct)
    args = (ct, q, k, w, starts, ends)
    dq, dw = indexer_logits_dq(*args, config=SMALL_BLOCKS, interpret=True)
    dk = indexer_logits_dk(*args, config=SMALL_BLOCKS, interpret=True)
    want_dq, want_dk, want_dw = float64_grads(q, k, w, starts, ends, ct)
    self.assertLess(relative_error(dq, want_dq), RTOL[dtype])
    self.assertLess(relative_error(dk, want_dk), RTOL[dtype])
    self.assertLess(relative_error(dw, want_dw), RTOL[dtype])

  @parameterized.named_parameters(common.named_product(
      impl={name: name for name in IMPLEMENTATIONS}, poison=common.POISONS))
  def test_unscored_keys_get_no_gradient(self, impl, poison):
    T, G, I, S = 9, 4, 32, 40
    q, k, w, starts, ends, ct = inputs(2, T, G, I, S, F32)
    scale = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2.0, S), F32)
    fn = self.fn(impl)
    clean = vjp(fn, q, k, w, starts, ends, ct, k_scale_S=scale)
    unscored = ~scored(starts, ends, S).any(axis=0)
    self.assertTrue(unscored[:S - 8].any() and unscored[S - 8:].all())
    got = vjp(fn, q, k.at[unscored].set(poison), w, starts, ends, ct,
              k_scale_S=scale.at[unscored].set(poison))
    for g, c in zip(got, clean):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(got[1])[unscored], 0.0)

  @parameterized.named_parameters(*((name, name) for name in IMPLEMENTATIONS))
  def test_fp8_keys_and_scales_are_constants(self, impl):
    T, G, I, S = 9, 4, 32, 40
    q, k, w, starts, ends, ct = inputs(4, T, G, I, S, F32)
    q8, w8 = quantize_indexer_queries(q, w)
    k8, scale = quantize_keys(k)
    fn = self.fn(impl)
    logits, pullback = jax.vjp(lambda q, k, w, sc: fn(q, k, w, starts, ends, k_scale_S=sc),
                               q8, k8, w8, scale)
    dq, dk, dw, dscale = pullback(poisoned_cotangent(ct, logits))
    want_dq, _, want_dw = float64_grads(q8, k8, w8, starts, ends, ct, scale=scale)
    chex.assert_type([dq, dk, dw, dscale], [FP8, FP8, F32, F32])
    self.assertLess(relative_error(dq, want_dq), FP8_DQ_RTOL)
    self.assertLess(relative_error(dw, want_dw), RTOL[F32])
    np.testing.assert_array_equal(np.asarray(dk, np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(dscale), 0.0)

  @parameterized.named_parameters(common.named_product(
      impl={name: name for name in IMPLEMENTATIONS}, dtype={"float32": F32, "bfloat16": BF16}))
  def test_pool_rows_accumulate(self, impl, dtype):
    """Pool mode: repeated row ids add up; -1 columns and unnamed pool rows (NaN there
    included) contribute and get nothing."""
    T, G, I, S, P = 9, 4, 32, 40, 64
    q, pool, w, starts, ends, ct = inputs(5, T, G, I, S, dtype, num_keys=P)
    rng = np.random.default_rng(6)
    rows = rng.integers(1, P, S)
    rows[[3, 7, 11]] = rows[2]  # one row named four times
    rows[[5, 20]] = -1
    rows = jnp.asarray(rows, I32)
    got = vjp(self.fn(impl), q, pool, w, starts, ends, ct, key_rows_S=rows)
    want = float64_grads(q, pool, w, starts, ends, ct, key_rows=rows)
    for name, g, ref in zip(("dq", "dpool", "dw"), got, want):
      self.assertLess(relative_error(g, ref), RTOL[dtype], name)
    unnamed = np.setdiff1d(np.arange(P), np.asarray(rows))
    self.assertIn(0, unnamed)  # the row -1 columns read
    np.testing.assert_array_equal(np.asarray(got[1], np.float32)[unnamed], 0.0)
    poisoned = vjp(self.fn(impl), q, pool.at[unnamed].set(np.nan), w, starts, ends, ct,
                   key_rows_S=rows)
    for g, c in zip(poisoned, got):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(c, np.float32))

  def test_sum_into_rows(self):
    rng = np.random.default_rng(7)
    d = rng.standard_normal((50, 8)).astype(np.float32)
    rows = rng.integers(-3, 20, 50).astype(np.int32)  # repeats, and ids outside the pool
    want = np.zeros((16, 8), np.float64)
    keep = (rows >= 0) & (rows < 16)
    np.add.at(want, rows[keep], d[keep])
    got = np.asarray(jax.jit(sum_into_rows, static_argnums=2)(d, rows, 16))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

  def test_vmapped_grads_match_per_sequence(self):
    """The backend's call: vmapped over a batch, the pool (and its gradient) shared."""
    T, G, I, S, P, B = 9, 4, 32, 40, 64, 2
    fn = functools.partial(indexer_logits, interpret=True)
    seqs = [inputs(8 + b, T, G, I, S, F32, num_keys=P) for b in range(B)]
    q, _, w, starts, ends, ct = (jnp.stack(xs) for xs in zip(*seqs))
    pool = seqs[0][1]
    rows = jnp.asarray(np.random.default_rng(9).integers(0, P, (B, S)), I32)
    batched = jax.vmap(lambda q, p, w, s, e, r: fn(q, p, w, s, e, key_rows_S=r),
                       in_axes=(0, None, 0, 0, 0, 0))
    loss = lambda f: lambda q, p, w, *rest, ct: jnp.sum(jnp.where(
        jnp.isfinite(out := f(q, p, w, *rest)), out * ct, 0.0))
    got = jax.jit(jax.grad(loss(batched), (0, 1, 2)))(q, pool, w, starts, ends, rows, ct=ct)
    per_seq = jax.jit(jax.grad(loss(lambda *a: fn(*a[:5], key_rows_S=a[5])), (0, 1, 2)))
    want = [per_seq(q[b], pool, w[b], starts[b], ends[b], rows[b], ct=ct[b]) for b in range(B)]
    np.testing.assert_allclose(got[0], jnp.stack([g[0] for g in want]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], sum(g[1] for g in want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[2], jnp.stack([g[2] for g in want]), rtol=1e-6, atol=1e-6)

  def test_empty_inputs_have_zero_grads(self):
    q, k, w = jnp.ones((3, 4, 32), F32), jnp.ones((0, 32), F32), jnp.ones((3, 4), F32)
    starts, ends = jnp.zeros((3,), I32), jnp.full((3,), 5, I32)
    dq, dw = jax.grad(lambda q, w: indexer_logits(q, k, w, starts, ends, interpret=True).sum(),
                      (0, 1))(q, w)
    np.testing.assert_array_equal(np.asarray(dq), 0.0)
    np.testing.assert_array_equal(np.asarray(dw), 0.0)

  def test_dsv32_widths(self):
    """DeepSeek-V3.2's indexer: 64 heads of 128, bf16, a short causal context."""
    T, G, I, S = 16, 64, 128, 64
    q, k, w, _, _, ct = inputs(10, T, G, I, S, BF16)
    starts, ends = jnp.zeros((T,), I32), jnp.asarray(S - T + 1 + np.arange(T), I32)
    got = vjp(self.fn("pallas_interpret"), q, k, w, starts, ends, ct)
    want = float64_grads(q, k, w, starts, ends, ct)
    for name, g, ref in zip(("dq", "dk", "dw"), got, want):
      self.assertLess(relative_error(g, ref), RTOL[BF16], name)
