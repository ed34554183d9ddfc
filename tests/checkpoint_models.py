"""Small model configs and NumPy-random models shared by the checkpoint tests."""

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mla_jax.checkpoints import open_checkpoint, save_pretrained, write_safetensors

from mla_jax.config import IndexerConfig, MLAConfig, RopeConfig, YarnConfig
from mla_jax.models.config import MoEConfig, ModelConfig
from mla_jax.models.lm import CausalLM
from mla_jax.params import dotted_name
from mla_jax.plan import FP8_WEIGHTS

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


def random_model(config: ModelConfig, seed: int = 0, round_to=None,
                 param_dtype=jnp.float32) -> CausalLM:
  """A model with NumPy-drawn parameters (fast: no per-shape random kernels to compile)."""
  abstract = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))
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


def fp8_config() -> ModelConfig:
  """Widths that give ragged 128-blocks (hidden 200, q_lora 136, kv_lora 96) while the
  dimensions split over ``tensor=2`` hold whole blocks (heads x 128 rows, intermediates 256)."""
  indexer = IndexerConfig(num_heads=2, head_dim=64, topk=TOPK)
  mla = MLAConfig(hidden_size=200, num_heads=4, q_lora_rank=136, kv_lora_rank=96,
                  qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                  rope=RopeConfig(theta=10000.0), max_position_embeddings=256, indexer=indexer)
  moe = MoEConfig(num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                  n_shared_experts=1, moe_intermediate_size=256)
  return ModelConfig(mla=mla, vocab_size=256, num_layers=3, intermediate_size=256, moe=moe,
                     first_k_dense_replace=1)


def quantize_fp8(w: np.ndarray, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
  """e4m3 values and float32 ``weight_scale_inv`` (block amax / 448), as DeepSeek stores them."""
  rows, cols = w.shape
  grid = (-(-rows // block[0]), -(-cols // block[1]))
  padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
  padded[:rows, :cols] = w
  tiles = padded.reshape(grid[0], block[0], grid[1], block[1])
  scale = (np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-4) / 448.0).astype(np.float32)
  values = (tiles / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
  return values.astype(ml_dtypes.float8_e4m3fn), scale


def write_fp8_checkpoint(model: CausalLM, path, block=(128, 128)) -> None:
  """``model`` saved with the weights DeepSeek's fp8 release quantizes (``plan.FP8_WEIGHTS``)
  as e4m3 + block scales, and the ``quantization_config`` that says so."""
  save_pretrained(model, path)
  tensors = {name: handle.read() for name, handle in open_checkpoint(path).items()}
  for name in [n for n in tensors if FP8_WEIGHTS.search(n)]:
    tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensors.pop(name), block)
  write_safetensors(tensors, Path(path) / "model.safetensors", {"format": "pt"})
  hf = json.loads((Path(path) / "config.json").read_text())
  hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                               "fmt": "e4m3", "weight_block_size": list(block)}
  (Path(path) / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
