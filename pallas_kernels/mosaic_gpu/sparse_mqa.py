"""Sparse MQA forward as a Mosaic GPU kernel (Hopper, sm_90a): issue 36, its first kernel.

Semantics are exactly :func:`pallas_kernels.sparse_mqa.sparse_mqa`'s forward for bf16 / f16
array rows (fp8 ``Fp8LatentRows`` are not done here yet): returns ``(out_THV, lse_TH)``;
indices -1 or >= S are invalid slots; a token with no valid slot gives out 0 and LSE +inf;
NaN in rows that no valid slot selects cannot reach the output.

Design (docs/kernels.md, "Mosaic GPU sparse MQA"):
- One CTA (one warpgroup) per (token, block of ``BLOCK_H`` = 64 heads, half of the value
  columns). Heads are wgmma's M dimension, so every gathered row serves 64 heads at once.
  The value half keeps the fp32 output accumulator at 64 x 256 (128 registers a thread); a
  64 x 512 accumulator would not fit one warpgroup's registers.
- The token's top-k is walked ``BLOCK_K`` = 64 slots at a time. The slot indices come in by
  one TMA copy. Each selected row comes by its own TMA copy (Hopper has no TMA gather; that
  is sm_100's ``gather4``), issued from a ``fori_loop``, all 64 on one barrier, into an
  unswizzled tile.
- The raw tile is read back into registers 64 columns at a time. Invalid slots' rows are set
  to 0 there, so NaN in row 0 (which invalid slots read) never reaches a dot. The result is
  stored into a 128-byte-swizzled tile: a one-row TMA copy straight into a swizzled tile
  does not lower ("divisible by the tile size (8)").
- QK^T is wgmma(q tile [64, L], rows^T). The online softmax runs in fp32, with invalid
  slots' logits replaced by a finite negative. P goes to SMEM in the query dtype, and PV is
  wgmma(P, rows[:, value half]).
- Shared memory at L = 576 is 225 KB of Hopper's 227: q, the swizzled rows, and the raw rows
  sharing their bytes with P.
- No software pipelining yet: the next tile's copies start after this tile's dots.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _checks
from pallas_kernels._compat import MASK_VALUE
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.mosaic_gpu._compat import plgpu, swizzled, unsupported_reason
from pallas_kernels.sparse_mqa import _nothing_to_attend, validate_sparse_mqa

BLOCK_H = 64    # heads per CTA: wgmma's M for one warpgroup
BLOCK_K = 64    # top-k slots per tile
V_SPLIT = 2     # value halves, one CTA each: a 64 x 256 fp32 accumulator per warpgroup
_COL = 64       # columns per swizzled tile: 128 bytes of bf16


def _refuse_fp8_rows(rows) -> None:
  if isinstance(rows, Fp8LatentRows):
    raise NotImplementedError("sparse_mqa_mosaic: fp8 rows are not done yet (issue 36)")


def sparse_mqa_mosaic(q_THL, kv_SL, topk_TK, *, sm_scale: float, d_v: int, interpret=None):
  """Mosaic GPU sparse MQA forward of one sequence; the contract of ``sparse_mqa``.

  ``interpret``: ``None`` for the GPU, or ``plgpu.InterpretGPUParams()`` (GPU interpreter).
  """
  _refuse_fp8_rows(kv_SL)
  sm_scale, d_v = validate_sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale, d_v)
  if (empty := _nothing_to_attend(q_THL, kv_SL, topk_TK, d_v)) is not None:
    return empty
  out, lse = sparse_mqa_mosaic_batched(q_THL[None], kv_SL[None], topk_TK[None],
                                       sm_scale=sm_scale, d_v=d_v, interpret=interpret)
  return out[0], lse[0]


def sparse_mqa_mosaic_batched(q_BTHL, kv_BSL, topk_BTK, *, sm_scale: float, d_v: int,
                              interpret=None):
  """``sparse_mqa_mosaic`` of B sequences at once (a decode batch is T = 1): each sequence's
  indices are local to its own rows ``kv_BSL[b]``. One kernel launch, grid (B * T, H / 64, 2).
  """
  if (reason := unsupported_reason()) is not None:
    raise NotImplementedError(f"sparse_mqa_mosaic: {reason}")
  _refuse_fp8_rows(kv_BSL)
  if q_BTHL.ndim != 4 or kv_BSL.ndim != 3 or topk_BTK.ndim != 3:
    raise ValueError("sparse_mqa_mosaic_batched: expects q [B,T,H,L], kv [B,S,L], topk [B,T,K]")
  sm_scale, d_v = validate_sparse_mqa(q_BTHL[0], kv_BSL[0], topk_BTK[0], sm_scale, d_v)
  B, T, H, L = q_BTHL.shape
  S, K = kv_BSL.shape[1], topk_BTK.shape[2]
  if 0 in (B, T, H, S, K):
    out, lse = _checks.no_attention(B * T, H, d_v, q_BTHL.dtype)
    return out.reshape(B, T, H, d_v), lse.reshape(B, T, H)
  dtype = q_BTHL.dtype
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise NotImplementedError(f"sparse_mqa_mosaic: bf16/f16 rows only so far, got {dtype}")
  if H % BLOCK_H or L % _COL or d_v % (V_SPLIT * _COL):
    raise NotImplementedError(
        f"sparse_mqa_mosaic: needs H % {BLOCK_H} == 0, L % {_COL} == 0 and "
        f"d_v % {V_SPLIT * _COL} == 0; got H={H}, L={L}, d_v={d_v}")
  # Invalid slots pad the top-k to whole tiles; the kernel masks them like -1.
  k_pad = pl.cdiv(K, BLOCK_K) * BLOCK_K
  topk = topk_BTK.reshape(B * T, K)
  if k_pad != K:
    topk = jnp.pad(topk, ((0, 0), (0, k_pad - K)), constant_values=-1)
  kernel = functools.partial(_kernel, T=T, S=S, d_v=d_v, sm_scale=sm_scale,
                             num_tiles=k_pad // BLOCK_K)
  out, lse = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((B * T, H, d_v), dtype),
                jax.ShapeDtypeStruct((B * T, H), jnp.float32)),
      scratch_types=(
          plgpu.SMEM((BLOCK_H, L), dtype, transforms=swizzled(dtype)),
          plgpu.SMEM((BLOCK_K,), jnp.int32),
          plgpu.SMEM((BLOCK_H,), jnp.float32),
          plgpu.Barrier(num_arrivals=1),
          plgpu.Barrier(num_arrivals=1),
          plgpu.Barrier(num_arrivals=BLOCK_K),
      ),
      grid=(B * T, H // BLOCK_H, V_SPLIT),
      grid_names=("t", "h", "v"),
      interpret=interpret,
  )(q_BTHL.reshape(B * T, H, L), kv_BSL, topk)
  return out.reshape(B, T, H, d_v), lse.reshape(B, T, H)


def _kernel(q_ref, kv_ref, topk_ref, out_ref, lse_ref, q_smem, idx_smem, lse_smem, q_bar,
            idx_bar, rows_bar, *, T, S, d_v, sm_scale, num_tiles):
  bt, hb, vh = lax.axis_index("t"), lax.axis_index("h"), lax.axis_index("v")
  b = bt // T
  h0 = hb * BLOCK_H
  dv_half = d_v // V_SPLIT
  v0 = vh * dv_half
  L = q_ref.shape[-1]
  dtype = q_ref.dtype
  row_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per head
  col_layout = plgpu.Layout.WGMMA.reduce(0)   # one value per slot

  plgpu.copy_gmem_to_smem(q_ref.at[bt, pl.ds(h0, BLOCK_H)], q_smem, q_bar)
  plgpu.barrier_wait(q_bar)

  def walk(raw_or_p, rows):
    raw, p_smem = raw_or_p

    def tile(j, carry):
      acc, m_i, l_i = carry
      plgpu.copy_gmem_to_smem(topk_ref.at[bt, pl.ds(j * BLOCK_K, BLOCK_K)], idx_smem, idx_bar)
      plgpu.barrier_wait(idx_bar)

      def fetch(r, carry):  # one TMA copy a selected row; invalid slots read row 0
        idx = idx_smem[r]
        safe = jnp.where((idx >= 0) & (idx < S), idx, 0)
        plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(safe, 1)], raw.at[pl.ds(r, 1)], rows_bar)
        return carry
      lax.fori_loop(0, BLOCK_K, fetch, None)
      idx_col = plgpu.load(idx_smem, layout=col_layout, optimized=False)
      valid_col = (idx_col >= 0) & (idx_col < S)
      # After the wait, not before: with this load ahead of it, Mosaic's layout inference
      # searched for minutes and failed (jax 0.12.0.1).
      plgpu.barrier_wait(rows_bar)
      idx_row = plgpu.load(idx_smem, layout=row_layout, optimized=False)
      valid_row = (idx_row >= 0) & (idx_row < S)
      # Raw rows -> swizzled rows, invalid slots' rows zeroed (NaN in row 0 stays out).
      keep = lax.broadcast_in_dim(valid_row, (BLOCK_K, _COL), [0])
      for c in range(L // _COL):
        chunk = plgpu.load(raw.at[:, pl.ds(c * _COL, _COL)], layout=plgpu.Layout.WGMMA,
                           optimized=False)
        rows[:, pl.ds(c * _COL, _COL)] = jnp.where(keep, chunk, jnp.zeros_like(chunk))
      plgpu.commit_smem()

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, rows.transpose((1, 0)))
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_K), jnp.float32)) * sm_scale
      valid = lax.broadcast_in_dim(valid_col, s.shape, [1])
      s = jnp.where(valid, s, MASK_VALUE)
      m_new = jnp.maximum(m_i, s.max(axis=1))
      p = jnp.where(valid, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
      alpha = jnp.exp(m_i - m_new)
      l_i = l_i * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p_smem[...] = p.astype(dtype)
      plgpu.commit_smem()

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, rows.at[:, pl.ds(v0, dv_half)])
        return acc_ref[...]
      # A fresh accumulator added to acc: the GPU interpreter has no rule for a wgmma into
      # an initialised one (pl.run_state).
      acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_H, dv_half), jnp.float32))
      return acc, m_new, l_i

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, dv_half), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), MASK_VALUE, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), row_layout)
    return lax.fori_loop(0, num_tiles, tile, (acc, m_i, l_i))

  # The row tiles live only while the loop runs; the output tile reuses their SMEM. P shares
  # the raw tile's bytes (576-wide rows: 233 KB otherwise, over Hopper's 227 KB): a tile's raw
  # rows are copied into the swizzled ones before P is written, and P's last reader (the PV
  # wgmma, awaited when its accumulator is read) is done before the next tile's row copies.
  acc, m_i, l_i = pl.run_scoped(
      walk,
      plgpu.RefUnion(plgpu.SMEM((BLOCK_K, L), dtype),
                     plgpu.SMEM((BLOCK_H, BLOCK_K), dtype, transforms=swizzled(dtype))),
      plgpu.SMEM((BLOCK_K, L), dtype, transforms=swizzled(dtype)))

  empty = l_i == 0.0   # no valid slot: out 0, LSE +inf
  safe_l = jnp.where(empty, 1.0, l_i)
  out = (acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])).astype(dtype)

  def write(o_smem):
    o_smem[...] = out
    lse_smem[...] = jnp.where(empty, jnp.inf, m_i + jnp.log(safe_l))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[bt, pl.ds(h0, BLOCK_H), pl.ds(v0, dv_half)])

    @pl.when(vh == 0)
    def _():
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bt, pl.ds(h0, BLOCK_H)])
    plgpu.wait_smem_to_gmem(0)
  pl.run_scoped(write, plgpu.SMEM((BLOCK_H, dv_half), dtype, transforms=swizzled(dtype)))
