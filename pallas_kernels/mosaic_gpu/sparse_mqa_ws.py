"""The warp-specialised sparse MQA kernel of bf16 / f16 rows (Hopper, sm_90a): issue 47.

One CTA per (token, block of 64 heads, top-k split), the head block the fastest grid axis, so
a token's CTAs run side by side and meet in L2: at DeepSeek-V3.2's 128 heads each selected row
is gathered twice per token (docs/kernels.md, "The cost model"). Three warpgroups
(TileLang's split of FlashMLA's work):

- **producer** (``setmaxnreg`` down to ``PRODUCER_REGS``): walks the split's slots
  ``BLOCK_K`` = 64 at a time into a ring of ``RING`` = 2 swizzled row tiles. The slot
  indices come by TMA a tile ahead (a ring of ``IDX_RING`` index tiles). Each row comes
  by 16-byte ``cp.async`` copies straight into the 128-byte-swizzled tile wgmma reads
  (``_compat.cp_async_rows``); invalid slots copy 0 bytes, so their rows are zeros and NaN in
  row 0 never reaches a dot. Then ``full[slot]``.
- **consumer 0**: QK^T once per tile (wgmma [64 heads, 64 slots] over all L columns), the
  online softmax in the log2 domain (exp2, the scale folded into one multiply), P to shared
  memory with the step's rescale, then PV over the first half of the value columns.
  (P is read from shared memory by both: the GPU interpreter has no rule for a wgmma whose
  left operand is in registers.)
- **consumer 1**: PV over the second half of the value columns from P in shared memory.
Each consumer holds a 64 x (d_v / 2) fp32 accumulator. Both release the slot
(``consumed[slot]``, two arrivals) after their PV. The output halves go out through q's
shared memory (q is dead after the last QK^T).

Interpreted (``plgpu.InterpretGPUParams``), the producer copies each row by a one-row TMA
straight into the swizzled tile (the interpreter takes what lowering rejects, and has no rule
for ``inline_mgpu``) and zeroes invalid slots' rows itself: the only difference from the
compiled kernel, beside PV into a fresh accumulator (the interpreter has no rule for a wgmma
into an initialised one). So the interpreter checks the ring, the barriers and their phases,
the softmax and the split, not the ``cp.async`` addresses (the compile report checks those
compile, and ``benchmarks/mosaic_gpu.py`` checks the numbers on a GPU).

Shared memory at L = 576: q 73,728 B, the ring 147,456 B, P 8,192 B, the index ring 768 B,
the rescale and LSE 512 B, and the barriers: 231,512 B (Mosaic's count, each buffer aligned
to 1 KiB) of the 232,448 B a block may have.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import MASK_VALUE
from pallas_kernels.indexer_logits_tiles import valid_rows
from pallas_kernels.mosaic_gpu._compat import cp_async_rows, cp_async_wait, plgpu, swizzled

BLOCK_H = 64     # heads per CTA: wgmma's M
BLOCK_K = 64     # top-k slots per tile
RING = 2         # row tiles in flight: the producer fills one while the consumers read one
IDX_RING = 3     # slot-index tiles: tile j + 1's loads while tile j's rows are gathered
# Registers a thread, set by setmaxnreg (multiples of 8, 512 in all for 3 x 128 threads).
CONSUMER0_REGS, CONSUMER1_REGS, PRODUCER_REGS = 240, 200, 72
_LOG2E = math.log2(math.e)


def forward(q_THL, kv_SL, topk_TK, *, sm_scale: float, d_v: int, num_splits: int, interpret,
            skip: frozenset[str] = frozenset()):
  """Per-split outputs of the bf16 / f16 kernel: ``(out [splits, T, H, d_v], lse [splits, T,
  H])``, each split normalised over its own slots (empty: out 0, LSE +inf).

  ``skip`` (timing only: the outputs are then wrong) leaves parts out to cost the others:
  ``"gather"`` (no row copies; the ring keeps what it held) and ``"pv"`` (no PV wgmma);
  ``benchmarks/mosaic_gpu.py --parts``."""
  if not skip <= {"gather", "pv"}:
    raise ValueError(f"sparse_mqa_ws: skip takes 'gather' and 'pv', got {sorted(skip)}")
  (T, H, L), S, K = q_THL.shape, kv_SL.shape[0], topk_TK.shape[1]
  tiles = pl.cdiv(K, BLOCK_K)
  per_split = pl.cdiv(tiles, num_splits)
  # Invalid slots pad the top-k to whole splits of whole tiles; the kernel masks them like -1.
  k_pad = per_split * num_splits * BLOCK_K
  topk = jnp.pad(topk_TK, ((0, 0), (0, k_pad - K)), constant_values=-1)
  dtype = q_THL.dtype
  interpreted = interpret is not None
  kernel = functools.partial(_kernel, S=S, d_v=d_v, scale_log2=sm_scale * _LOG2E,
                             num_tiles=per_split, interpreted=interpreted, skip=skip)
  row_tile = functools.partial(plgpu.SMEM, transforms=swizzled(dtype))
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((num_splits, T, H, d_v), dtype),
                jax.ShapeDtypeStruct((num_splits, T, H), jnp.float32)),
      scratch_types=(
          # q, then the two output halves: contiguous tiles, as a TMA store needs.
          plgpu.RefUnion(row_tile((BLOCK_H, L), dtype), row_tile((2, BLOCK_H, d_v // 2), dtype)),
          row_tile((RING, BLOCK_K, L), dtype),           # the row ring
          row_tile((BLOCK_H, BLOCK_K), dtype),           # P, consumer 0 -> consumer 1
          plgpu.SMEM((IDX_RING, BLOCK_K), jnp.int32),    # slot indices
          # [0]: the step's rescale, then 1 / l; [1]: LSE. One buffer: Mosaic aligns each
          # to 1 KiB, and 3 of them would not fit.
          plgpu.SMEM((2, BLOCK_H), jnp.float32),
          plgpu.Barrier(num_arrivals=1),                 # q
          plgpu.Barrier(num_arrivals=1, num_barriers=IDX_RING),
          plgpu.Barrier(num_arrivals=1, num_barriers=RING),             # full
          plgpu.Barrier(num_arrivals=2, num_barriers=RING),             # consumed
          plgpu.Barrier(num_arrivals=1),                 # P ready
          plgpu.Barrier(num_arrivals=1),                 # P free
          plgpu.Barrier(num_arrivals=BLOCK_K if interpreted else 1),    # interpreted rows
      ),
      grid=(T, num_splits, H // BLOCK_H),   # the last axis is CUDA's x: the fastest
      grid_names=("t", "split", "h"),
      num_threads=3,
      thread_name="wg",
      # The row max and sum stay within a warp: no cross-warp reduction scratch.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      kernel_name="sparse_mqa_mosaic_ws",
      interpret=interpret,
  )(q_THL, topk, kv_SL)


def _kernel(q_ref, topk_ref, kv_ref, out_ref, lse_ref, q_and_out, ring, p_smem, idx_smem,
            head_smem, q_bar, idx_bar, full, consumed, p_ready, p_free, rows_bar, *,
            S, d_v, scale_log2, num_tiles, interpreted, skip):
  t, split, hb = lax.axis_index("t"), lax.axis_index("split"), lax.axis_index("h")
  wg = lax.axis_index("wg")
  h0 = hb * BLOCK_H
  half = d_v // 2
  row_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per head
  col_layout = plgpu.Layout.WGMMA.reduce(0)   # one value per slot
  row_smem, lse_smem = head_smem.at[0], head_smem.at[1]
  q_smem, out_smem = q_and_out
  first_slot = split * num_tiles * BLOCK_K

  def load_indices(j):
    plgpu.copy_gmem_to_smem(topk_ref.at[t, pl.ds(first_slot + j * BLOCK_K, BLOCK_K)],
                            idx_smem.at[j % IDX_RING], idx_bar.at[j % IDX_RING])

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
    load_indices(0)

    @pl.loop(0, num_tiles)
    def _fill(j):
      slot = j % RING

      @pl.when(j >= RING)
      def _():
        plgpu.barrier_wait(consumed.at[slot])   # the consumers are done with tile j - RING

      @pl.when(j + 1 < num_tiles)
      def _():
        load_indices(j + 1)   # into tile j - 2's index slot, released with its rows
      plgpu.barrier_wait(idx_bar.at[j % IDX_RING])
      if interpreted and "gather" not in skip:
        _copy_rows_interpreted(kv_ref, idx_smem.at[j % IDX_RING], ring.at[slot], rows_bar, S)
      elif "gather" not in skip:
        cp_async_rows(kv_ref, idx_smem.at[j % IDX_RING], ring.at[slot])
        cp_async_wait(0)
      plgpu.commit_smem()   # the rows' generic-proxy writes, before wgmma reads them
      plgpu.barrier_arrive(full.at[slot])

  def slot_mask(j):
    ids = plgpu.load(idx_smem.at[j % IDX_RING], layout=col_layout, optimized=False)
    return valid_rows(ids, S)[0]

  def pv(acc, p, rows):
    """acc + p @ rows: in place when compiled (a fresh accumulator would cost 128 more
    registers a thread); into a fresh one interpreted (no rule for the in-place form)."""
    if "pv" in skip:
      return acc
    if interpreted:
      return acc + pl.run_scoped(lambda ref: (plgpu.wgmma(ref, p, rows), ref[...])[1],
                                 plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(lambda ref: plgpu.wgmma(ref, p, rows))(plgpu.ACC.init(acc))

  def write_half(acc, inv_l, i):
    out_smem[i] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[i],
                            out_ref.at[split, t, pl.ds(h0, BLOCK_H), pl.ds(i * half, half)])

  @pl.when(wg == 0)
  def _consumer0():
    plgpu.set_max_registers(CONSUMER0_REGS, action="increase")
    plgpu.copy_gmem_to_smem(q_ref.at[t, pl.ds(h0, BLOCK_H)], q_smem, q_bar)
    plgpu.barrier_wait(q_bar)

    def tile(j, carry):
      acc, m_i, l_i = carry
      slot = j % RING
      rows = ring.at[slot]
      plgpu.barrier_wait(full.at[slot])

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, rows.transpose((1, 0)))
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_K), jnp.float32))
      valid = lax.broadcast_in_dim(slot_mask(j), s.shape, [1])
      s = jnp.where(valid, s * scale_log2, MASK_VALUE)   # log2 domain: exp2 below
      m_new = jnp.maximum(m_i, s.max(axis=1))
      p = jnp.where(valid, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
      alpha = jnp.exp2(m_i - m_new)
      l_i = l_i * alpha + p.sum(axis=1)

      @pl.when(j > 0)
      def _():
        plgpu.barrier_wait(p_free)   # consumer 1 has read the previous P and rescale
      p_smem[...] = p.astype(p_smem.dtype)
      row_smem[...] = alpha
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_smem,
               rows.at[:, pl.ds(0, half)])
      plgpu.barrier_arrive(consumed.at[slot])
      return acc, m_new, l_i

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, half), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), MASK_VALUE, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), row_layout)
    acc, m_i, l_i = lax.fori_loop(0, num_tiles, tile, (acc, m_i, l_i))
    empty = l_i == 0.0   # no valid slot: out 0, LSE +inf
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l_i))
    plgpu.barrier_wait(p_free)   # consumer 1 has read the last rescale
    row_smem[...] = inv_l
    lse_smem[...] = jnp.where(empty, jnp.inf,
                              m_i / _LOG2E + jnp.log(jnp.where(empty, 1.0, l_i)))
    plgpu.commit_smem()
    plgpu.barrier_arrive(p_ready)
    write_half(acc, inv_l, 0)
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, t, pl.ds(h0, BLOCK_H)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _consumer1():
    plgpu.set_max_registers(CONSUMER1_REGS, action="increase")

    def tile(j, acc):
      slot = j % RING
      plgpu.barrier_wait(full.at[slot])
      plgpu.barrier_wait(p_ready)
      alpha = plgpu.load(row_smem, layout=row_layout, optimized=False)
      acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_smem,
               ring.at[slot].at[:, pl.ds(half, half)])
      plgpu.barrier_arrive(p_free)
      plgpu.barrier_arrive(consumed.at[slot])
      return acc

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, half), jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, num_tiles, tile, acc)
    plgpu.barrier_wait(p_ready)   # consumer 0's 1 / l; its last QK^T (q's bytes) is done
    inv_l = plgpu.load(row_smem, layout=row_layout, optimized=False)
    write_half(acc, inv_l, 1)
    plgpu.wait_smem_to_gmem(0)


def _copy_rows_interpreted(kv_ref, ids, rows, rows_bar, S):
  """The interpreter's stand-in for ``cp_async_rows``: a one-row TMA a slot (row 0 for an
  invalid one) straight into the swizzled tile, then invalid slots' rows set to 0."""
  def fetch(r, carry):
    plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(valid_rows(ids[r], S)[1], 1)],
                            rows.at[pl.ds(r, 1)], rows_bar)
    return carry
  lax.fori_loop(0, BLOCK_K, fetch, None)
  plgpu.barrier_wait(rows_bar)

  def zero(r, carry):
    @pl.when(~valid_rows(ids[r], S)[0])
    def _():
      rows[pl.ds(r, 1), :] = jnp.zeros((1, rows.shape[1]), rows.dtype)
    return carry
  lax.fori_loop(0, BLOCK_K, zero, None)
