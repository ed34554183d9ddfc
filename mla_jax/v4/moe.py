"""DeepSeek-V4's feed-forward: the MoE with learned or hash routing and a clipped SwiGLU.

``moe`` layers pick each token's experts as the top-k of ``score(logits) + bias`` (no expert
groups); ``hash_moe`` layers (the first layers of a V4 model) read them from a frozen table
``tid2eid[token id]``. Either way the combine weights are the chosen experts' unbiased scores,
normalised to sum 1 and scaled by ``routed_scaling_factor`` (Hugging Face normalises whatever
``norm_topk_prob`` says, and so does this). The experts are ``mla_jax.models.moe``'s, with
``swiglu_limit`` clipping their gate and up projections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.models.config import MoEConfig
from mla_jax.models.mlp import MLP
from mla_jax.models.moe import MoE
from mla_jax.v4.config import V4Config


def expert_scores(logits_TE, scoring_func: str):
  logits_TE = logits_TE.astype(jnp.float32)
  if scoring_func == "sqrtsoftplus":
    return jnp.sqrt(jax.nn.softplus(logits_TE))
  if scoring_func == "softmax":
    return jax.nn.softmax(logits_TE, axis=-1)
  return jax.nn.sigmoid(logits_TE)


def combine_weights(scores_TE, idx_TK, routed_scaling_factor: float):
  weights_TK = jnp.take_along_axis(scores_TE, idx_TK, axis=-1)
  return weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20) * routed_scaling_factor


class V4Router(nnx.Module):
  """Learned routing (``moe``) or, with ``hashed``, the ``tid2eid`` table (``hash_moe``)."""

  def __init__(self, config: V4Config, *, hashed: bool, rngs: nnx.Rngs):
    e, d = config.n_routed_experts, config.hidden_size
    self.weight = nnx.Param(jax.random.normal(rngs.params(), (e, d), jnp.float32) * d**-0.5)
    if hashed:
      # Random until a checkpoint supplies the frozen table (HF's init zeroes it).
      table = jax.random.randint(rngs.params(), (config.vocab_size, config.num_experts_per_tok),
                                 0, e, jnp.int32)
      self.tid2eid = nnx.Variable(table)
    else:
      self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
    self.hashed = hashed
    self.config = config

  def __call__(self, x_TD, ids_T):
    config = self.config
    logits_TE = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), self.weight[...],
                           preferred_element_type=jnp.float32)
    scores_TE = expert_scores(logits_TE, config.scoring_func)
    if self.hashed:
      idx_TK = self.tid2eid[...][ids_T].astype(jnp.int32)
    else:
      biased = scores_TE + self.e_score_correction_bias[...]
      idx_TK = jax.lax.top_k(biased, config.num_experts_per_tok)[1].astype(jnp.int32)
    return idx_TK, combine_weights(scores_TE, idx_TK, config.routed_scaling_factor)


class V4MoE(MoE):
  """``MoE`` with V4's router; ``__call__`` also takes the token ids (hash routing)."""

  def __init__(self, config: V4Config, *, hashed: bool, rngs: nnx.Rngs,
               grouped_matmul: str = "auto", mesh=None, param_dtype=jnp.float32):
    # One shared expert of moe_intermediate_size whatever n_shared_experts says, as HF's
    # DeepseekV4SparseMoeBlock builds it.
    moe = MoEConfig(num_experts=config.n_routed_experts,
                    num_experts_per_tok=config.num_experts_per_tok, n_group=1, topk_group=1,
                    n_shared_experts=1, moe_intermediate_size=config.moe_intermediate_size,
                    routed_scaling_factor=config.routed_scaling_factor)
    super().__init__(config.hidden_size, moe, rngs=rngs, grouped_matmul=grouped_matmul,
                     mesh=mesh, param_dtype=param_dtype)
    self.gate = V4Router(config, hashed=hashed, rngs=rngs)
    self.swiglu_limit = config.swiglu_limit
    self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size, rngs=rngs,
                              param_dtype=param_dtype, swiglu_limit=config.swiglu_limit)

  def __call__(self, x_BTD, ids_BT):
    dtype = x_BTD.dtype
    x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
    idx_TK, weights_TK = self.gate(x_TD, ids_BT.reshape(-1))
    out_TD = self._routed(x_TD, idx_TK, weights_TK) + self.shared_experts(x_TD).astype(
        jnp.float32)
    return out_TD.astype(dtype).reshape(x_BTD.shape)
