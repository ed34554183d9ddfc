"""Latent rows stored in fp8 (FlashMLA / vLLM ``fp8_ds_mla``), as the sparse MQA ops read them.

A logical row of L = A + R values (latent | RoPE) is held in three arrays with the same leading
axes:

* ``values``  [..., A] float8_e4m3fn: the latent divided by its tile's scale;
* ``scales``  [..., Z] float32: one scale per tile of ``A / Z`` consecutive latent values;
* ``rope``    [..., R] bfloat16: the RoPE part, not quantized (it carries the position).

DeepSeek-V3.2 / GLM-5 (A 512, R 64, tiles of 128) take 512 + 4 * 4 + 64 * 2 = 656 bytes a row.
Dequantizing is ``values * scale`` per tile, next to the RoPE part. The scales written by
``mla_jax.fp8_cache`` are powers of two, so a dequantized value is exact in bfloat16.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _checks

FP8 = jnp.float8_e4m3fn


class Fp8LatentRows(NamedTuple):
  """fp8 latent rows: ``values`` [..., S, A] e4m3, ``scales`` [..., S, Z] float32, ``rope``
  [..., S, R] (bfloat16 in the cache). A pytree, so it passes through ``vmap``, ``jit`` and
  ``shard_map`` like one array."""

  values: jax.Array
  scales: jax.Array
  rope: jax.Array

  @property
  def num_rows(self) -> int:
    return self.values.shape[-2]

  @property
  def latent_width(self) -> int:
    return self.values.shape[-1]

  @property
  def width(self) -> int:
    """L = A + R, the width of a dequantized row."""
    return self.values.shape[-1] + self.rope.shape[-1]

  @property
  def tile(self) -> int:
    """Latent values per scale."""
    return self.values.shape[-1] // self.scales.shape[-1]


def dequantize_rows(rows: Fp8LatentRows, dtype):
  """The rows [..., S, A + R] in ``dtype``: each latent tile times its scale, then RoPE."""
  *lead, a = rows.values.shape
  tiles = rows.values.astype(jnp.float32).reshape(*lead, rows.scales.shape[-1], rows.tile)
  latent = (tiles * rows.scales[..., None].astype(jnp.float32)).reshape(*lead, a)
  return jnp.concatenate([latent.astype(dtype), rows.rope.astype(dtype)], axis=-1)


def validate_fp8_rows(op: str, name: str, rows: Fp8LatentRows) -> tuple[int, int, int, int]:
  """Per-sequence fp8 rows: ``values`` [S, A] e4m3, ``scales`` [S, Z] float32 with Z dividing
  A, ``rope`` [S, R] float. Returns ``(S, A, Z, R)``."""
  S, A = _checks.array(op, f"{name}.values", rows.values, "SA")
  _, Z = _checks.array(op, f"{name}.scales", rows.scales, "SZ")
  _, R = _checks.array(op, f"{name}.rope", rows.rope, "SR")
  if rows.scales.shape[0] != S or rows.rope.shape[0] != S:
    raise ValueError(f"{op}: {name} parts hold different row counts: values {S}, scales "
                     f"{rows.scales.shape[0]}, rope {rows.rope.shape[0]}")
  if rows.values.dtype != FP8:
    raise TypeError(f"{op}: {name}.values must be float8_e4m3fn, got {rows.values.dtype}")
  if rows.scales.dtype != jnp.float32:
    raise TypeError(f"{op}: {name}.scales must be float32, got {rows.scales.dtype}")
  _checks.float_dtype(op, f"{name}.rope", rows.rope)
  if A == 0 or Z == 0 or A % Z:
    raise ValueError(f"{op}: {name} has {Z} scales per row for {A} latent values; the scales "
                     "must split the latent into equal tiles")
  return S, A, Z, R
