"""The key readers that :mod:`pallas_kernels.indexer_logits` and its backward share.

A program's key tile comes one of two ways, contiguous (:func:`key_tile`) or gathered from a
pool by row id (:func:`pooled_key_rows`, invalid ids clamped by :func:`valid_rows`); the
backward kernels (:mod:`pallas_kernels.indexer_logits_backward`) read keys exactly as the
forward does, so both import the readers from here: the forward can then import its backward
for its ``jax.custom_vjp`` without an import cycle.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat

FP8 = jnp.dtype(jnp.float8_e4m3fn)  # the indexer's fp8 q and k (e4m3)


def valid_rows(key_rows_S, num_rows):
  """``(valid_S, safe_S)``: row ids inside the pool, and every id clamped to a real row (the
  invalid ones read row 0 and are masked by the caller)."""
  valid_S = (key_rows_S >= 0) & (key_rows_S < num_rows)
  return valid_S, jnp.where(valid_S, key_rows_S, 0)


def key_tile(col_mask_S, k_ref, scale_ref=None):
  """Contiguous keys: the tile's BlockSpec block. ``(has_key_S, k_SI, read_scale or None)``;
  ``read_scale()`` loads the per-key scales, called after the head loop (see the forward kernel)."""
  k_SI = _compat.load(k_ref, mask=col_mask_S[:, None], other=0)
  read_scale = None if scale_ref is None else (
      lambda: _compat.load(scale_ref, mask=col_mask_S, other=0.0))
  return col_mask_S, k_SI, read_scale


def pooled_key_rows(col_mask_S, rows_ref, k_ref, scale_ref=None, *, dtype):
  """Pooled keys: the tile's row ids, then those rows of the whole pool (cast to ``dtype``);
  returns what :func:`key_tile` does."""
  rows_S = _compat.load(rows_ref, mask=col_mask_S, other=-1)
  has_key_S, safe_S = valid_rows(rows_S, k_ref.shape[0])
  k_SI = k_ref[safe_S, pl.ds(0, k_ref.shape[1])].astype(dtype)
  read_scale = None if scale_ref is None else (lambda: scale_ref[safe_S])
  return has_key_S, k_SI, read_scale
