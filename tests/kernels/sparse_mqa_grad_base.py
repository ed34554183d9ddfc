"""The sparse MQA gradient suite, run over every implementation (``test_sparse_mqa_grad.py``):
the kernel's custom VJP (Pallas-Triton backward, interpret mode on CPU) and plain autodiff of
the jnp reference (the XLA backend's training path), both against float64 NumPy
(``numpy_sparse_mqa_grad``).

Both outputs carry cotangents (``dlse`` too). -1 padding, indices >= S, empty rows, rows a
token selects twice, and NaN in rows no valid slot selects are covered: unselected rows get
exactly zero gradients, never NaN. The printed relative errors are the measured figures.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.testing import relative_error
from pallas_kernels.block_config import (DenseMHAKernelConfig, SparseMQABackwardConfig,
                                         SparseMQAKernelConfig)
from pallas_kernels.sparse_mqa import sparse_mqa, sparse_mqa_reference
from tests.kernels import common
from tests.kernels.numpy_reference import numpy_dequantize_rows, numpy_sparse_mqa_grad
from tests.kernels.sparse_mqa_base import (MASKING_TOPK, make_fp8_inputs, make_inputs,
                                           masking_inputs)

GRAD_RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SMALL = SparseMQAKernelConfig(block_h=16, block_k=16)  # heads and slots overhang their blocks
SMALL_BACKWARD = SparseMQABackwardConfig(dq=SMALL, drows=SMALL)
D, D_V, SM_SCALE = 80, 64, 0.11  # tiny MLA rows: 64 latent + 16 rope

CASES = (
    # S 20 < K * T: rows repeat within a token's slots, and -1 / >= S mixed in.
    dict(testcase_name="t3_h5_k7_s20_repeats", T=3, H=5, K=7, S=20),
    dict(testcase_name="t4_h16_k40_s100_empty_rows", T=4, H=16, K=40, S=100,
         pattern="empty_rows"),
    dict(testcase_name="t5_h20_k33_s60_padded", T=5, H=20, K=33, S=60, pattern="padded"),
)
BF16_CASES = ("t3_h5_k7_s20_repeats", "t4_h16_k40_s100_empty_rows")

_GRAD_FNS: dict = {}  # one jitted gradient per implementation and statics, for all cases


def cotangents(seed, T, H, d_v, dtype):
  rng = np.random.default_rng(seed + 1000)
  return (jnp.asarray(rng.standard_normal((T, H, d_v)), dtype),
          jnp.asarray(rng.standard_normal((T, H)), jnp.float32))


def selected_rows(topk, num_rows):
  idx = np.asarray(topk).ravel()
  return np.isin(np.arange(num_rows), idx[(idx >= 0) & (idx < num_rows)])


class SparseMQAGradTestBase(common.KernelTestBase):

  KERNEL = staticmethod(sparse_mqa)
  REFERENCE = staticmethod(sparse_mqa_reference)
  STATIC_ARGNAMES = ("sm_scale", "d_v")
  POSITIONAL = ("q", "kv", "topk")

  def grad_fn(self, kernel_kwargs=(), sm_scale=SM_SCALE, d_v=D_V, vmapped=False, kv_axis=0):
    """Jitted ``(q, kv, topk, dout, dlse) -> (dq, dkv)``; ``kernel_kwargs`` (pairs) go to the
    kernel only. ``vmapped``: over a leading batch axis, kv batched on ``kv_axis`` (None:
    rows every sequence shares, as a page pool)."""
    key = ("grad", self.IMPLEMENTATION, self.INTERPRET, kernel_kwargs, sm_scale, d_v, vmapped,
           kv_axis)
    if key not in _GRAD_FNS:
      if self.IMPLEMENTATION == common.REFERENCE:
        fn = self.REFERENCE
      else:
        fn = functools.partial(self.KERNEL, interpret=self.INTERPRET,
                               **{"config": SMALL, "backward_config": SMALL_BACKWARD,
                                  **dict(kernel_kwargs)})
      op = functools.partial(fn, sm_scale=sm_scale, d_v=d_v)
      if vmapped:  # as the backends batch it
        op = jax.vmap(op, in_axes=(0, kv_axis, 0))

      def grads(q, kv, topk, dout, dlse):
        _, pull = jax.vjp(lambda q, kv: op(q, kv, topk), q, kv)
        return pull((dout, dlse))

      _GRAD_FNS[key] = jax.jit(grads)
    return _GRAD_FNS[key]

  def assert_grads_match(self, grads, q, kv, topk, dout, dlse, *, dtype, sm_scale=SM_SCALE,
                         d_v=D_V):
    """Against float64 NumPy; unselected rows and empty tokens get exactly zero."""
    dq, dkv = grads
    want_dq, want_dkv = numpy_sparse_mqa_grad(q, kv, topk, sm_scale, d_v, dout, dlse)
    chex.assert_tree_all_finite((dq, dkv))
    chex.assert_type((dq, dkv), (q.dtype, kv.dtype))
    errors = relative_error(dq, want_dq), relative_error(dkv, want_dkv)
    print(f"{self._testMethodName}: {self.IMPLEMENTATION} vs float64, relative error "
          f"dq {errors[0]:.2e}, dkv {errors[1]:.2e}")
    assert max(errors) < GRAD_RTOL[dtype], errors
    np.testing.assert_array_equal(np.asarray(dkv)[~selected_rows(topk, kv.shape[0])], 0.0)
    empty_T = ~np.asarray([selected_rows(row, kv.shape[0]).any() for row in np.asarray(topk)])
    np.testing.assert_array_equal(np.asarray(dq)[empty_T], 0.0)

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{dt.__name__}", dtype=dt)
      for c in CASES for dt in (jnp.float32, jnp.bfloat16)
      if dt == jnp.float32 or c["testcase_name"] in BF16_CASES
  )
  def test_matches_float64(self, T, H, K, S, dtype, pattern="random"):
    q, kv, topk = make_inputs(T * 7 + K, T, H, K, S, D, dtype, pattern)
    dout, dlse = cotangents(T, T, H, D_V, dtype)
    self.assert_grads_match(self.grad_fn()(q, kv, topk, dout, dlse), q, kv, topk, dout, dlse,
                            dtype=dtype)

  def test_lse_cotangent_alone(self):
    """d lse / d logits = p: with out's cotangent 0 only the LSE's drives the gradients."""
    q, kv, topk = make_inputs(28, 3, 5, 7, 20, D, jnp.float32)
    dout, dlse = cotangents(3, 3, 5, D_V, jnp.float32)
    dout = jnp.zeros_like(dout)
    grads = self.grad_fn()(q, kv, topk, dout, dlse)
    self.assertGreater(float(jnp.abs(grads[1]).max()), 0.0)
    self.assert_grads_match(grads, q, kv, topk, dout, dlse, dtype=jnp.float32)

  def test_row_selected_twice_counts_twice(self):
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((3, 5, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((20, D)), jnp.float32)
    topk = jnp.asarray([[4, 4, 7, -1, 12, 3, 3], [2, 9, 9, 9, 25, -1, 0],
                        [5, 6, 7, 8, 9, 10, 5]], jnp.int32)
    dout, dlse = cotangents(5, 3, 5, D_V, jnp.float32)
    grads = self.grad_fn()(q, kv, topk, dout, dlse)
    self.assert_grads_match(grads, q, kv, topk, dout, dlse, dtype=jnp.float32)
    # Counting a repeat once would be this (a different answer, so the check above can fail).
    _, once_dkv = numpy_sparse_mqa_grad(q, kv, np.where(np.asarray(topk) == 9, -1, topk),
                                        SM_SCALE, D_V, dout, dlse)
    assert relative_error(grads[1][9], once_dkv[9]) > 0.1

  def test_nan_in_unselected_rows_never_reaches_a_gradient(self):
    # Row 0 is where invalid slots clamp; no valid slot of MASKING_TOPK selects rows 0, 20, 30.
    q, kv = (jnp.asarray(x) for x in masking_inputs())
    bad = kv.at[jnp.asarray([0, 20, 30])].set(jnp.nan)
    topk = jnp.asarray(MASKING_TOPK)
    dout, dlse = cotangents(9, 4, 5, D_V, jnp.float32)
    grads = self.grad_fn()(q, bad, topk, dout, dlse)
    chex.assert_trees_all_equal(grads, self.grad_fn()(q, kv, topk, dout, dlse))
    self.assert_grads_match(grads, q, kv, topk, dout, dlse, dtype=jnp.float32)

  def test_vmap_over_a_batch(self):
    batch = [make_inputs(b, 3, 4, 7, 20, D, jnp.float32) for b in range(2)]
    q, kv, topk = (jnp.stack(xs) for xs in zip(*batch))
    dout, dlse = (jnp.stack(xs) for xs in zip(*(cotangents(b, 3, 4, D_V, jnp.float32)
                                                for b in range(2))))
    dq, dkv = self.grad_fn(vmapped=True)(q, kv, topk, dout, dlse)
    for b in range(2):
      self.assert_grads_match((dq[b], dkv[b]), q[b], kv[b], topk[b], dout[b], dlse[b],
                              dtype=jnp.float32)
    # Rows shared by every sequence (a page pool): their gradient sums over the batch.
    _, shared_dkv = self.grad_fn(vmapped=True, kv_axis=None)(q, kv[0], topk, dout, dlse)
    want = sum(numpy_sparse_mqa_grad(q[b], kv[0], topk[b], SM_SCALE, D_V, dout[b], dlse[b])[1]
               for b in range(2))
    assert relative_error(shared_dkv, want) < 1e-5

  def test_fp8_rows_are_constants(self):
    q, rows, topk = make_fp8_inputs(3, 3, 5, 7, 30, 64, 16, jnp.float32)
    dout, dlse = cotangents(3, 3, 5, 64, jnp.float32)
    dq, drows = self.grad_fn(sm_scale=80**-0.5, d_v=64)(q, rows, topk, dout, dlse)
    for got, part in zip(drows, rows):
      chex.assert_type(got, part.dtype)
      np.testing.assert_array_equal(np.asarray(got, np.float32), 0.0)
    want_dq, _ = numpy_sparse_mqa_grad(q, numpy_dequantize_rows(rows), topk, 80**-0.5, 64,
                                       dout, dlse)
    error = relative_error(dq, want_dq)
    print(f"{self._testMethodName}: {self.IMPLEMENTATION} dq vs float64 of the dequantized rows, "
          f"relative error {error:.2e}")
    assert error < 1e-5

  def test_deepseek_widths(self):
    """576 = 512 latent + 64 rope, d_v 512; few heads (H 128 is slow in interpret mode)."""
    for dtype in (jnp.float32, jnp.bfloat16):
      q, kv, topk = make_inputs(11, 2, 20, 40, 64, 576, dtype)
      dout, dlse = cotangents(11, 2, 20, 512, dtype)
      grads = self.grad_fn((("config", None), ("backward_config", None)), sm_scale=576**-0.5,
                           d_v=512)(q, kv, topk, dout, dlse)
      self.assert_grads_match(grads, q, kv, topk, dout, dlse, dtype=dtype, sm_scale=576**-0.5,
                              d_v=512)

  @parameterized.named_parameters(("no_topk_slots", 3, 20, 0), ("no_rows", 3, 0, 7))
  def test_degenerate_sizes_give_zero_gradients(self, T, S, K):
    q, kv = jnp.ones((T, 4, D), jnp.float32), jnp.ones((S, D), jnp.float32)
    dout, dlse = cotangents(0, T, 4, D_V, jnp.float32)
    dq, dkv = self.grad_fn()(q, kv, jnp.zeros((T, K), jnp.int32), dout, dlse)
    np.testing.assert_array_equal(np.asarray(dq), 0.0)
    np.testing.assert_array_equal(np.asarray(dkv), 0.0)


class SparseMQAGradKernelTestBase(SparseMQAGradTestBase):
  """The suite, and what only the kernel has: agreement with the reference's autodiff,
  bitwise determinism, token chunking and its backward arguments."""

  def test_kernel_matches_reference_autodiff(self):
    q, kv, topk = make_inputs(4, 4, 16, 40, 100, D, jnp.float32, "empty_rows")
    dout, dlse = cotangents(4, 4, 16, D_V, jnp.float32)

    @jax.jit
    def reference_grads(q, kv, topk, dout, dlse):
      _, pull = jax.vjp(lambda q, kv: sparse_mqa_reference(q, kv, topk, sm_scale=SM_SCALE,
                                                           d_v=D_V), q, kv)
      return pull((dout, dlse))

    chex.assert_trees_all_close(self.grad_fn()(q, kv, topk, dout, dlse),
                                reference_grads(q, kv, topk, dout, dlse), rtol=1e-5, atol=1e-5)

  def test_deterministic(self):
    """9 tokens x 16 slots over 4 rows: each row's run of ~36 slots spans several steps of the
    row sum. Two calls give the same gradients, bit for bit."""
    q, kv, topk = make_inputs(2, 9, 4, 16, 4, D, jnp.float32, "valid")
    dout, dlse = cotangents(2, 9, 4, D_V, jnp.float32)
    fn = self.grad_fn()
    grads = fn(q, kv, topk, dout, dlse)
    chex.assert_trees_all_equal(grads, fn(q, kv, topk, dout, dlse))
    self.assert_grads_match(grads, q, kv, topk, dout, dlse, dtype=jnp.float32)

  def test_drows_chunks_sum_like_one(self):
    """T 5 in chunks of 2 (2 + 2 + 1 tokens) gives the unchunked gradients."""
    q, kv, topk = make_inputs(5, 5, 20, 33, 60, D, jnp.float32, "padded")
    dout, dlse = cotangents(5, 5, 20, D_V, jnp.float32)
    chunked = self.grad_fn((("drows_max_bytes", 2 * 33 * D * 4),))(q, kv, topk, dout, dlse)
    chex.assert_trees_all_close(chunked, self.grad_fn()(q, kv, topk, dout, dlse), rtol=1e-6,
                                atol=1e-6)
    self.assert_grads_match(chunked, q, kv, topk, dout, dlse, dtype=jnp.float32)

  @parameterized.named_parameters(("zero", 0, ValueError), ("float", 1e6, TypeError),
                                  ("bool", True, TypeError))
  def test_refuses_bad_drows_max_bytes(self, value, error):
    q, kv, topk = make_inputs(0, 3, 4, 7, 20, D, jnp.float32)
    with self.assertRaisesRegex(error, "drows_max_bytes"):
      sparse_mqa(q, kv, topk, sm_scale=0.1, d_v=D_V, drows_max_bytes=value, interpret=True)

  def test_refuses_a_foreign_backward_config(self):
    q, kv, topk = make_inputs(0, 3, 4, 7, 20, D, jnp.float32)
    with self.assertRaisesRegex(TypeError, "backward_config"):
      sparse_mqa(q, kv, topk, sm_scale=0.1, d_v=D_V, backward_config=DenseMHAKernelConfig(),
                 interpret=True)
