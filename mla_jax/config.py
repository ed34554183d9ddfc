"""Frozen configurations for MLA attention and its lightning indexer, with presets.

Every field is validated at construction: a bad value raises ``ValueError`` naming the field
and the value, so a typo fails here rather than deep inside a trace.
"""

from __future__ import annotations

import dataclasses
import math


def require(condition: bool, field: str, value, expectation: str) -> None:
  if not condition:
    raise ValueError(f"{field} must be {expectation}, got {value!r}")


def positive_int(field: str, value) -> None:
  require(isinstance(value, int) and not isinstance(value, bool) and value > 0, field, value,
          "a positive int")


def _finite_number(value) -> bool:
  """A real int or float that is neither inf nor nan (bools are not numbers here)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_float(field: str, value) -> None:
  require(_finite_number(value) and value > 0, field, value, "a positive finite number")


def _number_at_least(field: str, value, low: float) -> None:
  require(_finite_number(value) and value >= low, field, value, f"a finite number >= {low:g}")


@dataclasses.dataclass(frozen=True)
class YarnConfig:
  """YaRN context extension (docs/design.md §3); HF's rule: applied whenever configured."""

  factor: float = 40.0
  original_max_position_embeddings: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 1.0

  def __post_init__(self):
    _number_at_least("yarn.factor", self.factor, 1)
    positive_int("yarn.original_max_position_embeddings", self.original_max_position_embeddings)
    positive_float("yarn.beta_fast", self.beta_fast)
    positive_float("yarn.beta_slow", self.beta_slow)
    require(self.beta_fast > self.beta_slow, "yarn.beta_fast", self.beta_fast,
            f"> beta_slow ({self.beta_slow})")
    _number_at_least("yarn.mscale", self.mscale, 0)
    _number_at_least("yarn.mscale_all_dim", self.mscale_all_dim, 0)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10000.0
  yarn: YarnConfig | None = None

  def __post_init__(self):
    positive_float("rope.theta", self.theta)
    require(self.yarn is None or isinstance(self.yarn, YarnConfig), "rope.yarn", self.yarn,
            "a YarnConfig or None")


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
  """The lightning indexer (docs/design.md §5).

  ``rope_interleave`` picks the indexer's RoPE pairing: False is NeoX / half-split
  (DeepSeek-V3.2, after DeepSeek's 2025-11-17 fix), True is interleaved (GLM-5).
  """

  num_heads: int = 64
  head_dim: int = 128
  topk: int = 2048
  rope_interleave: bool = False
  use_hadamard: bool = True
  norm_eps: float = 1e-6

  def __post_init__(self):
    positive_int("indexer.num_heads", self.num_heads)
    positive_int("indexer.head_dim", self.head_dim)
    positive_int("indexer.topk", self.topk)
    require(isinstance(self.rope_interleave, bool), "indexer.rope_interleave",
            self.rope_interleave, "a bool")
    require(isinstance(self.use_hadamard, bool), "indexer.use_hadamard", self.use_hadamard,
            "a bool")
    if self.use_hadamard:
      require(self.head_dim & (self.head_dim - 1) == 0, "indexer.head_dim", self.head_dim,
              "a power of two when use_hadamard is True")
    positive_float("indexer.norm_eps", self.norm_eps)

  @property
  def score_scale(self) -> float:
    """I**-0.5 * G**-0.5, folded into the head weights (docs/design.md §4)."""
    return self.head_dim**-0.5 * self.num_heads**-0.5


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention dims (docs/design.md §1-2), optionally with an indexer.

  ``latent_norm_eps`` is the eps of the two latent RMSNorms (``q_a_layernorm``,
  ``kv_a_layernorm``). Hugging Face's DeepSeek-V3/V3.2 and GLM-5 code (and DeepSeek's own)
  fix it at 1e-6 whatever ``rms_norm_eps`` says; vLLM and SGLang pass ``rms_norm_eps``
  instead (1e-5 for GLM-5), so set it to that value to match those engines.
  """

  hidden_size: int = 7168
  num_heads: int = 128
  q_lora_rank: int = 1536
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
  max_position_embeddings: int = 163840
  latent_norm_eps: float = 1e-6
  indexer: IndexerConfig | None = None

  def __post_init__(self):
    for field in ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
      positive_int(field, getattr(self, field))
    require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim, "even")
    require(isinstance(self.rope, RopeConfig), "rope", self.rope, "a RopeConfig")
    positive_float("latent_norm_eps", self.latent_norm_eps)
    require(self.indexer is None or isinstance(self.indexer, IndexerConfig), "indexer",
            self.indexer, "an IndexerConfig or None")
    if self.indexer is not None:
      require(self.indexer.head_dim >= self.qk_rope_head_dim, "indexer.head_dim",
              self.indexer.head_dim, f">= qk_rope_head_dim ({self.qk_rope_head_dim})")

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def latent_dim(self) -> int:
    """Width of one latent cache row: [c_kv (A) | k_pe (R)], 576 for DeepSeek-V3.2."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    """(N+R)**-0.5 * m**2, YaRN's m = 0.1 * mscale_all_dim * ln(factor) + 1 (docs/design.md §4)."""
    scale = self.qk_head_dim**-0.5
    yarn = self.rope.yarn
    if yarn is not None and yarn.mscale_all_dim and yarn.factor > 1:
      m = 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0
      scale *= m * m
    return scale


def deepseek_v32() -> MLAConfig:
  """DeepSeek-V3.2 full sizes: YaRN RoPE, indexer with NeoX pairing."""
  return MLAConfig(rope=RopeConfig(theta=10000.0, yarn=YarnConfig()),
                   indexer=IndexerConfig(num_heads=64, head_dim=128, topk=2048,
                                         rope_interleave=False))


def glm5() -> MLAConfig:
  """GLM-5 / 5.1: qk 192+64, v 256, 64 heads, plain RoPE theta 1e6, interleaved indexer RoPE."""
  return MLAConfig(hidden_size=6144, num_heads=64, q_lora_rank=2048, kv_lora_rank=512,
                   qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                   rope=RopeConfig(theta=1e6), max_position_embeddings=202752,
                   indexer=IndexerConfig(num_heads=32, head_dim=128, topk=2048,
                                         rope_interleave=True))


def deepseek_v3() -> MLAConfig:
  """DeepSeek-V3: MLA without an indexer (dense attention)."""
  return MLAConfig(rope=RopeConfig(theta=10000.0, yarn=YarnConfig()))


def tiny() -> MLAConfig:
  """A CPU-sized DSA layer; top-k 16 so that short sequences already exercise sparsity.

  Every width is a power of two so the same config also runs through the Pallas kernels.
  """
  return MLAConfig(hidden_size=128, num_heads=4, q_lora_rank=64, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                   rope=RopeConfig(theta=10000.0), max_position_embeddings=4096,
                   indexer=IndexerConfig(num_heads=4, head_dim=32, topk=16,
                                         rope_interleave=False))


PRESETS = {"deepseek_v32": deepseek_v32, "glm5": glm5, "deepseek_v3": deepseek_v3, "tiny": tiny}
