"""Small model configs and NumPy-random models shared by the checkpoint tests."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.config import IndexerConfig, MLAConfig, RopeConfig, YarnConfig
from mla_jax.models.config import MoEConfig, ModelConfig
from mla_jax.models.lm import CausalLM
from mla_jax.params import dotted_name

TOPK = 4


def small_config(kind: str, attention: str = "mqa-only") -> ModelConfig:
  """'ds32' (YaRN, NeoX indexer), 'glm' (shared indexer layer, interleaved) or 'v3'."""
  indexer = IndexerConfig(num_heads=2, head_dim=32, topk=TOPK, rope_interleave=kind == "glm")
  rope = {"ds32": RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0,
                                                            original_max_position_embeddings=64)),
          "glm": RopeConfig(theta=8e6), "v3": RopeConfig(theta=10000.0)}[kind]
  mla = MLAConfig(hidden_size=64, num_heads=2, q_lora_rank=32, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, rope=rope,
                  max_position_embeddings=256, indexer=None if kind == "v3" else indexer)
  groups = 1 if kind == "glm" else 2
  moe = MoEConfig(num_experts=4, num_experts_per_tok=2, n_group=groups, topk_group=1,
                  n_shared_experts=1, moe_intermediate_size=32)
  return ModelConfig(mla=mla, vocab_size=64, num_layers=3 if kind == "glm" else 2,
                     intermediate_size=64, moe=moe, first_k_dense_replace=1,
                     attention=attention, rms_norm_eps=1e-5 if kind == "glm" else 1e-6,
                     indexer_types=("full", "shared", "full") if kind == "glm" else None)


def random_model(config: ModelConfig, seed: int = 0, round_to=None) -> CausalLM:
  """A model with NumPy-drawn parameters (fast: no per-shape random kernels to compile)."""
  abstract = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  rng = np.random.default_rng(seed)
  leaves = []
  for key, var in params.flat_state():
    name, noise = dotted_name(key), rng.standard_normal(var.shape)
    if "norm" in name:
      value = (1.0 if name.endswith("weight") else 0.0) + 0.1 * noise
    else:
      # [..., out, in] matrices (possibly stacked over layers or experts): 1/sqrt(fan-in).
      value = noise * (var.shape[-1] ** -0.5 if "proj" in name or name.endswith(
          ("embed_tokens.weight", "lm_head.weight", "gate.weight")) else 0.1)
    value = value.astype(round_to or np.float32).astype(var.dtype)
    leaves.append((key, var.replace(jnp.asarray(value))))
  return nnx.merge(graphdef, nnx.State.from_flat_path(leaves), rest)
