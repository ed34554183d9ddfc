"""Frozen block configurations of the Pallas-Triton kernels, with shape-based defaults.

"Which kernel" is chosen by the caller; this module only answers "which block sizes". Each
``default_for`` was checked with the PTX compile check (tests/kernels/test_compile.py) to
compile without register spills for sm_90a at the DeepSeek-V3.2 and GLM-5 shapes.
"""

from __future__ import annotations

import dataclasses


def next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def pow2_chunks(width: int) -> tuple[tuple[int, int], ...]:
  """``(start, size)`` power-of-two column chunks covering ``width``, widest first.

  576 -> (0, 512), (512, 64); 192 -> (0, 128), (128, 64); 48 -> (0, 32), (32, 16).
  """
  chunks, start = [], 0
  for bit in reversed(range(int(width).bit_length())):
    size = 1 << bit
    if width & size:
      chunks.append((start, size))
      start += size
  return tuple(chunks)


def _check_pow2(obj, *names):
  for name in names:
    value = getattr(obj, name)
    if not isinstance(value, int) or value < 1 or value & (value - 1):
      raise ValueError(f"{type(obj).__name__}.{name} must be a positive power of two, got {value!r}")


def _check_warps_stages(obj):
  _check_pow2(obj, "num_warps")
  if not isinstance(obj.num_stages, int) or obj.num_stages < 1:
    raise ValueError(f"{type(obj).__name__}.num_stages must be an int >= 1, got {obj.num_stages!r}")


@dataclasses.dataclass(frozen=True)
class SparseMQAKernelConfig:
  """One program: ``block_h`` heads of one token; the top-k row is walked ``block_k`` at a time."""

  block_h: int = 32
  block_k: int = 32
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    _check_pow2(self, "block_h", "block_k")
    _check_warps_stages(self)

  @classmethod
  def default_for(cls, num_heads: int, topk: int, d_v: int) -> SparseMQAKernelConfig:
    # Triton dots want M, N >= 16. The fp32 accumulator is block_h x d_v: at d_v = 512,
    # block_h = 64 spills even with 8 or 16 warps on sm_90a, so wide values use 32 heads.
    wide = d_v >= 256
    block_h = min(32 if wide else 64, max(16, next_pow2(num_heads)))
    block_k = min(32 if wide else 64, max(16, next_pow2(topk)))
    return cls(block_h=block_h, block_k=block_k, num_warps=8 if wide else 4, num_stages=2)


@dataclasses.dataclass(frozen=True)
class IndexerLogitsKernelConfig:
  """One program: a ``block_t`` x ``block_s`` logits tile; the G heads are looped inside."""

  block_t: int = 64
  block_s: int = 128
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    _check_pow2(self, "block_t", "block_s")
    _check_warps_stages(self)

  @classmethod
  def default_for(cls, num_tokens: int, num_keys: int) -> IndexerLogitsKernelConfig:
    block_t = min(64, max(16, next_pow2(num_tokens)))
    block_s = min(128, max(16, next_pow2(num_keys)))
    # A 64 x 128 fp32 tile plus the bf16 key tile spills a few bytes with 4 warps on sm_90a.
    return cls(block_t=block_t, block_s=block_s, num_warps=8, num_stages=2)

  @classmethod
  def backward_for(cls, num_tokens: int, num_keys: int) -> IndexerLogitsKernelConfig:
    """The blocks of both backward kernels (``pallas_kernels.indexer_logits_backward``):
    ``indexer_logits_dq`` programs own ``block_t`` tokens of one head and walk key blocks of
    ``block_s``; ``indexer_logits_dk`` programs own ``block_s`` keys and walk token blocks of
    ``block_t`` and every head."""
    block_t = min(64, max(16, next_pow2(num_tokens)))
    block_s = min(64, max(16, next_pow2(num_keys)))
    # With 4 warps at 64 x 64 both kernels spill on sm_90a (dq: the [64, 128] fp32 dq
    # accumulator beside the dots tile, 68 B; 144 B with fp8 keys widened to bf16).
    return cls(block_t=block_t, block_s=block_s, num_warps=8, num_stages=2)


