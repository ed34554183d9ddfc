"""Dense SwiGLU feed-forward block, laid out like Hugging Face's ``DeepseekV3MLP``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.layers import Linear


def swiglu(gate, up, limit: float | None = None):
  """``silu(gate) * up``; with ``limit`` (DeepSeek-V4's ``swiglu_limit``) gate is clipped
  above at it and up to [-limit, limit] first."""
  if limit is not None:
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
  return jax.nn.silu(gate) * up


class MLP(nnx.Module):
  """``down(silu(gate(x)) * up(x))``; the matmuls accumulate in fp32 and return x.dtype.

  ``swiglu_limit`` (DeepSeek-V4): gate and up are clipped first (``swiglu``)."""

  def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32, swiglu_limit: float | None = None):
    self.gate_proj = Linear(hidden_size, intermediate_size, rngs=rngs, param_dtype=param_dtype)
    self.up_proj = Linear(hidden_size, intermediate_size, rngs=rngs, param_dtype=param_dtype)
    self.down_proj = Linear(intermediate_size, hidden_size, rngs=rngs, param_dtype=param_dtype)
    self.swiglu_limit = swiglu_limit

  def __call__(self, x_TD):
    # The gating product is formed in fp32 and rounded once, before the down projection.
    h_TF = swiglu(self.gate_proj(x_TD).astype(jnp.float32),
                  self.up_proj(x_TD).astype(jnp.float32), self.swiglu_limit).astype(x_TD.dtype)
    return self.down_proj(h_TF)
