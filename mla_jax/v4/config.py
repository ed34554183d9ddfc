"""``V4Config``: a frozen DeepSeek-V4 configuration, validated field by field.

Field names follow Hugging Face's ``DeepseekV4Config`` (transformers 5.25) where they exist;
``main_rope`` / ``compress_rope`` are its ``rope_parameters["main"]`` / ``["compress"]``.
"""

from __future__ import annotations

import dataclasses

from mla_jax.config import RopeConfig, positive_float, positive_int, require

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class V4Config:
  vocab_size: int = 129280
  hidden_size: int = 4096
  moe_intermediate_size: int = 2048
  num_attention_heads: int = 64
  head_dim: int = 512
  rope_dim: int = 64
  q_lora_rank: int = 1024
  o_groups: int = 8
  o_lora_rank: int = 1024
  sliding_window: int = 128
  csa_ratio: int = 4
  hca_ratio: int = 128
  index_n_heads: int = 64
  index_head_dim: int = 128
  index_topk: int = 512
  layer_types: tuple[str, ...] = (HCA, HCA, SLIDING, CSA)
  mlp_layer_types: tuple[str, ...] = (HASH_MOE, HASH_MOE, HASH_MOE, MOE)
  n_routed_experts: int = 256
  num_experts_per_tok: int = 6
  scoring_func: str = "sqrtsoftplus"
  routed_scaling_factor: float = 1.5
  swiglu_limit: float = 10.0
  hc_mult: int = 4
  hc_sinkhorn_iters: int = 20
  hc_eps: float = 1e-6
  rms_norm_eps: float = 1e-6
  main_rope: RopeConfig = RopeConfig(theta=10000.0)
  compress_rope: RopeConfig = RopeConfig(theta=160000.0)
  max_position_embeddings: int = 1048576
  tie_word_embeddings: bool = False
  num_mtp_layers: int = 0  # MTP layers held beside the model (mla_jax.v4.mtp)

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads",
                 "head_dim", "rope_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                 "sliding_window", "csa_ratio", "hca_ratio", "index_n_heads", "index_head_dim",
                 "index_topk", "n_routed_experts", "num_experts_per_tok", "hc_mult",
                 "hc_sinkhorn_iters", "max_position_embeddings"):
      positive_int(name, getattr(self, name))
    require(type(self.num_mtp_layers) is int and self.num_mtp_layers >= 0, "num_mtp_layers",
            self.num_mtp_layers, "an int >= 0")
    for name in ("routed_scaling_factor", "swiglu_limit", "hc_eps", "rms_norm_eps"):
      positive_float(name, getattr(self, name))
    require(self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim, "rope_dim",
            self.rope_dim, f"even and <= head_dim ({self.head_dim})")
    require(self.rope_dim <= self.index_head_dim, "rope_dim", self.rope_dim,
            f"<= index_head_dim ({self.index_head_dim}): the indexer rotates it too")
    require(self.num_attention_heads % self.o_groups == 0, "o_groups", self.o_groups,
            f"a divisor of num_attention_heads ({self.num_attention_heads})")
    require(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
            self.num_experts_per_tok, f"<= n_routed_experts ({self.n_routed_experts})")
    require(self.scoring_func in SCORING_FUNCS, "scoring_func", self.scoring_func,
            f"one of {SCORING_FUNCS}")
    require(isinstance(self.layer_types, tuple) and len(self.layer_types) > 0
            and all(t in LAYER_TYPES for t in self.layer_types), "layer_types",
            self.layer_types, f"a non-empty tuple of {LAYER_TYPES}")
    require(isinstance(self.mlp_layer_types, tuple)
            and len(self.mlp_layer_types) == len(self.layer_types)
            and all(t in MLP_LAYER_TYPES for t in self.mlp_layer_types), "mlp_layer_types",
            self.mlp_layer_types,
            f"a tuple of {MLP_LAYER_TYPES}, one per layer ({len(self.layer_types)})")
    for name in ("main_rope", "compress_rope"):
      require(isinstance(getattr(self, name), RopeConfig), name, getattr(self, name),
              "a RopeConfig")

  @property
  def num_layers(self) -> int:
    return len(self.layer_types)

  def compress_ratio(self, layer_type: str) -> int:
    """Tokens pooled into one compressed entry by a layer of this type; 0: none."""
    return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[layer_type]


def tiny_v4_config(**overrides) -> V4Config:
  """A few-layer V4 with every layer type and both MoE kinds, small enough for CPU tests."""
  fields = dict(
      vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
      head_dim=32, rope_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=16, sliding_window=8,
      csa_ratio=4, hca_ratio=8, index_n_heads=4, index_head_dim=16, index_topk=4,
      layer_types=(SLIDING, CSA, HCA, CSA), mlp_layer_types=(HASH_MOE, MOE, MOE, MOE),
      n_routed_experts=8, num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=5,
      max_position_embeddings=4096)
  fields.update(overrides)
  return V4Config(**fields)
