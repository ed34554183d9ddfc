"""Dense SwiGLU feed-forward block, laid out like Hugging Face's ``DeepseekV3MLP``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.layers import Linear


class MLP(nnx.Module):
  """``down(silu(gate(x)) * up(x))``; the matmuls accumulate in fp32 and return x.dtype."""

  def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    self.gate_proj = Linear(hidden_size, intermediate_size, rngs=rngs, param_dtype=param_dtype)
    self.up_proj = Linear(hidden_size, intermediate_size, rngs=rngs, param_dtype=param_dtype)
    self.down_proj = Linear(intermediate_size, hidden_size, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, x_TD):
    # The gating product is formed in fp32 and rounded once, before the down projection.
    gate_TF = jax.nn.silu(self.gate_proj(x_TD).astype(jnp.float32))
    h_TF = (gate_TF * self.up_proj(x_TD).astype(jnp.float32)).astype(x_TD.dtype)
    return self.down_proj(h_TF)
