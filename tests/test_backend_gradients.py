"""Gradients through the batched backend ops: the Pallas kernels' backward (interpret mode)
against the XLA backend's autodiff of the references, as the models and training call them
(``vmap`` over the batch, ragged windows, -1 padding). The kernels' own gradient tests
(tests/kernels/test_*_grad.py) compare each backward with float64; this file checks the
backend wiring, where a missing or misplaced custom VJP would show."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.backends import XlaBackend
from mla_jax.backends.pallas import PallasTritonBackend

PALLAS, XLA = PallasTritonBackend(interpret=True), XlaBackend()


def _grads(backend, loss, args, argnums):
  return jax.jit(jax.grad(lambda *a: loss(backend, *a), argnums=argnums))(*args)


def _assert_close(pallas, xla, rtol=2e-5):
  for p, x in zip(pallas, xla):
    assert np.isfinite(np.asarray(p)).all()
    chex.assert_trees_all_close(p, x, rtol=rtol, atol=rtol * float(jnp.abs(x).max()))


def test_indexer_logits_gradients_match_the_xla_backend():
  rng = np.random.default_rng(0)
  B, T, G, I, S = 2, 5, 4, 32, 24
  q = rng.standard_normal((B, T, G, I)).astype(np.float32)
  k = rng.standard_normal((B, S, I)).astype(np.float32)
  w = rng.standard_normal((B, T, G)).astype(np.float32)
  starts = np.array([[0, 0, 3, 5, 9], [0, 2, 2, 4, 24]], np.int32)  # the last window is empty
  ends = np.array([[4, 9, 11, 20, 24], [6, 2, 12, 18, 24]], np.int32)
  cot = rng.standard_normal((B, T, S)).astype(np.float32)

  def loss(backend, q, k, w):
    logits = backend.indexer_logits(q, k, w, starts, ends)
    return jnp.where(jnp.isfinite(logits), logits * cot, 0.0).sum()

  _assert_close(_grads(PALLAS, loss, (q, k, w), (0, 1, 2)),
                _grads(XLA, loss, (q, k, w), (0, 1, 2)))


def test_sparse_mqa_gradients_match_the_xla_backend():
  rng = np.random.default_rng(1)
  B, T, H, L, d_v, S, K = 2, 4, 3, 80, 64, 30, 6
  q = rng.standard_normal((B, T, H, L)).astype(np.float32)
  kv = rng.standard_normal((B, S, L)).astype(np.float32)
  topk = rng.integers(0, S, (B, T, K)).astype(np.int32)
  topk[0, 1, 3:] = -1  # padding
  topk[1, 2] = -1  # an empty row
  topk[1, 3, 0] = topk[1, 3, 1]  # a row picked twice
  cot_out = rng.standard_normal((B, T, H, d_v)).astype(np.float32)
  cot_lse = rng.standard_normal((B, T, H)).astype(np.float32)

  def loss(backend, q, kv):
    out, lse = backend.sparse_mqa(q, kv, topk, sm_scale=L**-0.5, d_v=d_v)
    return (out * cot_out).sum() + jnp.where(jnp.isfinite(lse), lse * cot_lse, 0.0).sum()

  _assert_close(_grads(PALLAS, loss, (q, kv), (0, 1)), _grads(XLA, loss, (q, kv), (0, 1)))


def test_dense_and_masked_mha_gradients_match_the_xla_backend():
  rng = np.random.default_rng(2)
  B, T, S, H, D, V, K = 2, 6, 10, 2, 48, 32, 4
  q = rng.standard_normal((B, T, H, D)).astype(np.float32)
  k = rng.standard_normal((B, S, H, D)).astype(np.float32)
  v = rng.standard_normal((B, S, H, V)).astype(np.float32)
  offsets, lens = np.array([4, 0], np.int32), np.array([10, 6], np.int32)
  topk = rng.integers(-1, S, (B, T, K)).astype(np.int32)
  cot = rng.standard_normal((B, T, H, V)).astype(np.float32)

  def dense(backend, q, k, v):
    out, _ = backend.dense_mha(q, k, v, sm_scale=D**-0.5, q_offset_B=offsets, kv_len_B=lens)
    return (out * cot).sum()

  def masked(backend, q, k, v):
    out, _ = backend.masked_mha(q, k, v, topk, sm_scale=D**-0.5, q_offset_B=offsets,
                                kv_len_B=lens)
    return (out * cot).sum()

  for loss in (dense, masked):
    _assert_close(_grads(PALLAS, loss, (q, k, v), (0, 1, 2)),
                  _grads(XLA, loss, (q, k, v), (0, 1, 2)))
