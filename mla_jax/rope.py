"""Rotary position embeddings: both pairings, YaRN frequencies and magnitude (docs/design.md §3).

The main attention rotates adjacent pairs (2i, 2i+1) ("interleaved", GPT-J style) in both
models. The indexer rotates pairs (i, i + R/2) ("NeoX", half-split) for DeepSeek-V3.2 and
interleaved pairs for GLM-5: the same frequency table, a different pairing. Mixing them up
crashes nothing and silently loses long-context quality (vLLM #28968, SGLang #13495).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from mla_jax.config import RopeConfig, YarnConfig


def yarn_mscale(factor: float, mscale: float) -> float:
  """HF's ``get_mscale``: 0.1 * mscale * ln(factor) + 1 when the context is extended."""
  if factor <= 1:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


def yarn_correction_range(yarn: YarnConfig, rope_dim: int, theta: float) -> tuple[int, int]:
  """The (low, high) dims of the YaRN ramp; (10, 23) for DeepSeek-V3.2."""

  def corr_dim(num_rotations: float) -> float:
    return (rope_dim * math.log(yarn.original_max_position_embeddings /
                                (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

  low = math.floor(corr_dim(yarn.beta_fast))
  high = math.ceil(corr_dim(yarn.beta_slow))
  return max(low, 0), min(high, rope_dim - 1)


def rope_inv_freq(rope: RopeConfig, rope_dim: int) -> np.ndarray:
  """Per-pair angular frequencies theta'_i (float64), YaRN-corrected when configured."""
  base = rope.theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
  if rope.yarn is None:
    return base
  low, high = yarn_correction_range(rope.yarn, rope_dim, rope.theta)
  span = high - low if high != low else 0.001  # HF nudges a degenerate ramp the same way
  ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / span, 0.0, 1.0)
  return base / rope.yarn.factor * ramp + base * (1.0 - ramp)


def rope_attention_factor(rope: RopeConfig) -> float:
  """Magnitude applied to cos/sin; 1 for every DeepSeek config (mscale == mscale_all_dim)."""
  if rope.yarn is None:
    return 1.0
  yarn = rope.yarn
  return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)


_SPLIT = 1024  # positions are split as hi * _SPLIT + lo for the angle tables


def _cos_sin(positions, rope: RopeConfig, rope_dim: int, max_position: int):
  """cos/sin of position * theta'_i, accurate to float32 rounding at any position.

  A float32 product ``position * theta`` loses ~1e-3 rad by position 160K. Instead, two
  float64 tables (angles of ``hi * 1024`` and of ``lo``, reduced mod 2 pi on the host) are
  combined with the angle-addition formulas.
  """
  inv_freq = rope_inv_freq(rope, rope_dim)
  num_hi = -(-max_position // _SPLIT)
  hi_angles = np.mod(np.arange(num_hi)[:, None] * _SPLIT * inv_freq[None, :], 2 * np.pi)
  lo_angles = np.arange(_SPLIT)[:, None] * inv_freq[None, :]
  hi, lo = positions // _SPLIT, positions % _SPLIT
  cos_hi, sin_hi = (jnp.asarray(f(hi_angles), jnp.float32)[hi] for f in (np.cos, np.sin))
  cos_lo, sin_lo = (jnp.asarray(f(lo_angles), jnp.float32)[lo] for f in (np.cos, np.sin))
  factor = rope_attention_factor(rope)
  cos = (cos_hi * cos_lo - sin_hi * sin_lo) * factor
  sin = (sin_hi * cos_lo + cos_hi * sin_lo) * factor
  return cos, sin


def apply_rope(x, positions, rope: RopeConfig, *, interleaved: bool, max_position: int,
               inverse: bool = False):
  """Rotates the last axis of ``x`` (R wide) by position.

  Args:
    x: [..., T, (heads,) R]; the rope slice only.
    positions: int [..., T], broadcast against x's leading axes, each in
      ``[0, max_position)``: the angle tables end there, and a position outside reads a
      clamped or wrapped table row (a wrong angle, silently). They are not checked here,
      since padding rows may lie past the end and are never stored; callers check their
      real rows (``MLAAttentionBase`` does, through ``mla_jax.checks.new_tokens``).
    rope: frequency configuration.
    interleaved: pairs (2i, 2i+1) if True, else (i, i + R/2).
    max_position: exclusive bound on positions (the config's max_position_embeddings).
    inverse: rotate by minus the angle (DeepSeek-V4 takes a value's rotation back out of an
      attention output this way).

  Returns:
    The rotated array in x's dtype, computed in float32.
  """
  rope_dim = x.shape[-1]
  cos, sin = _cos_sin(positions, rope, rope_dim, max_position)  # [..., T, R/2]
  if inverse:
    sin = -sin
  if x.ndim == positions.ndim + 2:  # a heads axis sits between T and R
    cos, sin = cos[..., None, :], sin[..., None, :]
  xf = x.astype(jnp.float32)
  if interleaved:
    real, imag = xf[..., 0::2], xf[..., 1::2]
  else:
    real, imag = xf[..., : rope_dim // 2], xf[..., rope_dim // 2:]
  rot_real = real * cos - imag * sin
  rot_imag = real * sin + imag * cos
  if interleaved:
    out = jnp.stack([rot_real, rot_imag], axis=-1).reshape(xf.shape)
  else:
    out = jnp.concatenate([rot_real, rot_imag], axis=-1)
  return out.astype(x.dtype)