@dataclasses.dataclass(frozen=True)
class DenseMHAKernelConfig:
  """One program: ``block_q`` queries of one head; keys are walked ``block_k`` at a time."""

  block_q: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _check_pow2(self, "block_q", "block_k")
    _check_warps_stages(self)

  @classmethod
  def default_for(cls, num_tokens: int, num_keys: int, d_qk: int, d_v: int) -> DenseMHAKernelConfig:
    block_q = min(64, max(16, next_pow2(num_tokens)))
    block_k = min(64, max(16, next_pow2(num_keys)))
    wide = max(d_qk, d_v) > 192
    return cls(block_q=block_q, block_k=block_k, num_warps=8 if wide else 4, num_stages=2)

  @classmethod
  def backward_for(cls, num_tokens: int, num_keys: int, d_qk: int,
                   d_v: int) -> tuple[DenseMHAKernelConfig, DenseMHAKernelConfig]:
    """The blocks of the two backward kernels (``pallas_kernels.dense_mha_backward``):
    ``(dq_config, dkv_config)``.

    Each program holds fp32 gradient accumulators for its own rows ([rows, Q], and [rows, V]
    for dk/dv) beside the q, k, v and dout blocks and two [block_q, block_k] tiles (p and ds).
    On sm_90a (tests/kernels/test_compile.py) 64 x 64 spills at Q 192; 64 own rows over
    32-row steps compile to wgmma without spills at Q 192, V 128 (dq: block_q 64, dkv:
    block_k 64), while 32-row programs use mma.sync. At Q = V = 256 (GLM-5) 64 own rows
    spill in both kernels, so those use 32 x 32.
    """
    rows = 64 if max(d_qk, d_v) <= 192 else 32
    step = 32
    clamp = lambda block, n: min(block, max(16, next_pow2(n)))
    warps = 8 if max(d_qk, d_v) > 128 else 4
    return (cls(block_q=clamp(rows, num_tokens), block_k=clamp(step, num_keys), num_warps=warps),
            cls(block_q=clamp(step, num_tokens), block_k=clamp(rows, num_keys), num_warps=warps))


@dataclasses.dataclass(frozen=True)
class SparseMQABackwardConfig:
  """The two backward kernels of sparse MQA. ``dq``: programs as the forward's (``block_h``
  heads of one token, the top-k walked ``block_k`` at a time). ``drows``: one program per
  ``block_k`` slots of one token, the heads walked ``block_h`` at a time."""

  dq: SparseMQAKernelConfig = SparseMQAKernelConfig()
  drows: SparseMQAKernelConfig = SparseMQAKernelConfig()

  def __post_init__(self):
    for name in ("dq", "drows"):
      if not isinstance(getattr(self, name), SparseMQAKernelConfig):
        raise TypeError(f"SparseMQABackwardConfig.{name} must be a SparseMQAKernelConfig, "
                        f"got {type(getattr(self, name)).__name__}")

  @classmethod
  def default_for(cls, num_heads: int, topk: int, d_v: int) -> SparseMQABackwardConfig:
    wide = d_v >= 256
    block_h = min(32, max(16, next_pow2(num_heads)))
    block_k = min(32, max(16, next_pow2(topk)))
    warps = 8 if wide else 4
    # At d_v 512 (sm_90a, 8 warps): dq at 32 x 32 takes 240 registers (255 with fp8 rows), no
    # spills, and 64 heads spill. drows holds a block_k x 576 fp32 accumulator and the block's
    # rows through the head loop: 32 slots take 254 registers, 16 take 166, 64 spill.
    return cls(dq=SparseMQAKernelConfig(block_h, block_k, warps, 2),
               drows=SparseMQAKernelConfig(block_h, 16 if wide else block_k, warps, 2))
