"""Manifold-constrained hyper-connections (mHC): N residual streams instead of one.

A block reads one input collapsed from the N streams (weights ``pre``), and its output is
spread back over them (``post``) on top of the streams mixed by ``comb``, a doubly-stochastic
N x N matrix (Sinkhorn-Knopp), so the mixing cannot grow the residual's norm. Every weight is
computed per token from the streams themselves, in float32, as Hugging Face's
``DeepseekV4HyperConnection`` does; the streams keep the model's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def unweighted_rms_norm(x, eps: float):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def sinkhorn(comb_NN, *, iters: int, eps: float):
  """Columns, then ``iters - 1`` rounds of rows and columns, each normalised to sum 1."""
  comb_NN = comb_NN / (comb_NN.sum(-2, keepdims=True) + eps)
  for _ in range(iters - 1):
    comb_NN = comb_NN / (comb_NN.sum(-1, keepdims=True) + eps)
    comb_NN = comb_NN / (comb_NN.sum(-2, keepdims=True) + eps)
  return comb_NN


def _mix_logits(streams_BTND, fn_XY, eps: float):
  flat = streams_BTND.reshape(*streams_BTND.shape[:-2], -1).astype(jnp.float32)
  flat = unweighted_rms_norm(flat, eps)
  return jnp.einsum("...y,xy->...x", flat, fn_XY.astype(jnp.float32),
                    preferred_element_type=jnp.float32)


class HyperConnection(nnx.Module):
  """The (pre, post, comb) weights of one block from its N input streams."""

  def __init__(self, hidden_size: int, hc_mult: int, *, sinkhorn_iters: int, hc_eps: float,
               norm_eps: float, rngs: nnx.Rngs):
    n = hc_mult
    width = (2 + n) * n
    init = jax.random.normal(rngs.params(), (width, n * hidden_size), jnp.float32)
    self.fn = nnx.Param(init * (n * hidden_size) ** -0.5)
    self.base = nnx.Param(jnp.zeros((width,), jnp.float32))
    self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
    self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = (
        n, sinkhorn_iters, hc_eps, norm_eps)

  def __call__(self, streams_BTND):
    """Returns ``(post_BTN, comb_BTNN, collapsed_BTD)``, the weights in float32."""
    n = self.hc_mult
    mixes = _mix_logits(streams_BTND, self.fn[...], self.norm_eps)
    base, scale = self.base[...], self.scale[...]
    pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + self.hc_eps
    post = 2 * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mixes.shape[:-1], n, n)
    comb = sinkhorn(jax.nn.softmax(comb_logits, axis=-1) + self.hc_eps,
                    iters=self.sinkhorn_iters, eps=self.hc_eps)
    collapsed = jnp.einsum("...n,...nd->...d", pre, streams_BTND.astype(jnp.float32))
    return post, comb, collapsed.astype(streams_BTND.dtype)


def merge_block_output(streams_BTND, block_out_BTD, post_BTN, comb_BTNN):
  """``post[k] * out + sum_j comb[j, k] * streams[j]``: comb is read transposed."""
  dtype = streams_BTND.dtype
  mixed = jnp.einsum("...jk,...jd->...kd", comb_BTNN.astype(dtype), streams_BTND)
  return post_BTN.astype(dtype)[..., None] * block_out_BTD[..., None, :] + mixed


class HyperHead(nnx.Module):
  """The last collapse of the N streams into one, before the final norm."""

  def __init__(self, hidden_size: int, hc_mult: int, *, hc_eps: float, norm_eps: float,
               rngs: nnx.Rngs):
    init = jax.random.normal(rngs.params(), (hc_mult, hc_mult * hidden_size), jnp.float32)
    self.hc_fn = nnx.Param(init * (hc_mult * hidden_size) ** -0.5)
    self.hc_base = nnx.Param(jnp.zeros((hc_mult,), jnp.float32))
    self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))
    self.hc_eps, self.norm_eps = hc_eps, norm_eps

  def __call__(self, streams_BTND):
    mixes = _mix_logits(streams_BTND, self.hc_fn[...], self.norm_eps)
    pre = jax.nn.sigmoid(mixes * self.hc_scale[...] + self.hc_base[...]) + self.hc_eps
    out = jnp.einsum("...n,...nd->...d", pre, streams_BTND.astype(jnp.float32))
    return out.astype(streams_BTND.dtype)
