"""The sparse MQA kernel of fp8 rows (``Fp8LatentRows`` under bf16 queries; Hopper, sm_90a):
issue 36's single-warpgroup kernel, kept for fp8 rows, with issue 47's top-k splits.

fp8 rows do not fit the warp-specialised kernel's shared memory (``sparse_mqa_ws``): its q and
ring of two 576-wide bf16 row tiles take 221 KB, and the dequantization needs the raw e4m3 /
RoPE tiles (40 KB) beside them (docs/kernels.md, "fp8 rows").

- One CTA (one warpgroup) per (token, top-k split, block of ``BLOCK_H`` = 64 heads, half of
  the value columns), the value half and then the head block the fastest grid axes. The value
  half keeps the fp32 output accumulator at 64 x 256 (128 registers a thread).
- The split's slots are walked ``BLOCK_K`` = 64 at a time. The slot indices come in by one
  TMA copy. Each selected row comes as two TMA copies (e4m3 latent, bf16 RoPE; Hopper has no
  TMA gather), issued from a ``fori_loop``, all on one barrier, into unswizzled raw tiles.
- The raw tiles are read back into registers 64 columns at a time: each latent chunk times
  its scale tile's per-slot scale, invalid slots' rows set to 0 (NaN in row 0, which they
  read, never reaches a dot), stored into the 128-byte-swizzled tile wgmma reads (a one-row
  TMA copy straight into a swizzled tile does not lower: "divisible by the tile size (8)").
  The slots' scales are gathered before the kernel ([T, Z, K] float32, 16 bytes a slot:
  under TMA's 16-byte minimum a row would be one copy each).
- QK^T is wgmma(q tile [64, L], rows^T). The online softmax runs in fp32, with invalid
  slots' logits replaced by a finite negative. P goes to SMEM in bf16, and PV is
  wgmma(P, rows[:, value half]).
- Shared memory at L = 576: q 73,728 B, the swizzled rows 73,728 B, the raw rows 40,960 B
  (sharing their bytes with P): 193,536 B (Mosaic's count).
- No software pipelining: the next tile's copies start after this tile's dots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import MASK_VALUE
from pallas_kernels.indexer_logits_tiles import valid_rows
from pallas_kernels.mosaic_gpu._compat import gather_rows, plgpu, swizzled

BLOCK_H = 64    # heads per CTA: wgmma's M for one warpgroup
BLOCK_K = 64    # top-k slots per tile
V_SPLIT = 2     # value halves, one CTA each: a 64 x 256 fp32 accumulator per warpgroup
_COL = 64       # columns per swizzled tile: 128 bytes of bf16


def forward(q_THL, kv_SL, topk_TK, *, sm_scale: float, d_v: int, num_splits: int, interpret):
  """Per-split outputs of the fp8-row kernel: ``(out [splits, T, H, d_v], lse [splits, T,
  H])``, each split normalised over its own slots (empty: out 0, LSE +inf)."""
  (T, H, L), K = q_THL.shape, topk_TK.shape[1]
  S = kv_SL.num_rows
  dtype = q_THL.dtype
  per_split = pl.cdiv(pl.cdiv(K, BLOCK_K), num_splits)
  # Invalid slots pad the top-k to whole splits of whole tiles; the kernel masks them like -1.
  k_pad = per_split * num_splits * BLOCK_K
  topk = jnp.pad(topk_TK, ((0, 0), (0, k_pad - K)), constant_values=-1)
  # The slots' scales, gathered here ([T, Z, K]: 16 bytes a slot beside a 656-byte row), so
  # that a tile's scales of one latent tile come in as one vector; 0 for invalid slots.
  valid, safe = valid_rows(topk, S)
  scales = jnp.where(valid[..., None], kv_SL.scales[safe], 0.0)
  rows = (kv_SL.values, kv_SL.rope.astype(dtype), jnp.swapaxes(scales, 1, 2))
  raw = (plgpu.SMEM((BLOCK_K, kv_SL.latent_width), kv_SL.values.dtype),
         plgpu.SMEM((BLOCK_K, L - kv_SL.latent_width), dtype))
  kernel = functools.partial(_kernel, S=S, d_v=d_v, sm_scale=sm_scale, tile=kv_SL.tile,
                             raw_types=raw, num_tiles=per_split,
                             interpreted=interpret is not None)
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((num_splits, T, H, d_v), dtype),
                jax.ShapeDtypeStruct((num_splits, T, H), jnp.float32)),
      scratch_types=(
          plgpu.SMEM((BLOCK_H, L), dtype, transforms=swizzled(dtype)),
          plgpu.SMEM((BLOCK_K,), jnp.int32),
          plgpu.SMEM((kv_SL.scales.shape[1], BLOCK_K), jnp.float32),
          plgpu.SMEM((BLOCK_H,), jnp.float32),
          plgpu.Barrier(num_arrivals=1),
          plgpu.Barrier(num_arrivals=2),
          plgpu.Barrier(num_arrivals=len(raw) * BLOCK_K),
      ),
      grid=(T, num_splits, H // BLOCK_H, V_SPLIT),   # the last axis is CUDA's x: the fastest
      grid_names=("t", "split", "h", "v"),
      kernel_name="sparse_mqa_mosaic_fp8",
      interpret=interpret,
  )(q_THL, topk, *rows)


def _kernel(q_ref, topk_ref, *refs, S, d_v, sm_scale, tile, raw_types, num_tiles,
            interpreted):
  *row_refs, out_ref, lse_ref, q_smem, idx_smem, scale_smem, lse_smem, q_bar, idx_bar, \
      rows_bar = refs
  t, split, hb = lax.axis_index("t"), lax.axis_index("split"), lax.axis_index("h")
  vh = lax.axis_index("v")
  first_slot = split * num_tiles * BLOCK_K
  h0 = hb * BLOCK_H
  dv_half = d_v // V_SPLIT
  v0 = vh * dv_half
  L = q_ref.shape[-1]
  dtype = q_ref.dtype
  row_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per head
  col_layout = plgpu.Layout.WGMMA.reduce(0)   # one value per slot

  plgpu.copy_gmem_to_smem(q_ref.at[t, pl.ds(h0, BLOCK_H)], q_smem, q_bar)
  plgpu.barrier_wait(q_bar)

  def walk(raw_or_p, rows):
    raw, p_smem = raw_or_p

    def tile_body(j, carry):
      acc, m_i, l_i = carry
      slots = pl.ds(first_slot + j * BLOCK_K, BLOCK_K)
      plgpu.copy_gmem_to_smem(topk_ref.at[t, slots], idx_smem, idx_bar)
      plgpu.copy_gmem_to_smem(row_refs[2].at[t, :, slots], scale_smem, idx_bar)
      plgpu.barrier_wait(idx_bar)

      gather_rows(row_refs[:len(raw)], raw, idx_smem, S, rows_bar)
      idx_col = plgpu.load(idx_smem, layout=col_layout, optimized=False)
      valid_col = valid_rows(idx_col, S)[0]
      # After the wait, not before: with this load ahead of it, Mosaic's layout inference
      # searched for minutes and failed (jax 0.12.0.1).
      plgpu.barrier_wait(rows_bar)
      idx_row = plgpu.load(idx_smem, layout=row_layout, optimized=False)
      valid_row = valid_rows(idx_row, S)[0]
      _dequantize_rows(raw, rows, scale_smem, valid_row, tile=tile, dtype=dtype)
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
      if interpreted:
        # The GPU interpreter has no rule for a wgmma into an initialised accumulator
        # (pl.run_state), so it adds a fresh one. Compiled, that would hold a second 64 x 256
        # fp32 tile (128 more registers a thread) and spill.
        acc = acc + pl.run_scoped(lambda ref: (pv(ref), ref[...])[1],
                                  plgpu.ACC((BLOCK_H, dv_half), jnp.float32))
      else:
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      # Every warp's PV has read the rows and P before any thread starts the next tile's row
      # copies into those bytes (or, after the loop, the output tile that reuses them).
      plgpu.commit_smem()
      return acc, m_new, l_i

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, dv_half), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), MASK_VALUE, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), row_layout)
    return lax.fori_loop(0, num_tiles, tile_body, (acc, m_i, l_i))

  # The row tiles live only while the loop runs; the output tile reuses their SMEM. P shares
  # the raw tiles' bytes (576-wide rows: 233 KB otherwise, over Hopper's 227 KB): a tile's raw
  # rows are copied into the swizzled ones before P is written, and P's last reader (the PV
  # wgmma, awaited when its accumulator is read) is done before the next tile's row copies.
  acc, m_i, l_i = pl.run_scoped(
      walk,
      plgpu.RefUnion(raw_types,
                     plgpu.SMEM((BLOCK_H, BLOCK_K), dtype, transforms=swizzled(dtype))),
      plgpu.SMEM((BLOCK_K, L), dtype, transforms=swizzled(dtype)))

  empty = l_i == 0.0   # no valid slot: out 0, LSE +inf
  safe_l = jnp.where(empty, 1.0, l_i)
  out = (acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])).astype(dtype)

  def write(o_smem):
    o_smem[...] = out
    lse_smem[...] = jnp.where(empty, jnp.inf, m_i + jnp.log(safe_l))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem,
                            out_ref.at[split, t, pl.ds(h0, BLOCK_H), pl.ds(v0, dv_half)])

    @pl.when(vh == 0)
    def _():
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, t, pl.ds(h0, BLOCK_H)])
    plgpu.wait_smem_to_gmem(0)
  pl.run_scoped(write, plgpu.SMEM((BLOCK_H, dv_half), dtype, transforms=swizzled(dtype)))


def _dequantize_rows(raw, rows, scale_smem, valid_row, *, tile, dtype):
  """The gathered raw rows -> the swizzled tile wgmma reads, 64 columns at a time through
  registers: fp8 latent values times their tile's scale, invalid slots' rows zeroed (NaN in
  row 0, which they read, stays out of the dots)."""
  keep = lax.broadcast_in_dim(valid_row, (BLOCK_K, _COL), [0])
  load = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False)
  zero = jnp.zeros((BLOCK_K, _COL), dtype)
  values, rope = raw
  A = values.shape[1]
  for z in range(A // tile):
    scale = lax.broadcast_in_dim(
        plgpu.load(scale_smem.at[z], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False),
        (BLOCK_K, _COL), [0])
    for c in range(z * tile // _COL, (z + 1) * tile // _COL):
      chunk = load(values.at[:, pl.ds(c * _COL, _COL)]).astype(jnp.float32) * scale
      rows[:, pl.ds(c * _COL, _COL)] = jnp.where(keep, chunk.astype(dtype), zero)
  for c in range(rope.shape[1] // _COL):
    rows[:, pl.ds(A + c * _COL, _COL)] = jnp.where(keep, load(rope.at[:, pl.ds(c * _COL, _COL)]),
                                                   zero)
