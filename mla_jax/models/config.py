"""Frozen configuration of a complete decoder-only LM (DeepSeek-V3.2 / GLM-5 shape)."""

from __future__ import annotations

import dataclasses

from mla_jax.config import (IndexerConfig, MLAConfig, RopeConfig, YarnConfig, positive_float,
                            positive_int, require, deepseek_v3, deepseek_v32, glm5)

ATTENTION_KINDS = ("mqa-only", "dense-capable")


def _int_at_least(value, low: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """DeepSeek MoE (docs/design.md §9): sigmoid router, group-limited top-k, shared experts."""

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
      positive_int(f"moe.{field}", getattr(self, field))
    require(_int_at_least(self.n_shared_experts, 0), "moe.n_shared_experts",
            self.n_shared_experts, "an int >= 0")
    require(self.num_experts % self.n_group == 0, "moe.n_group", self.n_group,
            f"a divisor of num_experts ({self.num_experts})")
    require(self.topk_group <= self.n_group, "moe.topk_group", self.topk_group,
            f"<= n_group ({self.n_group})")
    per_group = self.num_experts // self.n_group
    require(self.num_experts_per_tok <= self.topk_group * per_group, "moe.num_experts_per_tok",
            self.num_experts_per_tok, f"<= topk_group * experts per group "
            f"({self.topk_group * per_group})")
    positive_float("moe.routed_scaling_factor", self.routed_scaling_factor)
    require(isinstance(self.norm_topk_prob, bool), "moe.norm_topk_prob", self.norm_topk_prob,
            "a bool")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only LM: embeddings, ``num_layers`` x (RMSNorm, MLA, RMSNorm, MLP/MoE), LM head.

  Layers ``< first_k_dense_replace`` (and every layer when ``moe`` is None) use the dense
  SwiGLU MLP. ``attention`` picks the attention class: ``"mqa-only"`` is
  ``DeepseekV32Attention`` (the reference engine's choice), ``"dense-capable"`` is
  ``MLAAttention``. ``indexer_types`` (GLM-5.2's IndexShare) marks each layer "full" (runs
  its indexer) or "shared" (reuses the previous full layer's top-k); None means all full.
  ``num_mtp_layers`` multi-token-prediction layers (``mla_jax.models.mtp``, HF's
  ``num_nextn_predict_layers``) follow as layers ``num_layers + i``: each has its MLP by the
  same rule and always its own indexer (it has no full layer of its own pass to share with).
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
  num_mtp_layers: int = 0

  def __post_init__(self):
    require(isinstance(self.mla, MLAConfig), "mla", self.mla, "an MLAConfig")
    for field in ("vocab_size", "num_layers", "intermediate_size"):
      positive_int(field, getattr(self, field))
    require(self.moe is None or isinstance(self.moe, MoEConfig), "moe", self.moe,
            "a MoEConfig or None")
    require(_int_at_least(self.first_k_dense_replace, 0), "first_k_dense_replace",
            self.first_k_dense_replace, "an int >= 0")
    require(self.attention in ATTENTION_KINDS, "attention", self.attention,
            f"one of {ATTENTION_KINDS}")
    positive_float("rms_norm_eps", self.rms_norm_eps)
    require(_int_at_least(self.num_mtp_layers, 0), "num_mtp_layers", self.num_mtp_layers,
            "an int >= 0")
    if self.indexer_types is not None:
      types = self.indexer_types
      require(isinstance(types, tuple) and len(types) == self.num_layers
              and set(types) <= {"full", "shared"}, "indexer_types", types,
              f"a tuple of {self.num_layers} 'full'/'shared' entries")
      require(types[0] == "full", "indexer_types", types, "starting with a 'full' layer")
      require(self.mla.indexer is not None, "indexer_types", types,
              "None for a model without an indexer")

  def shares_topk(self, layer: int) -> bool:
    """Layer ``layer`` reuses a full layer's top-k (never an MTP layer, ``>= num_layers``)."""
    return (self.indexer_types is not None and layer < self.num_layers
            and self.indexer_types[layer] == "shared")

  def uses_moe(self, layer: int) -> bool:
    return self.moe is not None and layer >= self.first_k_dense_replace

  def layer_kind(self, layer: int) -> tuple[bool, bool]:
    """What makes two decoder layers structurally different: (MoE MLP?, shared top-k?)."""
    return self.uses_moe(layer), self.shares_topk(layer)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """``reps`` consecutive repetitions of a unit of ``unit_len`` layers, from layer ``first``.

  Layer ``first + r * unit_len + u`` is position u of repetition r; a group runs as one
  ``scan`` over its repetitions, whose parameters are stacked on a leading axis.
  """

  first: int
  unit_len: int
  reps: int

  def layer(self, rep: int, position: int) -> int:
    return self.first + rep * self.unit_len + position

  @property
  def end(self) -> int:
    return self.first + self.unit_len * self.reps

  @staticmethod
  def locate(groups: tuple[LayerGroup, ...], index: int) -> tuple[int, int, int]:
    """``(group, repetition, position in the unit)`` of layer ``index`` among ``groups``."""
    for g, group in enumerate(groups):
      if group.first <= index < group.end:
        rep, position = divmod(index - group.first, group.unit_len)
        return g, rep, position
    raise IndexError(f"layer {index} out of range for {groups[-1].end if groups else 0} layers")


def layer_groups(config: ModelConfig, max_unit_len: int = 8) -> tuple[LayerGroup, ...]:
  """Consecutive layers split into groups of identically structured repeating units.

  Greedy from the first layer: the unit (up to ``max_unit_len`` layers) that repeats over the
  most layers wins, ties to the shorter unit; a layer that starts no repetition is a group of
  its own. DeepSeek-V3.2 gives [dense] x 3 + [MoE] x 58;
  GLM-5.2's indexer pattern F F F S S S (F S S S) x 18 S S S gives three groups, so compile
  time follows the number of groups, not the depth.
  """
  kinds = [config.layer_kind(i) for i in range(config.num_layers)]
  groups, start = [], 0
  while start < len(kinds):
    best = (1, 1)
    for unit_len in range(1, min(max_unit_len, len(kinds) - start) + 1):
      unit = kinds[start:start + unit_len]
      reps = 1
      while kinds[start + reps * unit_len:start + (reps + 1) * unit_len] == unit:
        reps += 1
      if reps > 1 and unit_len * reps > best[0] * best[1]:
        best = (unit_len, reps)
    groups.append(LayerGroup(start, *best))
    start += best[0] * best[1]
  return tuple(groups)


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


def tiny_moe_lm(attention: str = "mqa-only") -> ModelConfig:
  """A tiny MoE model whose widths split 8 ways: 8 heads, 8 experts, vocabulary 264.

  For sharding tests on up to 8 devices (any of data / tensor / expert up to 8).
  """
  mla = MLAConfig(hidden_size=128, num_heads=8, q_lora_rank=64, kv_lora_rank=64,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                  rope=RopeConfig(theta=10000.0), max_position_embeddings=4096,
                  indexer=IndexerConfig(num_heads=4, head_dim=32, topk=16))
  return ModelConfig(mla=mla, vocab_size=264, num_layers=3, intermediate_size=256,
                     moe=MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=4,
                                   topk_group=2, moe_intermediate_size=64),
                     first_k_dense_replace=1, attention=attention)


def small_lm(attention: str = "mqa-only") -> ModelConfig:
  """A larger CPU-sized config for benchmarks: 4 layers, 256 wide, top-k 64, YaRN RoPE."""
  mla = MLAConfig(hidden_size=256, num_heads=8, q_lora_rank=128, kv_lora_rank=128,
                  qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                  rope=RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0,
                                                                 original_max_position_embeddings=1024)),
                  max_position_embeddings=8192,
                  indexer=IndexerConfig(num_heads=8, head_dim=64, topk=64))
  return ModelConfig(mla=mla, vocab_size=264, num_layers=4, intermediate_size=512,
                     moe=MoEConfig(num_experts=16, num_experts_per_tok=4, n_group=4,
                                   topk_group=2, moe_intermediate_size=128),
                     first_k_dense_replace=1, attention=attention)


