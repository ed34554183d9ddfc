"""DeepSeek mixture of experts (SPEC.md section 11): sigmoid router, group-limited top-k.

Parameter names match the Hugging Face state dict (SPEC.md 10.2): ``gate.weight`` [E, D],
``gate.e_score_correction_bias`` [E], ``experts.{e}.{gate,up,down}_proj.weight`` and
``shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.models.config import MoEConfig
from mla_jax.models.mlp import MLP


def route_tokens(logits_TE, bias_E, config: MoEConfig):
  """Chosen experts ``idx_TK`` (int32) and their combine weights ``weights_TK`` (fp32).

  Selection ranks ``sigmoid(logits) + bias``; the weights use the unbiased sigmoid scores.
  Ties go to the lower index, both among groups and among experts (``lax.top_k``).
  """
  num_tokens, num_experts = logits_TE.shape
  per_group = num_experts // config.n_group
  scores_TE = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
  select_TE = scores_TE + bias_E.astype(jnp.float32)

  if config.topk_group < config.n_group:
    select_TGE = select_TE.reshape(num_tokens, config.n_group, per_group)
    group_score_TG = jax.lax.top_k(select_TGE, min(2, per_group))[0].sum(-1)
    _, top_groups = jax.lax.top_k(group_score_TG, config.topk_group)  # [T, topk_group]
    kept_TG = jnp.zeros((num_tokens, config.n_group), bool)
    kept_TG = kept_TG.at[jnp.arange(num_tokens)[:, None], top_groups].set(True)
    # -inf, as in the DeepSeek reference: HF's 0.0 fill lets a dropped group win whenever the
    # biased scores in the kept groups are negative.
    select_TE = jnp.where(jnp.repeat(kept_TG, per_group, axis=1), select_TE, -jnp.inf)

  _, idx_TK = jax.lax.top_k(select_TE, config.num_experts_per_tok)
  weights_TK = jnp.take_along_axis(scores_TE, idx_TK, axis=-1)
  if config.norm_topk_prob:
    weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
  return idx_TK.astype(jnp.int32), weights_TK * config.routed_scaling_factor


class TopkRouter(nnx.Module):
  """Router logits in fp32 (weight and bias stay fp32 whatever the model dtype)."""

  def __init__(self, hidden_size: int, config: MoEConfig, *, rngs: nnx.Rngs):
    init = jax.random.normal(rngs.params(), (config.num_experts, hidden_size), jnp.float32)
    self.weight = nnx.Param(init * hidden_size**-0.5)
    # Zero until a checkpoint supplies the trained load-balancing bias.
    self.e_score_correction_bias = nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))
    self.config = config

  def __call__(self, x_TD):
    logits_TE = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), self.weight[...],
                           preferred_element_type=jnp.float32)
    return route_tokens(logits_TE, self.e_score_correction_bias[...], self.config)


class MoE(nnx.Module):
  """Routed experts plus optional shared experts.

  Every expert runs on every token and unchosen experts get weight 0: exact and simple,
  meant for small configs, not for DeepSeek-sized E.
  """

  def __init__(self, hidden_size: int, config: MoEConfig, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    self.gate = TopkRouter(hidden_size, config, rngs=rngs)
    self.experts = nnx.List([
        MLP(hidden_size, config.moe_intermediate_size, rngs=rngs, param_dtype=param_dtype)
        for _ in range(config.num_experts)])
    self.shared_experts = (
        MLP(hidden_size, config.moe_intermediate_size * config.n_shared_experts, rngs=rngs,
            param_dtype=param_dtype) if config.n_shared_experts else None)
    self.num_experts = config.num_experts

  def __call__(self, x_BTD):
    dtype = x_BTD.dtype
    x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
    idx_TK, weights_TK = self.gate(x_TD)
    combine_TE = jnp.zeros((x_TD.shape[0], self.num_experts), jnp.float32)
    combine_TE = combine_TE.at[jnp.arange(x_TD.shape[0])[:, None], idx_TK].set(weights_TK)

    w_gate_EFD = jnp.stack([e.gate_proj.weight[...] for e in self.experts]).astype(dtype)
    w_up_EFD = jnp.stack([e.up_proj.weight[...] for e in self.experts]).astype(dtype)
    w_down_EDF = jnp.stack([e.down_proj.weight[...] for e in self.experts]).astype(dtype)
    gate_TEF = jnp.einsum("td,efd->tef", x_TD, w_gate_EFD, preferred_element_type=jnp.float32)
    up_TEF = jnp.einsum("td,efd->tef", x_TD, w_up_EFD, preferred_element_type=jnp.float32)
    # down() is linear, so weighting its input equals weighting each expert's output.
    h_TEF = jax.nn.silu(gate_TEF) * up_TEF * combine_TE[:, :, None]
    out_TD = jnp.einsum("tef,edf->td", h_TEF.astype(dtype), w_down_EDF,
                        preferred_element_type=jnp.float32)
    if self.shared_experts is not None:
      out_TD = out_TD + self.shared_experts(x_TD).astype(jnp.float32)
    return out_TD.astype(dtype).reshape(x_BTD.shape)
