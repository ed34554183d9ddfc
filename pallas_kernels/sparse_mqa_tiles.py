"""The tile helpers that :mod:`pallas_kernels.sparse_mqa` and its backward share.

How a program reads one block of a token's top-k slots (valid slots and their clamped rows),
how it gathers and dequantizes fp8 latent rows in column chunks that stay inside one scale
tile, and the BlockSpec of a whole-array input. The backward kernels
(:mod:`pallas_kernels.sparse_mqa_backward`) read rows exactly as the forward does, so both
import these from here: the forward can then import its backward for its ``jax.custom_vjp``
without an import cycle.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.block_config import pow2_chunks


def slot_block(topk_ref, j, *, block_k, topk, num_rows):
  """Slots ``[j * block_k, (j + 1) * block_k)``: ``(valid_K, safe_K)``, invalid ones clamped
  to row 0 (and masked by every caller)."""
  slots_K = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
  idx_K = _compat.load(
      topk_ref.at[pl.ds(pl.multiple_of(j * block_k, block_k), block_k)],
      mask=slots_K < topk, other=-1,
  )
  valid_K = (idx_K >= 0) & (idx_K < num_rows)
  return valid_K, jnp.where(valid_K, idx_K, 0)


def latent_chunks(latent_width: int, tile: int):
  """``(start, width, tile index)`` power-of-two column chunks of the latent, none crossing a
  scale tile: A 512 in tiles of 128 -> four 128 chunks; A 96 in one tile -> 64 + 32."""
  return tuple((z * tile + c0, cw, z) for z in range(latent_width // tile)
               for c0, cw in pow2_chunks(tile))


def read_fp8_rows(values_ref, scales_ref, rope_ref, safe_K, valid_K, *, latent_chunks,
                  rope_chunks, dtype):
  """The gathered fp8 rows of one slot block as ``(latent, rope)`` lists of ``[block_k, width]``
  chunks, dequantized into ``dtype``.

  Dequantized before any dot; invalid slots read row 0 and become zeros whatever row 0 (values,
  scale or RoPE) holds, so NaN there never meets a probability.
  """
  keep_K1 = valid_K[:, None]
  latent = [
      jnp.where(keep_K1, values_ref[safe_K, pl.ds(c0, cw)].astype(jnp.float32)
                * scales_ref[safe_K, pl.ds(z, 1)], 0.0).astype(dtype)
      for c0, cw, z in latent_chunks
  ]
  rope = [jnp.where(keep_K1, rope_ref[safe_K, pl.ds(c0, cw)].astype(dtype), 0)
          for c0, cw in rope_chunks]
  return latent, rope


def whole(a):
  """The BlockSpec of all of ``a``: every row, every program."""
  return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
