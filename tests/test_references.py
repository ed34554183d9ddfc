"""The kernel references (the XLA backend's math) against the float64 NumPy ground truth."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.testing import relative_error
from pallas_kernels import dense_mha_reference, indexer_logits_reference, sparse_mqa_reference
from tests.numpy_kernels import numpy_dense_mha, numpy_indexer_logits, numpy_sparse_mqa


@pytest.mark.parametrize("t, h, s, k", [(1, 1, 1, 1), (5, 4, 37, 7), (9, 16, 100, 40)])
def test_sparse_mqa_reference_with_invalid_and_empty_rows(t, h, s, k):
  rng = np.random.default_rng(t * 100 + k)
  d_v, d = 64, 80
  q, kv = rng.standard_normal((t, h, d)), rng.standard_normal((s, d))
  idx = rng.integers(-1, s + 5, size=(t, k)).astype(np.int32)  # -1 and out-of-range mixed in
  idx[0] = -1  # an empty row
  out, lse = sparse_mqa_reference(jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32),
                                  jnp.asarray(idx), sm_scale=0.3, d_v=d_v)
  ref_out, ref_lse = numpy_sparse_mqa(q, kv, idx, 0.3, d_v)
  chex.assert_shape((out, lse), ((t, h, d_v), (t, h)))
  np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
  assert np.isposinf(np.asarray(lse[0])).all()
  if t > 1:
    assert relative_error(out[1:], ref_out[1:]) < 1e-5
    np.testing.assert_allclose(lse[1:], ref_lse[1:], rtol=1e-5)


def test_sparse_mqa_all_minus_one_gives_zero_attention():
  """Why routing matters: a buffer the indexer never filled silently attends to nothing."""
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((6, 4, 80)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((10, 80)), jnp.float32)
  out, lse = sparse_mqa_reference(q, kv, jnp.full((6, 16), -1, jnp.int32), sm_scale=0.1, d_v=64)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  assert np.isposinf(np.asarray(lse)).all()


def test_sparse_mqa_is_invariant_to_index_order():
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((3, 2, 80)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((50, 80)), jnp.float32)
  idx = jnp.asarray(rng.permutation(50)[:20].reshape(1, 20).repeat(3, 0), jnp.int32)
  a, _ = sparse_mqa_reference(q, kv, idx, sm_scale=0.2, d_v=64)
  b, _ = sparse_mqa_reference(q, kv, idx[:, ::-1], sm_scale=0.2, d_v=64)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_indexer_logits_reference_matches_loop(dtype, tol):
  rng = np.random.default_rng(5)
  t, g, i, s = 7, 4, 32, 23
  q, k, w = rng.standard_normal((t, g, i)), rng.standard_normal((s, i)), rng.standard_normal((t, g))
  starts = np.array([0, 0, 3, 5, 0, 10, 22], np.int32)
  ends = np.array([1, 5, 9, 5, 23, 12, 23], np.int32)
  out = indexer_logits_reference(jnp.asarray(q, dtype), jnp.asarray(k, dtype),
                                 jnp.asarray(w, jnp.float32), jnp.asarray(starts),
                                 jnp.asarray(ends))
  ref = numpy_indexer_logits(q, k, w, starts, ends, None)
  out = np.asarray(out, np.float64)
  np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
  finite = np.isfinite(ref)
  assert relative_error(out[finite], ref[finite]) < tol


def test_indexer_logits_reference_applies_fp8_key_scales():
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float8_e4m3fn)
  k = jnp.asarray(rng.standard_normal((5, 16)), jnp.float8_e4m3fn)
  w = jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.5, 2.0, 5), jnp.float32)
  starts, ends = jnp.zeros(3, jnp.int32), jnp.full(3, 5, jnp.int32)
  plain = indexer_logits_reference(q, k, w, starts, ends)
  scaled = indexer_logits_reference(q, k, w, starts, ends, k_scale_S=scale)
  np.testing.assert_allclose(scaled, plain * scale[None, :], rtol=1e-6)


@pytest.mark.parametrize("t, s, offset, kv_len", [(1, 1, 0, 1), (6, 6, 0, 6), (4, 11, 7, 11),
                                                  (5, 12, 3, 6)])
def test_dense_mha_reference_is_causal_from_offset(t, s, offset, kv_len):
  rng = np.random.default_rng(t + s)
  h, d, v = 3, 24, 8
  q, k, val = rng.standard_normal((t, h, d)), rng.standard_normal((s, h, d)), rng.standard_normal((s, h, v))
  out, lse = dense_mha_reference(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                 jnp.asarray(val, jnp.float32), sm_scale=0.25,
                                 q_offset=jnp.int32(offset), kv_len=jnp.int32(kv_len))
  ref, _ = numpy_dense_mha(q, k, val, 0.25, offset, kv_len)
  assert relative_error(out, ref) < 1e-5
  chex.assert_tree_all_finite(lse)
