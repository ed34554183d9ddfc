"""The dense MHA gradient suite (``test_dense_mha_grad.py``): gradients of the causal and masked
routes against ``jax.grad`` of a float64 computation.

Run over the jnp reference (the XLA backend's training path, plain autodiff) and the Pallas
kernel's ``custom_vjp`` (its backward kernels; interpret mode on CPU). The loss reads out and
LSE both, so the LSE cotangent is checked too. Keys and values that no query sees (past
kv_len, unselected) are poisoned with NaN/inf: every gradient stays finite and theirs is 0.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.testing import relative_error
from pallas_kernels.block_config import DenseMHAKernelConfig
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference
from pallas_kernels.dense_mha_backward import dense_mha_backward
from tests.kernels import common
from tests.kernels.dense_mha_base import random_topk

F32, BF16 = jnp.float32, jnp.bfloat16
RTOL = {F32: 1e-5, BF16: 2e-2}
SM_SCALE = 0.2


def numpy_visible(T, S, q_offset, kv_len, topk=None):
  rows, cols = q_offset + np.arange(T)[:, None], np.arange(S)[None, :]
  visible = (cols <= rows) & (cols < kv_len)
  if topk is not None:
    visible &= np.stack([np.isin(np.arange(S), np.asarray(row)) for row in topk])
  return visible


def float64_grads(q, k, v, visible_TS, g_out, g_lse, sm_scale=SM_SCALE):
  """``jax.grad`` of ``loss`` in float64 for the pairs ``visible_TS`` (rows with none: out 0)."""
  with jax.enable_x64(True):
    q, k, v, g_out, g_lse = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, g_out, g_lse))
    visible = jnp.asarray(visible_TS)[None]
    seen = visible.any(-1, keepdims=True)

    def attention(q, k, v):
      s = jnp.where(visible, jnp.einsum("thd,shd->hts", q, k) * sm_scale, -jnp.inf)
      lse = jax.nn.logsumexp(jnp.where(seen, s, 0.0), axis=-1, keepdims=True)
      out = jnp.einsum("hts,shv->thv", jnp.exp(s - lse), v)
      return out, jnp.where(seen, lse, jnp.inf)[..., 0].T

    return [np.asarray(g) for g in jax.grad(
        lambda *a: loss(attention, g_out, g_lse, *a), argnums=(0, 1, 2))(q, k, v)]


def loss(fn, g_out, g_lse, q, k, v):
  out, lse = fn(q, k, v)
  return (out.astype(g_out.dtype) * g_out).sum() + jnp.where(jnp.isfinite(lse), lse * g_lse, 0).sum()


def make_inputs(seed, T, S, H, D, V, dtype):
  rng = np.random.default_rng(seed)
  shapes = ((T, H, D), (S, H, D), (S, H, V), (T, H, V), (T, H))
  q, k, v, g_out, g_lse = (rng.standard_normal(s).astype(np.float32) for s in shapes)
  q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(F32)) for x in (q, k, v))  # exact in dtype
  return q, k, v, g_out, g_lse


# (T, S, H, q_offset, kv_len); blocks of 32 in the backward, 64 in the forward by default.
CASES = {
    "prefill_t40": (40, 40, 2, 0, 40),
    "cached_prefix_s_gt_t": (20, 70, 2, 50, 70),
    "poison_past_kv_len": (20, 70, 2, 30, 60),
    "kv_len_past_s": (4, 10, 2, 20, 30),
    "no_kv": (5, 16, 2, 0, 0),
}
# (T, S, H, q_offset, kv_len, K)
MASKED_CASES = {
    "prefill_t40_k8": (40, 40, 2, 0, 40, 8),
    "cached_prefix_past_kv_len_k16": (24, 100, 2, 60, 90, 16),
}


class DenseMHAGradTestBase(common.KernelTestBase):

  KERNEL = staticmethod(dense_mha)
  REFERENCE = staticmethod(dense_mha_reference)
  STATIC_ARGNAMES = ("sm_scale",)
  POSITIONAL = ("q", "k", "v")

  def grads(self, q, k, v, g_out, g_lse, dtype, *, config=None, **kwargs):
    fn = self.REFERENCE if self.IMPLEMENTATION == common.REFERENCE else self.fn(config)
    fn = functools.partial(fn, sm_scale=SM_SCALE)
    grad = jax.jit(jax.grad(
        lambda q, k, v, kw: loss(functools.partial(fn, **kw), g_out, g_lse, q, k, v),
        argnums=(0, 1, 2)))
    return grad(*(jnp.asarray(x, dtype) for x in (q, k, v)), kwargs)

  def assert_grads_match(self, got, q, k, v, g_out, g_lse, visible, dtype, hidden_keys=()):
    want = float64_grads(q, k, v, visible, g_out, g_lse)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
      g = np.asarray(g.astype(F32), np.float64)
      assert np.isfinite(g).all(), f"{name} is not finite"
      if name != "dq":
        np.testing.assert_array_equal(g[np.asarray(hidden_keys, int)], 0.0)
      if np.linalg.norm(w) == 0:
        np.testing.assert_array_equal(g, 0.0)
      else:
        assert relative_error(g, w) < RTOL[dtype], (name, relative_error(g, w))

  @parameterized.named_parameters(common.named_product(
      case={c: c for c in CASES}, dtype={"f32": F32, "bf16": BF16}))
  def test_grads_match_float64(self, case, dtype):
    T, S, H, q_offset, kv_len = CASES[case]
    q, k, v, g_out, g_lse = make_inputs(T + S, T, S, H, 48, 32, dtype)
    hidden = np.arange(min(max(kv_len, 0), S), S)  # past kv_len: no query sees them
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[hidden], bad_v[hidden] = np.nan, np.inf
    got = self.grads(q, bad_k, bad_v, g_out, g_lse, dtype, q_offset=jnp.int32(q_offset),
                     kv_len=jnp.int32(kv_len))
    self.assert_grads_match(got, q, k, v, g_out, g_lse, numpy_visible(T, S, q_offset, kv_len),
                            dtype, hidden)

  @parameterized.named_parameters(common.named_product(
      case={c: c for c in MASKED_CASES}, dtype={"f32": F32, "bf16": BF16}))
  def test_masked_grads_match_float64(self, case, dtype):
    """-1 padded top-k rows, one row with no causal pick, one with none at all; every key
    no query selected is poisoned."""
    T, S, H, q_offset, kv_len, K = MASKED_CASES[case]
    q, k, v, g_out, g_lse = make_inputs(T + K, T, S, H, 48, 32, dtype)
    topk = np.array(random_topk(T + S, T, S, K, q_offset, empty_rows=(T - 1,)))
    topk[1] = -1
    topk[1, :2] = [q_offset + 1 + 2, S + 1]  # a future key and one past S: nothing causal
    visible = numpy_visible(T, S, q_offset, kv_len, topk)
    assert not visible[1].any() and not visible[T - 1].any() and visible.any()
    hidden = np.flatnonzero(~visible.any(axis=0))
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[hidden], bad_v[hidden] = np.inf, np.nan
    got = self.grads(q, bad_k, bad_v, g_out, g_lse, dtype, q_offset=jnp.int32(q_offset),
                     kv_len=jnp.int32(kv_len), topk_TK=jnp.asarray(topk))
    self.assert_grads_match(got, q, k, v, g_out, g_lse, visible, dtype, hidden)
    np.testing.assert_array_equal(np.asarray(got[0].astype(F32))[[1, T - 1]], 0.0)  # empty rows

  @parameterized.named_parameters(("causal", False), ("masked", True))
  def test_vmapped_grads(self, masked):
    """Per-sequence q_offset, kv_len (and top-k), vmapped over the batch as the backends do."""
    T, S, H, K = 9, 20, 2, 6
    inputs = [make_inputs(b, T, S, H, 48, 32, F32) for b in range(2)]
    offsets, lengths = (0, 11), (9, 18)
    topks = [np.asarray(random_topk(b, T, S, K, offsets[b])) for b in range(2)]
    fn = self.REFERENCE if self.IMPLEMENTATION == common.REFERENCE else self.fn()

    def batch_loss(q, k, v, g_out, g_lse, off, n, topk):
      per_sequence = lambda q, k, v, off, n, topk: fn(
          q, k, v, sm_scale=SM_SCALE, q_offset=off, kv_len=n, topk_TK=topk if masked else None)
      out, lse = jax.vmap(per_sequence)(q, k, v, off, n, topk)
      return (out * g_out).sum() + jnp.where(jnp.isfinite(lse), lse * g_lse, 0).sum()

    stacked = [jnp.asarray(np.stack(x)) for x in zip(*inputs)]
    got = jax.jit(jax.grad(batch_loss, argnums=(0, 1, 2)))(
        *stacked, jnp.asarray(offsets, jnp.int32), jnp.asarray(lengths, jnp.int32),
        jnp.asarray(np.stack(topks)))
    for b in range(2):
      visible = numpy_visible(T, S, offsets[b], lengths[b], topks[b] if masked else None)
      self.assert_grads_match([g[b] for g in got], *inputs[b], visible, F32)

  def test_deepseek_widths_bf16(self):
    """DeepSeek-V3.2's MHA form: qk 192 (128 nope + 64 rope), v 128; a short cached context."""
    T, S, H, q_offset = 40, 72, 2, 32
    q, k, v, g_out, g_lse = make_inputs(7, T, S, H, 192, 128, BF16)
    got = self.grads(q, k, v, g_out, g_lse, BF16, q_offset=jnp.int32(q_offset),
                     kv_len=jnp.int32(S))
    self.assert_grads_match(got, q, k, v, g_out, g_lse, numpy_visible(T, S, q_offset, S), BF16)


