"""Sparse MQA forward as Mosaic GPU kernels (Hopper, sm_90a): issues 36 and 47.

Semantics are exactly :func:`pallas_kernels.sparse_mqa.sparse_mqa`'s forward for bf16 / f16
array rows and for ``Fp8LatentRows`` under bf16 queries: returns ``(out_THV, lse_TH)``;
indices -1 or >= S are invalid slots; a token with no valid slot gives out 0 and LSE +inf;
NaN in rows that no valid slot selects cannot reach the output.

Two kernels (docs/kernels.md, "Mosaic GPU kernels"):
- bf16 / f16 rows: ``sparse_mqa_ws``, warp-specialised (a producer warpgroup gathering rows by
  ``cp.async`` into a ring of swizzled tiles, two consumer warpgroups), one CTA per (token, 64
  heads);
- fp8 rows: ``sparse_mqa_fp8``, one warpgroup per (token, 64 heads, value half), rows
  dequantized in shared memory.

**Top-k splits.** Each kernel walks a token's top-k in ``num_splits`` parts, one CTA row each,
and writes each part's output and LSE; :func:`combine_splits` merges them by log-sum-exp. At
small batch that spreads a token over many CTAs: a decode step of one DeepSeek-V3.2 token (128
heads, top-k 2,048) runs 64 CTAs, not 2. :func:`split_count` picks the split from the tokens
of the whole launch (a vmapped batch is one launch), so ``MosaicGpuBackend`` passes it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.mosaic_gpu import sparse_mqa_fp8, sparse_mqa_ws
from pallas_kernels.mosaic_gpu._compat import unsupported_reason
from pallas_kernels.sparse_mqa import _nothing_to_attend, validate_sparse_mqa

BLOCK_H, BLOCK_K = sparse_mqa_ws.BLOCK_H, sparse_mqa_ws.BLOCK_K   # the fp8 kernel's too
_COL = 64         # columns per swizzled tile: 128 bytes of bf16
# CTAs a launch should have before the top-k is split: an H100 / H200's SMs, one CTA each
# (both kernels take most of an SM's shared memory).
TARGET_CTAS = 132


def sparse_mqa_mosaic(q_THL, kv_SL, topk_TK, *, sm_scale: float, d_v: int,
                      num_splits: int | None = None, interpret=None):
  """Mosaic GPU sparse MQA forward of one sequence; the contract of ``sparse_mqa``.

  ``kv_SL``: bf16 / f16 rows [S, L] in the queries' dtype, or ``Fp8LatentRows`` with bf16
  queries. Batch it with ``jax.vmap`` (one kernel launch, the batch an extra grid axis); a
  page pool shared by the batch is an unbatched ``kv_SL`` (``in_axes=None``).
  ``num_splits``: parts of the top-k walked by CTAs of their own and merged by log-sum-exp;
  ``None``: :func:`split_count` of this sequence alone (pass the batch's under ``vmap``).
  ``interpret``: ``None`` for the GPU, or ``plgpu.InterpretGPUParams()`` (GPU interpreter).
  Not differentiable by itself (``MosaicGpuBackend`` pairs it with the Triton backward).
  """
  if (reason := unsupported_reason()) is not None:
    raise NotImplementedError(f"sparse_mqa_mosaic: {reason}")
  sm_scale, d_v = validate_sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale, d_v)
  if (empty := _nothing_to_attend(q_THL, kv_SL, topk_TK, d_v)) is not None:
    return empty
  fp8 = isinstance(kv_SL, Fp8LatentRows)
  (T, H, L), K = q_THL.shape, topk_TK.shape[1]
  check_supported(q_THL.dtype, H, L, d_v, kv_SL.tile if fp8 else None)
  if num_splits is None:
    num_splits = split_count(T, H, K)
  elif not isinstance(num_splits, int) or num_splits < 1:
    raise ValueError(f"sparse_mqa_mosaic: num_splits must be a positive int, got {num_splits!r}")
  # Every split walks at least one tile.
  tiles = pl.cdiv(K, BLOCK_K)
  num_splits = pl.cdiv(tiles, pl.cdiv(tiles, num_splits))
  kernel = sparse_mqa_fp8 if fp8 else sparse_mqa_ws
  out, lse = kernel.forward(q_THL, kv_SL, topk_TK, sm_scale=sm_scale, d_v=d_v,
                            num_splits=num_splits, interpret=interpret)
  return combine_splits(out, lse)


def split_count(num_tokens: int, num_heads: int, topk: int) -> int:
  """Parts to split each token's top-k into, so that a launch of ``num_tokens`` tokens (a
  vmapped batch's included) has about ``TARGET_CTAS`` CTAs, with a tile of slots at least in
  each part: 1 for a prefill chunk, 32 for one DeepSeek-V3.2 decode token (2 head blocks)."""
  ctas = max(1, num_tokens) * max(1, num_heads // BLOCK_H)
  return max(1, min(pl.cdiv(topk, BLOCK_K), pl.cdiv(TARGET_CTAS, ctas)))


def combine_splits(out_PTHV, lse_PTH):
  """Merges per-split outputs (each normalised over its own slots, LSE +inf when it had
  none) into the token's: the log-sum-exp of the splits' LSEs, and their outputs weighted by
  ``exp(lse_p - lse)``. All empty: out 0, LSE +inf. One split passes through."""
  if out_PTHV.shape[0] == 1:
    return out_PTHV[0], lse_PTH[0]
  lse_PTH = jnp.where(lse_PTH == jnp.inf, -jnp.inf, lse_PTH)   # an empty split weighs 0
  top_TH = lse_PTH.max(axis=0)
  empty_TH = top_TH == -jnp.inf
  weight_PTH = jnp.exp(lse_PTH - jnp.where(empty_TH, 0.0, top_TH))
  total_TH = weight_PTH.sum(axis=0)
  safe_total_TH = jnp.where(empty_TH, 1.0, total_TH)
  out_THV = jnp.einsum("pth,pthv->thv", weight_PTH / safe_total_TH,
                       out_PTHV.astype(jnp.float32))
  lse_TH = jnp.where(empty_TH, jnp.inf, top_TH + jnp.log(safe_total_TH))
  return out_THV.astype(out_PTHV.dtype), lse_TH


def check_supported(dtype, H: int, L: int, d_v: int, fp8_tile: int | None = None) -> None:
  """What these kernels do not take, named (``MosaicGpuBackend`` sends it to Triton)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise NotImplementedError(f"sparse_mqa_mosaic: bf16 or f16 queries only, got "
                              f"{jnp.dtype(dtype)}")
  if fp8_tile is not None and jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    raise NotImplementedError("sparse_mqa_mosaic: fp8 rows need bf16 queries")
  if H % BLOCK_H or L % _COL or d_v % (2 * _COL) or (fp8_tile or _COL) % _COL:
    raise NotImplementedError(
        f"sparse_mqa_mosaic: needs H % {BLOCK_H} == 0, L % {_COL} == 0, "
        f"d_v % {2 * _COL} == 0 and fp8 scale tiles a multiple of {_COL}; got H={H}, "
        f"L={L}, d_v={d_v}, tile={fp8_tile}")
