"""Frozen configuration of a complete decoder-only LM (DeepSeek-V3.2 / GLM-5 shape)."""

from __future__ import annotations

import dataclasses

from mla_jax.config import (IndexerConfig, MLAConfig, RopeConfig, YarnConfig, _positive_float,
                            _positive_int, _require)

ATTENTION_KINDS = ("mqa-only", "dense-capable")


def _int_at_least(value, low: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """DeepSeek MoE (SPEC.md section 11): sigmoid router, group-limited top-k, shared experts."""

  num_experts: int = 256
  num_experts_per_tok: int = 8
  n_group: int = 8
  topk_group: int = 4
  n_shared_experts: int = 1
  moe_intermediate_size: int = 2048
  routed_scaling_factor: float = 2.5
  norm_topk_prob: bool = True

  def __post_init__(self):
    for field in ("num_experts", "num_experts_per_tok", "n_group", "topk_group",
                  "moe_intermediate_size"):
      _positive_int(f"moe.{field}", getattr(self, field))
    _require(_int_at_least(self.n_shared_experts, 0), "moe.n_shared_experts",
             self.n_shared_experts, "an int >= 0")
    _require(self.num_experts % self.n_group == 0, "moe.n_group", self.n_group,
             f"a divisor of num_experts ({self.num_experts})")
    _require(self.topk_group <= self.n_group, "moe.topk_group", self.topk_group,
             f"<= n_group ({self.n_group})")
    per_group = self.num_experts // self.n_group
    _require(self.num_experts_per_tok <= self.topk_group * per_group, "moe.num_experts_per_tok",
             self.num_experts_per_tok, f"<= topk_group * experts per group "
             f"({self.topk_group * per_group})")
    _positive_float("moe.routed_scaling_factor", self.routed_scaling_factor)
    _require(isinstance(self.norm_topk_prob, bool), "moe.norm_topk_prob", self.norm_topk_prob,
             "a bool")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only LM: embeddings, ``num_layers`` x (RMSNorm, MLA, RMSNorm, MLP/MoE), LM head.

  Layers ``< first_k_dense_replace`` (and every layer when ``moe`` is None) use the dense
  SwiGLU MLP. ``attention`` picks the attention class: ``"mqa-only"`` is
  ``DeepseekV32Attention`` (the reference engine's choice), ``"dense-capable"`` is
  ``MLAAttention``. ``indexer_types`` (GLM-5.2's IndexShare) marks each layer "full" (runs
  its indexer) or "shared" (reuses the previous full layer's top-k); None means all full.
  """

  mla: MLAConfig
  vocab_size: int
  num_layers: int
  intermediate_size: int
  moe: MoEConfig | None = None
  first_k_dense_replace: int = 0
  attention: str = "mqa-only"
  rms_norm_eps: float = 1e-6
  indexer_types: tuple[str, ...] | None = None

  def __post_init__(self):
    _require(isinstance(self.mla, MLAConfig), "mla", self.mla, "an MLAConfig")
    for field in ("vocab_size", "num_layers", "intermediate_size"):
      _positive_int(field, getattr(self, field))
    _require(self.moe is None or isinstance(self.moe, MoEConfig), "moe", self.moe,
             "a MoEConfig or None")
    _require(_int_at_least(self.first_k_dense_replace, 0), "first_k_dense_replace",
             self.first_k_dense_replace, "an int >= 0")
    _require(self.attention in ATTENTION_KINDS, "attention", self.attention,
             f"one of {ATTENTION_KINDS}")
    _positive_float("rms_norm_eps", self.rms_norm_eps)
    if self.indexer_types is not None:
      types = self.indexer_types
      _require(isinstance(types, tuple) and len(types) == self.num_layers
               and set(types) <= {"full", "shared"}, "indexer_types", types,
               f"a tuple of {self.num_layers} 'full'/'shared' entries")
      _require(types[0] == "full", "indexer_types", types, "starting with a 'full' layer")
      _require(self.mla.indexer is not None, "indexer_types", types,
               "None for a model without an indexer")

  def shares_topk(self, layer: int) -> bool:
    return self.indexer_types is not None and self.indexer_types[layer] == "shared"

  def uses_moe(self, layer: int) -> bool:
    return self.moe is not None and layer >= self.first_k_dense_replace


def tiny_lm(attention: str = "mqa-only", *, moe: bool = True) -> ModelConfig:
  """The built-in CPU model: 2 layers (dense MLP then MoE), byte-level vocabulary."""
  mla = MLAConfig(hidden_size=128, num_heads=4, q_lora_rank=64, kv_lora_rank=64,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  rope=RopeConfig(theta=10000.0), max_position_embeddings=4096,
                  indexer=IndexerConfig(num_heads=4, head_dim=32, topk=16))
  moe_cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                      n_shared_experts=1, moe_intermediate_size=64) if moe else None
  return ModelConfig(mla=mla, vocab_size=260, num_layers=2, intermediate_size=256,
                     moe=moe_cfg, first_k_dense_replace=1, attention=attention)


def small_lm(attention: str = "mqa-only") -> ModelConfig:
  """A larger CPU-sized config for benchmarks: 4 layers, 256 wide, top-k 64, YaRN RoPE."""
  mla = MLAConfig(hidden_size=256, num_heads=8, q_lora_rank=128, kv_lora_rank=128,
                  qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                  rope=RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0,
                                                                 original_max_position_embeddings=1024)),
                  max_position_embeddings=8192,
                  indexer=IndexerConfig(num_heads=8, head_dim=64, topk=64))
  return ModelConfig(mla=mla, vocab_size=260, num_layers=4, intermediate_size=512,
                     moe=MoEConfig(num_experts=16, num_experts_per_tok=4, n_group=4,
                                   topk_group=2, moe_intermediate_size=128),
                     first_k_dense_replace=1, attention=attention)
