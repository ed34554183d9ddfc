"""``ModelConfig`` -> Hugging Face ``config.json``, inverted exactly by ``config_from_hf``."""

from __future__ import annotations

import dataclasses

from mla_jax.checkpoints.hf_config import (HF_CLASSES, HF_LATENT_NORM_EPS, SUPPORTED_MODEL_TYPES,
                                           config_from_hf)
from mla_jax.models.config import ModelConfig

_ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM",
                  "glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def default_model_type(config: ModelConfig) -> str:
  """``deepseek_v3`` without an indexer; ``glm_moe_dsa`` for an interleaved indexer RoPE or
  layers that share top-k (HF's DeepSeek-V3.2 cannot), else ``deepseek_v32``."""
  indexer = config.mla.indexer
  if indexer is None:
    return "deepseek_v3"
  shares = config.indexer_types is not None and "shared" in config.indexer_types
  return "glm_moe_dsa" if indexer.rope_interleave or shares else "deepseek_v32"


def _canonical(config: ModelConfig) -> ModelConfig:
  """The form ``config_from_hf`` returns: no MoE config when no layer uses it, no schedule
  when every layer runs its indexer."""
  if not any(config.uses_moe(layer) for layer in range(config.num_layers)):
    config = dataclasses.replace(config, moe=None, first_k_dense_replace=0)
  if config.indexer_types is not None and set(config.indexer_types) == {"full"}:
    config = dataclasses.replace(config, indexer_types=None)
  return config


def _differences(a, b, prefix="") -> list[str]:
  if dataclasses.is_dataclass(a) and type(a) is type(b):
    return [d for f in dataclasses.fields(a)
            for d in _differences(getattr(a, f.name), getattr(b, f.name), prefix + f.name + ".")]
  return [] if a == b else [f"{prefix[:-1]}: {a!r} would reload as {b!r}"]


def _rope_parameters(config: ModelConfig) -> dict:
  rope = config.mla.rope
  if rope.yarn is None:
    return {"rope_type": "default", "rope_theta": float(rope.theta)}
  yarn = rope.yarn
  return {"rope_type": "yarn", "rope_theta": float(rope.theta), "factor": float(yarn.factor),
          "original_max_position_embeddings": yarn.original_max_position_embeddings,
          "beta_fast": float(yarn.beta_fast), "beta_slow": float(yarn.beta_slow),
          "mscale": float(yarn.mscale), "mscale_all_dim": float(yarn.mscale_all_dim)}


def config_to_hf(config: ModelConfig, model_type: str | None = None) -> dict:
  """The HF ``config.json`` dict of ``config``; ``config_from_hf`` inverts it exactly.

  ``model_type`` defaults to ``default_model_type(config)``. ``attention`` is a load-time
  choice and the Hadamard flag is rederived, so neither is stored. Anything HF cannot
  express raises ``ValueError``: a latent-norm or indexer-norm eps other than HF's fixed
  1e-6, shared indexer layers as ``deepseek_v32``, non-prefix MoE layouts, ...
  """
  if not isinstance(config, ModelConfig):
    raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
  model_type = model_type or default_model_type(config)
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  mla = config.mla
  if (mla.indexer is None) != (model_type == "deepseek_v3"):
    raise ValueError(f"model_type {model_type!r} does not fit a model "
                     f"{'without' if mla.indexer is None else 'with'} an indexer")
  if mla.latent_norm_eps != HF_LATENT_NORM_EPS:
    raise ValueError(f"mla.latent_norm_eps={mla.latent_norm_eps!r} cannot be expressed in an HF "
                     f"config.json: HF's {HF_CLASSES[model_type]} fixes the eps of "
                     f"q_a_layernorm and kv_a_layernorm at {HF_LATENT_NORM_EPS}")
  config = _canonical(config)
  if model_type == "deepseek_v32" and config.indexer_types is not None:
    raise ValueError("indexer_types with 'shared' layers cannot be expressed as deepseek_v32 "
                     "(HF runs the indexer in every layer); use model_type='glm_moe_dsa'")
  n, moe = config.num_layers, config.moe
  dense = config.first_k_dense_replace if moe is not None else n
  hf = {
      "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
      "vocab_size": config.vocab_size, "hidden_size": mla.hidden_size,
      "intermediate_size": config.intermediate_size, "num_hidden_layers": n,
      "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads,
      "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
      "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
      "qk_head_dim": mla.qk_head_dim, "head_dim": mla.qk_rope_head_dim,
      "v_head_dim": mla.v_head_dim, "hidden_act": "silu", "attention_bias": False,
      "rms_norm_eps": float(config.rms_norm_eps),
      "max_position_embeddings": mla.max_position_embeddings,
      "rope_parameters": _rope_parameters(config), "tie_word_embeddings": False,
      "first_k_dense_replace": min(dense, n),
  }
  if config.num_mtp_layers:
    hf["num_nextn_predict_layers"] = config.num_mtp_layers
  if model_type == "deepseek_v3":
    hf["rope_interleave"] = True
  else:
    hf.update(mlp_layer_types=["dense"] * dense + ["sparse"] * (n - dense),
              layer_types=["indexed_attention"] * n)
  if moe is not None:
    hf.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
              n_group=moe.n_group, topk_group=moe.topk_group,
              n_shared_experts=moe.n_shared_experts,
              moe_intermediate_size=moe.moe_intermediate_size,
              routed_scaling_factor=float(moe.routed_scaling_factor),
              norm_topk_prob=moe.norm_topk_prob)
  if mla.indexer is not None:
    hf.update(index_n_heads=mla.indexer.num_heads, index_head_dim=mla.indexer.head_dim,
              index_topk=mla.indexer.topk, indexer_rope_interleave=mla.indexer.rope_interleave)
    if model_type == "glm_moe_dsa":
      # GLM's releases list the MTP layers too, each running its own indexer.
      hf["indexer_types"] = (list(config.indexer_types or ("full",) * n) +
                             ["full"] * config.num_mtp_layers)
  reloaded = config_from_hf(hf, attention=config.attention)
  if mla.indexer is not None:  # the Hadamard flag is rederived on load, by design
    reloaded = dataclasses.replace(reloaded, mla=dataclasses.replace(
        reloaded.mla, indexer=dataclasses.replace(reloaded.mla.indexer,
                                                  use_hadamard=mla.indexer.use_hadamard)))
  problems = _differences(config, reloaded)
  if problems:
    raise ValueError("config cannot be expressed as an HF config.json: " + "; ".join(problems))
  return hf
