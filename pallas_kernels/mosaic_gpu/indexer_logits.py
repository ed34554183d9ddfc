"""Lightning-indexer logits as a Mosaic GPU kernel (Hopper, sm_90a): issue 36.

Semantics are exactly :func:`pallas_kernels.indexer_logits.indexer_logits_reference`'s for bf16
and fp8 (e4m3) queries: ``logits[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s])`` (times
``k_scale[s]``), -inf outside ``[starts[t], ends[t])`` and in columns without a key.

Design (docs/kernels.md, "Mosaic GPU kernels"):
- One CTA (one warpgroup) per (block of ``BLOCK_S`` = 64 key columns, block of ``BLOCK_T``
  tokens). The key tile comes into SMEM once and serves every token of the block.
  - Contiguous keys: one TMA copy of the [64, I] tile.
  - Pooled keys (``key_rows_S``): one TMA copy per row, as sparse MQA gathers its rows, into
    an unswizzled tile. The rows are then cast to the queries' dtype in registers and stored
    into the swizzled tile.
- Per token: TMA copies of q[t] [G, I] and w[t] [G]. One wgmma gives dots [64 keys, G heads]
  (keys are wgmma's M, the heads its N). fp8 queries and keys go straight into an fp8 wgmma
  with fp32 accumulation. Then relu, the head weights and the sum over heads give one logit
  per key, in fp32 registers.
- A token whose window misses the key block writes -inf with no dot. So a causal prefill
  skips about half of the dots.
- Key counts that are not a multiple of 64 take the pooled path over ``arange(S)`` padded
  with -1: a ragged contiguous tile would read past the keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.indexer_logits import _nothing_to_score, validate_indexer_logits
from pallas_kernels.indexer_logits_tiles import FP8, valid_rows
from pallas_kernels.mosaic_gpu._compat import gather_rows, plgpu, swizzled, unsupported_reason

BLOCK_S = 64    # key columns per CTA: wgmma's M for one warpgroup
BLOCK_T = 16    # tokens per CTA, each reusing the CTA's key tile
DTYPES = (jnp.dtype(jnp.bfloat16), FP8)


def indexer_logits_mosaic(q_TGI, k_SI, w_TG, starts_T, ends_T, *, k_scale_S=None,
                          key_rows_S=None, interpret=None):
  """Mosaic GPU indexer logits of one sequence; the contract of ``indexer_logits_reference``.

  ``interpret``: ``None`` for the GPU, or ``plgpu.InterpretGPUParams()`` (GPU interpreter).
  Not differentiable by itself (``MosaicGpuBackend`` pairs it with the Triton backward).
  """
  if (reason := unsupported_reason()) is not None:
    raise NotImplementedError(f"indexer_logits_mosaic: {reason}")
  validate_indexer_logits(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S, key_rows_S)
  if (empty := _nothing_to_score(q_TGI, k_SI, key_rows_S)) is not None:
    return empty
  check_supported(q_TGI.dtype, k_SI.dtype, q_TGI.shape[1], q_TGI.shape[2])
  T, G, I = q_TGI.shape
  S = k_SI.shape[0] if key_rows_S is None else key_rows_S.shape[0]
  s_pad = pl.cdiv(S, BLOCK_S) * BLOCK_S
  if key_rows_S is None and s_pad != S:
    key_rows_S = jnp.arange(S, dtype=jnp.int32)  # ragged keys: read them as a pool
  pooled = key_rows_S is not None
  if pooled:
    key_rows_S = jnp.pad(key_rows_S, (0, s_pad - S), constant_values=-1)
  # Per-key scales come in per column: gathered for a pool (4 bytes a column, under one TMA
  # copy's 16-byte minimum a row), 1 where there are none.
  if k_scale_S is None:
    scale_S = jnp.ones((s_pad,), jnp.float32)
  elif pooled:
    valid_S, safe_S = valid_rows(key_rows_S, k_SI.shape[0])
    scale_S = jnp.where(valid_S, k_scale_S.astype(jnp.float32)[safe_S], 0.0)
  else:
    scale_S = k_scale_S.astype(jnp.float32)
  t_pad = pl.cdiv(T, BLOCK_T) * BLOCK_T
  windows = jnp.stack([jnp.pad(starts_T, (0, t_pad - T)), jnp.pad(ends_T, (0, t_pad - T))])
  kernel = functools.partial(_kernel, T=T, pooled=pooled)
  extra = (key_rows_S,) if pooled else ()
  scratch = [
      plgpu.SMEM((G, I), q_TGI.dtype, transforms=swizzled(q_TGI.dtype)),
      plgpu.SMEM((G,), jnp.float32),
      plgpu.SMEM((2, BLOCK_T), jnp.int32),
      plgpu.SMEM((BLOCK_S,), jnp.float32),
      plgpu.SMEM((BLOCK_S,), jnp.int32),
      plgpu.SMEM((BLOCK_S,), jnp.float32),
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_arrivals=3 if pooled else 2),
      plgpu.Barrier(num_arrivals=BLOCK_S if pooled else 1),
  ]
  logits = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((T, s_pad), jnp.float32),
      scratch_types=scratch,
      grid=(s_pad // BLOCK_S, t_pad // BLOCK_T),
      grid_names=("s", "t"),
      kernel_name="indexer_logits_mosaic",
      interpret=interpret,
  )(q_TGI, k_SI, w_TG.astype(jnp.float32), windows, scale_S, *extra)
  return logits if s_pad == S else logits[:, :S]


def check_supported(q_dtype, k_dtype, G: int, I: int) -> None:
  """What this kernel does not take, named (``MosaicGpuBackend`` sends it to Triton)."""
  if jnp.dtype(q_dtype) not in DTYPES:
    raise NotImplementedError(f"indexer_logits_mosaic: bf16 or fp8 queries only, got "
                              f"{jnp.dtype(q_dtype)}")
  if jnp.dtype(k_dtype) == FP8 and jnp.dtype(q_dtype) != FP8:
    raise NotImplementedError("indexer_logits_mosaic: fp8 keys need fp8 queries")
  width = 128 // jnp.dtype(q_dtype).itemsize
  if I % width or G % 8 or not 8 <= G <= 256:
    raise NotImplementedError(
        f"indexer_logits_mosaic: needs I % {width} == 0 and G a multiple of 8 in [8, 256]; "
        f"got G={G}, I={I}")


def _kernel(q_ref, k_ref, w_ref, win_ref, scale_ref, *rest, T, pooled):
  rows_ref, out_ref, *scratch = rest if pooled else (None, *rest)
  q_smem, w_smem, win_smem, scale_smem, rows_smem, out_smem, tok_bar, col_bar, key_bar = scratch
  sb, tb = lax.axis_index("s"), lax.axis_index("t")
  s0, t0 = sb * BLOCK_S, tb * BLOCK_T
  G, I = q_ref.shape[1:]
  dtype = q_ref.dtype
  key_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per key (wgmma's rows)
  head_layout = plgpu.Layout.WGMMA.reduce(0)  # one value per head (wgmma's columns)

  plgpu.copy_gmem_to_smem(win_ref.at[:, pl.ds(t0, BLOCK_T)], win_smem, col_bar)
  plgpu.copy_gmem_to_smem(scale_ref.at[pl.ds(s0, BLOCK_S)], scale_smem, col_bar)
  if pooled:
    plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(s0, BLOCK_S)], rows_smem, col_bar)
  plgpu.barrier_wait(col_bar)

  def score(k_smem):
    if pooled:
      _gather_keys(k_ref, rows_smem, k_smem, key_bar, dtype)
    else:
      plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(s0, BLOCK_S)], k_smem, key_bar)
      plgpu.barrier_wait(key_bar)
    cols = s0 + plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (BLOCK_S,), 0), key_layout)
    # Contiguous keys fill every column (ragged counts take the pooled path).
    has_key = valid_rows(plgpu.load(rows_smem, layout=key_layout, optimized=False),
                         k_ref.shape[0])[0] if pooled else None
    scale = plgpu.load(scale_smem, layout=key_layout, optimized=False)

    def token(i, carry):
      t = t0 + i
      start, end = win_smem[0, i], win_smem[1, i]
      # The previous token's logits must have left out_smem before it is written again.
      plgpu.wait_smem_to_gmem(0)

      @pl.when((start < s0 + BLOCK_S) & (end > s0) & (start < end))
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[t], q_smem, tok_bar)
        plgpu.copy_gmem_to_smem(w_ref.at[t], w_smem, tok_bar)
        plgpu.barrier_wait(tok_bar)

        def dots(acc_ref):
          plgpu.wgmma(acc_ref, k_smem, q_smem.transpose((1, 0)))
          return acc_ref[...]
        d = pl.run_scoped(dots, plgpu.ACC((BLOCK_S, G), jnp.float32))
        w = plgpu.load(w_smem, layout=head_layout, optimized=False)
        logit = (jnp.maximum(d, 0.0) * lax.broadcast_in_dim(w, d.shape, [1])).sum(axis=1)
        inside = (cols >= start) & (cols < end)
        if pooled:
          inside = inside & has_key
        out_smem[...] = jnp.where(inside, logit * scale, -jnp.inf)

      @pl.when(~((start < s0 + BLOCK_S) & (end > s0) & (start < end)))
      def _():
        out_smem[...] = plgpu.layout_cast(jnp.full((BLOCK_S,), -jnp.inf, jnp.float32),
                                          key_layout)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_ref.at[t, pl.ds(s0, BLOCK_S)])
      return carry
    lax.fori_loop(0, jnp.minimum(BLOCK_T, T - t0), token, None)
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(score, plgpu.SMEM((BLOCK_S, I), dtype, transforms=swizzled(dtype)))


def _gather_keys(k_ref, rows_smem, k_smem, key_bar, dtype):
  """Pool rows named by the block's row ids -> the swizzled key tile, cast to ``dtype``.

  One TMA copy a row into an unswizzled tile in the pool's dtype (a one-row copy into a
  swizzled tile does not lower), then through registers into the swizzled tile. Invalid ids
  read row 0, whose logits the caller replaces by -inf."""
  P, I = k_ref.shape

  def copy(raw):
    gather_rows((k_ref,), (raw,), rows_smem, P, key_bar)
    plgpu.barrier_wait(key_bar)
    cols = 128 // jnp.dtype(dtype).itemsize  # one swizzled row of the tile
    for c in range(I // cols):
      chunk = plgpu.load(raw.at[:, pl.ds(c * cols, cols)], layout=plgpu.Layout.WGMMA,
                         optimized=False)
      k_smem[:, pl.ds(c * cols, cols)] = chunk.astype(dtype)
    plgpu.commit_smem()
  pl.run_scoped(copy, plgpu.SMEM((BLOCK_S, I), k_ref.dtype))
