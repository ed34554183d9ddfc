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
