"""fp8 cache layouts and their quantization on write (FlashMLA / vLLM ``fp8_ds_mla``).

Latent rows (``Fp8LatentRows``): the latent c_kv as float8_e4m3fn with one float32 scale per
tile of ``latent_tile(A)`` values, and the RoPE part k_pe unquantized in bfloat16: 656 bytes a
token for A = 512, R = 64 (bf16: 1152). Indexer keys (``Fp8Keys``): e4m3 with one float32 scale
per token, quantized after the indexer's RoPE and Hadamard rotation: 132 bytes for I = 128.

Quantizing a tile (FlashMLA ``tests/quant.py``; DeepSeek ``act_quant`` with ue8m0 scales): its
amax, floored at 1e-4 so all-zero rows stay finite, over 448 (the largest e4m3 value), rounded
up to a power of two; stored = e4m3(x / scale), clipped to +-448. A power-of-two scale makes
``stored * scale`` exact in bfloat16, so dequantizing adds no rounding of its own.

In the cache the e4m3 values and the bfloat16 RoPE part are held as their bits (uint8,
uint16): XLA:CPU scatters 8- and 16-bit floats by converting the whole buffer to float32 and
back, which would copy every row of a layer's cache for each token written (76 ms instead of
3.5 ms a decode step at 16K capacity). ``readable`` views the rows read back as floats.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_rows import FP8, Fp8LatentRows, dequantize_rows

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
TILE = 128
ROPE_DTYPE = jnp.bfloat16


class Fp8Keys(NamedTuple):
  """Indexer keys: ``values`` [..., S, I] e4m3 and ``scales`` [..., S] float32, one a token."""

  values: jax.Array
  scales: jax.Array


def latent_tile(latent_width: int) -> int:
  """Latent values per scale: 128 (FlashMLA's tile) when it divides A, else the whole latent
  as one tile (the tiny presets' A = 64)."""
  return TILE if latent_width % TILE == 0 else latent_width


def power_of_two_scale(amax):
  """``max(amax, 1e-4) / 448`` rounded up to a power of two (exactly, through frexp)."""
  scale = jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) / E4M3_MAX
  mantissa, exponent = jnp.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
  return jnp.where(mantissa == 0.5, scale, jnp.ldexp(jnp.float32(1.0), exponent))


def quantize_tiles(x, tile: int):
  """``x`` [..., W] in tiles of ``tile`` values: ``(values [..., W] e4m3, scales [..., W/tile]
  float32)``."""
  *lead, width = x.shape
  if width % tile:
    raise ValueError(f"width {width} is not a multiple of the tile {tile}")
  tiles = x.astype(jnp.float32).reshape(*lead, width // tile, tile)
  scales = power_of_two_scale(jnp.abs(tiles).max(axis=-1))
  values = jnp.clip(tiles / scales[..., None], -E4M3_MAX, E4M3_MAX).astype(FP8)
  return values.reshape(*lead, width), scales


def quantize_latent(rows_BTL, latent_width: int, tile: int | None = None) -> Fp8LatentRows:
  """Rows [..., A + R] (latent | RoPE) in the fp8 layout, ``tile`` latent values a scale
  (default ``latent_tile(A)``)."""
  values, scales = quantize_tiles(rows_BTL[..., :latent_width], tile or latent_tile(latent_width))
  return Fp8LatentRows(values, scales, rows_BTL[..., latent_width:].astype(ROPE_DTYPE))


def quantize_keys(keys_BTI) -> Fp8Keys:
  """Indexer keys [..., I] with one scale per key."""
  values, scales = quantize_tiles(keys_BTI, keys_BTI.shape[-1])
  return Fp8Keys(values, scales[..., 0])


def dequantize_keys(keys: Fp8Keys, dtype=jnp.float32):
  return (keys.values.astype(jnp.float32) * keys.scales[..., None]).astype(dtype)


_BITS = {jnp.dtype(FP8): jnp.uint8, jnp.dtype(ROPE_DTYPE): jnp.uint16}


def _as_bits(part):
  """A cache part with its 8- and 16-bit float arrays bitcast to unsigned ints (stored form)."""
  return jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, _BITS[a.dtype])
                      if a.dtype in _BITS else a, part)


def readable(part):
  """A cache part as the ops read it: stored bits viewed as e4m3 values and bf16 RoPE; plain
  arrays and parts already readable pass through."""
  view = lambda a, dtype: a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)
  if isinstance(part, Fp8LatentRows):
    return Fp8LatentRows(view(part.values, FP8), part.scales, view(part.rope, ROPE_DTYPE))
  if isinstance(part, Fp8Keys):
    return Fp8Keys(view(part.values, FP8), part.scales)
  return part


def empty_latent(lead: tuple[int, ...], latent_width: int, rope_width: int,
                 tile: int | None = None):
  """Zero rows of the fp8 latent layout, ``lead`` [..., S] of them (stored), ``tile`` latent
  values a scale (default ``latent_tile(A)``)."""
  return _as_bits(Fp8LatentRows(
      jnp.zeros((*lead, latent_width), FP8),
      jnp.zeros((*lead, latent_width // (tile or latent_tile(latent_width))), jnp.float32),
      jnp.zeros((*lead, rope_width), ROPE_DTYPE)))


def empty_keys(lead: tuple[int, ...], head_dim: int) -> Fp8Keys:
  """Zero indexer keys, ``lead`` [..., S] of them (stored)."""
  return _as_bits(Fp8Keys(jnp.zeros((*lead, head_dim), FP8), jnp.zeros(lead, jnp.float32)))


def encode_like(stored, new_rows):
  """``new_rows`` (compute dtype, [..., T, X]) in the stored layout of the cache part
  ``stored``."""
  if isinstance(stored, Fp8LatentRows):
    return _as_bits(quantize_latent(new_rows, stored.latent_width, stored.tile))
  if isinstance(stored, Fp8Keys):
    return _as_bits(quantize_keys(new_rows))
  return new_rows.astype(stored.dtype)


def dense_latent(latent, dtype):
  """Latent rows [..., S, A + R] as one array in ``dtype`` (dequantized when fp8)."""
  if isinstance(latent, Fp8LatentRows):
    return dequantize_rows(latent, dtype)
  return latent.astype(dtype)


def quantize_indexer_queries(q_BTGI, w_BTG):
  """fp8 queries with one scale per (token, head), folded into the head weights.

  The scale is positive and ``relu(c * x) = c * relu(x)`` for ``c > 0``, so the fp8 scores
  with the folded weights equal the scores of the dequantized queries (DeepGEMM takes no
  q-scale input for this reason).
  """
  values, scales = quantize_tiles(q_BTGI, q_BTGI.shape[-1])
  return values, w_BTG * scales[..., 0]
