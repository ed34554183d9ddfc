"""Small NNX layers whose parameter names and layouts match Hugging Face checkpoints.

``Linear.weight`` is stored [out, in] as in PyTorch, so loading a checkpoint is a rename,
never a transpose. Matmuls accumulate in float32 and return the input's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
  """``y = x @ weight.T`` (no bias, as every MLA/MoE projection).

  A loaded fp8 checkpoint may put a ``quant.BlockScaledWeight`` in ``weight``: reading it
  dequantizes inside the jitted program, right before the matmul.
  """

  block_scalable = ("weight",)

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    init = jax.random.normal(rngs.params(), (out_features, in_features), jnp.float32)
    self.weight = nnx.Param((init * in_features**-0.5).astype(param_dtype))

  def __call__(self, x):
    w = self.weight[...]
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
  """LayerNorm with weight and bias (the indexer's ``k_norm``)."""

  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    xf = (xf - mean) * jax.lax.rsqrt(var + self.eps)
    out = xf * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return out.astype(x.dtype)