def deepseek_v32_lm(attention: str = "mqa-only") -> ModelConfig:
  """DeepSeek-V3.2 at full size (671B parameters; for plans and lowering, not for CPUs)."""
  return ModelConfig(mla=deepseek_v32(), vocab_size=129280, num_layers=61,
                     intermediate_size=18432, moe=MoEConfig(), first_k_dense_replace=3,
                     attention=attention, rms_norm_eps=1e-6)


def glm5_lm(attention: str = "mqa-only") -> ModelConfig:
  """GLM-5 at full size: 78 layers, 256 experts (top-8, one group), every layer indexed."""
  return ModelConfig(mla=glm5(), vocab_size=154880, num_layers=78, intermediate_size=12288,
                     moe=MoEConfig(n_group=1, topk_group=1), first_k_dense_replace=3,
                     attention=attention, rms_norm_eps=1e-5)


def deepseek_v3_lm(attention: str = "dense-capable") -> ModelConfig:
  """DeepSeek-V3 at full size: MLA without an indexer."""
  return ModelConfig(mla=deepseek_v3(), vocab_size=129280, num_layers=61,
                     intermediate_size=18432, moe=MoEConfig(), first_k_dense_replace=3,
                     attention=attention, rms_norm_eps=1e-6)


FULL_SIZE = {"deepseek_v32": deepseek_v32_lm, "glm5": glm5_lm, "deepseek_v3": deepseek_v3_lm}