class DenseMHAGradKernelTestBase(DenseMHAGradTestBase):
  """The suite, and the backward kernels called directly with a block config of their own."""

  @parameterized.named_parameters(("causal", False), ("masked", True))
  def test_backward_kernels_with_small_blocks(self, masked):
    """Small backward tiles, tiled differently in the two kernels: many whole, diagonal and
    kv_len blocks per program."""
    T, S, H, q_offset, kv_len = 37, 70, 2, 25, 66
    q, k, v, g_out, g_lse = make_inputs(3, T, S, H, 48, 32, F32)
    topk = np.asarray(random_topk(4, T, S, 12, q_offset)) if masked else None
    kw = dict(sm_scale=SM_SCALE, q_offset=jnp.int32(q_offset), kv_len=jnp.int32(kv_len),
              topk_TK=None if topk is None else jnp.asarray(topk))
    q, k, v = map(jnp.asarray, (q, k, v))
    out, lse = self.fn()(q, k, v, **kw)
    dlse = jnp.where(jnp.isfinite(lse), g_lse, 0.0)
    configs = (DenseMHAKernelConfig(32, 16), DenseMHAKernelConfig(16, 32))
    got = jax.jit(functools.partial(dense_mha_backward, configs=configs,
                                    interpret=self.INTERPRET, **kw))(
        q, k, v, out, lse, jnp.asarray(g_out), dlse)
    self.assert_grads_match(got, q, k, v, g_out, g_lse,
                            numpy_visible(T, S, q_offset, kv_len, topk), F32)
