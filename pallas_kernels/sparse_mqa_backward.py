"""The backward of :func:`pallas_kernels.sparse_mqa.sparse_mqa`: three Pallas-Triton kernels.

With the probabilities recomputed from the forward's LSE, ``p = exp(scale * q.row - lse)``, the
value cotangent ``dp = dout . row[:d_v]`` and ``delta = rowsum(dout * out) - dlse`` (the LSE
cotangent enters as ``p * dlse``, since d lse / d logits = p):

  ds[t, h, k]  = p * (dp - delta)
  dq[t, h]     = scale * sum_k ds[t, h, k] row[t, k]
  drow[t, k]   = scale * sum_h ds[t, h, k] q[t, h]  (+ sum_h p[t, h, k] dout[t, h] on [:d_v])

* ``sparse_mqa_dq``: programs as the forward's (``block_h`` heads of one token), walking the
  token's top-k slots ``block_k`` at a time.
* ``sparse_mqa_drows``: one program per ``block_k`` slots of one token, walking the heads
  ``block_h`` at a time; writes each (token, slot) row gradient, [T, K, L] float32.
* ``sparse_mqa_row_sum``: one program per row s of ``dkv[S, L]``, adding the row gradients of
  the slots that name s, in slot order.

dq and drows read rows as the forward does, with the readers of
:mod:`pallas_kernels.sparse_mqa_tiles` (clamped gather, invalid slots zeroed before any dot), in
column chunks whose first ones are exactly the ``d_v`` value columns, so ``dp`` reuses the
gathered chunks. Invalid slots and empty rows (LSE +inf) get ``p = ds = 0``.

The row sum is deterministic: a stable sort of the slot indices (int32, outside the kernels)
gives each row its run of slots, which the row's program reads in place in a fixed order, so
``dkv`` is the same bit for bit on every call. ``jax.ops.segment_sum`` would be a scatter-add,
which XLA's GPU backend runs with atomics (in no fixed order) unless its deterministic-ops
flag is set. [T, K, L] float32 is 4.7 MB a token at DeepSeek-V3.2 widths, so tokens are taken
in chunks whose row gradients fit ``drows_max_bytes``, each chunk's sums added in order.

fp8 rows (``Fp8LatentRows``) are constants, a quantized cache: their cotangents are zeros and
no row gradient is computed; ``dq`` reads them dequantized, as the forward does.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels import sparse_mqa_tiles as tiles
from pallas_kernels.block_config import SparseMQABackwardConfig, pow2_chunks
from pallas_kernels.fp8_rows import Fp8LatentRows


@dataclasses.dataclass(frozen=True)
class _RowLayout:
  """How a kernel reads a slot block of rows: ``chunks`` are ``(start, width)`` power-of-two
  column chunks of the L-wide row, the first ``num_values`` covering exactly ``[0, d_v)``;
  ``read(row_refs, safe_K, valid_K)`` gives them, zeros at invalid slots, in the query dtype."""

  chunks: tuple[tuple[int, int], ...]
  num_values: int
  read: Callable


def _float_layout(width: int, d_v: int) -> _RowLayout:
  chunks = pow2_chunks(d_v) + tuple((d_v + c0, cw) for c0, cw in pow2_chunks(width - d_v))

  def read(row_refs, safe_K, valid_K):
    (kv_ref,) = row_refs
    # Invalid slots read row 0: zeros, or a NaN there would meet p = 0 in ds @ rows.
    return [jnp.where(valid_K[:, None], kv_ref[safe_K, pl.ds(c0, cw)], 0) for c0, cw in chunks]

  return _RowLayout(chunks, len(pow2_chunks(d_v)), read)


def _fp8_layout(rows: Fp8LatentRows, dtype) -> _RowLayout:
  latent_chunks = tiles.latent_chunks(rows.latent_width, rows.tile)
  rope_chunks = pow2_chunks(rows.rope.shape[-1])
  chunks = (tuple((c0, cw) for c0, cw, _ in latent_chunks)
            + tuple((rows.latent_width + c0, cw) for c0, cw in rope_chunks))

  def read(row_refs, safe_K, valid_K):
    latent, rope = tiles.read_fp8_rows(*row_refs, safe_K, valid_K, latent_chunks=latent_chunks,
                                       rope_chunks=rope_chunks, dtype=dtype)
    return latent + rope

  return _RowLayout(chunks, len(latent_chunks), read)


# ---- in-kernel pieces shared by both kernels ------------------------------------------------

def _load_heads(q_ref, dout_ref, lse_ref, delta_ref, heads, head_mask_H, layout):
  """One head block's query and output-cotangent chunks, LSE and delta. Heads past H read
  q = dout = 0 and LSE +inf (so p = 0): they add nothing."""
  load = lambda ref, c0, cw: _compat.load(ref.at[heads, pl.ds(c0, cw)],
                                          mask=head_mask_H[:, None], other=0)
  q_chunks = [load(q_ref, c0, cw) for c0, cw in layout.chunks]
  dout_chunks = [load(dout_ref, c0, cw) for c0, cw in layout.chunks[:layout.num_values]]
  lse_H = _compat.load(lse_ref.at[heads], mask=head_mask_H, other=jnp.inf)
  delta_H = _compat.load(delta_ref.at[heads], mask=head_mask_H, other=0)
  return q_chunks, dout_chunks, lse_H, delta_H


def _score_grads(q_chunks, dout_chunks, rows, valid_K, lse_H, delta_H, *, sm_scale, precision):
  """``(p_HK, ds_HK)`` of a head block against a slot block, 0 at invalid slots and in empty
  rows (LSE +inf)."""
  dots_HK = lambda lhs, rhs: functools.reduce(operator.add, (
      jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                          precision=precision) for a, b in zip(lhs, rhs)))
  logits_HK = dots_HK(q_chunks, rows)
  p_HK = jnp.where(valid_K[None, :], jnp.exp(logits_HK * sm_scale - lse_H[:, None]), 0.0)
  dp_HK = dots_HK(dout_chunks, rows)
  return p_HK, p_HK * (dp_HK - delta_H[:, None])


def _sparse_mqa_dq_kernel(q_ref, *refs, layout, sm_scale, num_heads, num_rows, topk, config):
  *row_refs, topk_ref, dout_ref, lse_ref, delta_ref, dq_ref = refs
  block_h, block_k = config.block_h, config.block_k
  head_mask_H = pl.program_id(1) * block_h + jnp.arange(block_h, dtype=jnp.int32) < num_heads
  dtype, precision = q_ref.dtype, _compat.dot_precision(q_ref.dtype)
  q_chunks, dout_chunks, lse_H, delta_H = _load_heads(q_ref, dout_ref, lse_ref, delta_ref,
                                                      slice(None), head_mask_H, layout)

  def body(j, accs):
    valid_K, safe_K = tiles.slot_block(topk_ref, j, block_k=block_k, topk=topk, num_rows=num_rows)
    rows = layout.read(row_refs, safe_K, valid_K)
    _, ds_HK = _score_grads(q_chunks, dout_chunks, rows, valid_K, lse_H, delta_H,
                            sm_scale=sm_scale, precision=precision)
    ds_HK = ds_HK.astype(dtype)
    return tuple(acc_HC + jnp.dot(ds_HK, rows_KC, preferred_element_type=jnp.float32,
                                  precision=precision)
                 for acc_HC, rows_KC in zip(accs, rows))

  accs = jax.lax.fori_loop(0, pl.cdiv(topk, block_k), body,
                           tuple(jnp.zeros((block_h, cw), jnp.float32) for _, cw in layout.chunks))
  for (c0, cw), acc_HC in zip(layout.chunks, accs):
    _compat.store(dq_ref.at[:, pl.ds(c0, cw)], (acc_HC * sm_scale).astype(dq_ref.dtype),
                  mask=head_mask_H[:, None])


def _sparse_mqa_drows_kernel(q_ref, kv_ref, topk_ref, dout_ref, lse_ref, delta_ref, drows_ref, *,
                             layout, sm_scale, num_heads, num_rows, topk, config):
  block_h, block_k = config.block_h, config.block_k
  j = pl.program_id(1)
  valid_K, safe_K = tiles.slot_block(topk_ref, j, block_k=block_k, topk=topk, num_rows=num_rows)
  rows = layout.read((kv_ref,), safe_K, valid_K)  # read once, used by every head block
  dtype, precision = q_ref.dtype, _compat.dot_precision(q_ref.dtype)
  # [H, K] x [H, C] -> [K, C]: the head block is the contraction.
  dot_KC = lambda a_HK, b_HC: jax.lax.dot_general(
      a_HK, b_HC, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
      precision=precision)

  def body(i, accs):
    h0 = pl.multiple_of(i * block_h, block_h)
    head_mask_H = h0 + jnp.arange(block_h, dtype=jnp.int32) < num_heads
    q_chunks, dout_chunks, lse_H, delta_H = _load_heads(
        q_ref, dout_ref, lse_ref, delta_ref, pl.ds(h0, block_h), head_mask_H, layout)
    p_HK, ds_HK = _score_grads(q_chunks, dout_chunks, rows, valid_K, lse_H, delta_H,
                               sm_scale=sm_scale, precision=precision)
    ds_HK, p_HK = (ds_HK * sm_scale).astype(dtype), p_HK.astype(dtype)
    accs = [acc_KC + dot_KC(ds_HK, q_HC) for acc_KC, q_HC in zip(accs, q_chunks)]
    for c, dout_HC in enumerate(dout_chunks):  # the value columns also carry p^T dout
      accs[c] = accs[c] + dot_KC(p_HK, dout_HC)
    return tuple(accs)

  accs = jax.lax.fori_loop(0, pl.cdiv(num_heads, block_h), body,
                           tuple(jnp.zeros((block_k, cw), jnp.float32) for _, cw in layout.chunks))
  slot_mask_K1 = (j * block_k + jnp.arange(block_k, dtype=jnp.int32) < topk)[:, None]
  for (c0, cw), acc_KC in zip(layout.chunks, accs):
    _compat.store(drows_ref.at[:, pl.ds(c0, cw)], acc_KC, mask=slot_mask_K1)


# ---- the calls ------------------------------------------------------------------------------

def _layout(kv_SL, dtype, d_v) -> _RowLayout:
  if isinstance(kv_SL, Fp8LatentRows):
    return _fp8_layout(kv_SL, dtype)
  return _float_layout(kv_SL.shape[1], d_v)


def sparse_mqa_dq(q_THL, kv_SL, topk_TK, dout_THV, lse_TH, delta_TH, *, sm_scale, config,
                  interpret=False):
  """The query gradient [T, H, L] in the dtype of ``q_THL``; ``kv_SL`` an array or
  ``Fp8LatentRows``, ``delta_TH`` is ``rowsum(dout * out) - dlse``."""
  kv_args = tuple(kv_SL) if isinstance(kv_SL, Fp8LatentRows) else (kv_SL,)
  num_rows = kv_args[0].shape[0]
  (T, H, L), K, d_v = q_THL.shape, topk_TK.shape[1], dout_THV.shape[-1]
  block_h, block_k = config.block_h, config.block_k
  padded_k = pl.cdiv(K, block_k) * block_k  # the top-k block overhangs; loads are masked
  kernel = functools.partial(_sparse_mqa_dq_kernel, layout=_layout(kv_SL, q_THL.dtype, d_v),
                             sm_scale=sm_scale, num_heads=H, num_rows=num_rows, topk=K,
                             config=config)
  row_bytes = sum(a.shape[1] * a.dtype.itemsize for a in kv_args)
  cost = pl.CostEstimate(
      flops=2 * T * K * H * (2 * L + d_v), transcendentals=T * K * H,
      bytes_accessed=q_THL.dtype.itemsize * T * H * (2 * L + d_v)
      + row_bytes * T * K * pl.cdiv(H, block_h) + 4 * (T * K + 2 * T * H))
  sq = _compat.SQUEEZED
  return pl.pallas_call(
      kernel,
      grid=(T, pl.cdiv(H, block_h)),
      in_specs=[
          pl.BlockSpec((sq, block_h, L), lambda t, h: (t, h, 0)),
          *(tiles.whole(a) for a in kv_args),
          pl.BlockSpec((sq, padded_k), lambda t, h: (t, 0)),
          pl.BlockSpec((sq, block_h, d_v), lambda t, h: (t, h, 0)),
          pl.BlockSpec((sq, block_h), lambda t, h: (t, h)),
          pl.BlockSpec((sq, block_h), lambda t, h: (t, h)),
      ],
      out_specs=pl.BlockSpec((sq, block_h, L), lambda t, h: (t, h, 0)),
      out_shape=jax.ShapeDtypeStruct((T, H, L), q_THL.dtype),
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=cost,
      interpret=interpret,
      name="sparse_mqa_dq",
  )(q_THL, *kv_args, topk_TK, dout_THV, lse_TH, delta_TH)


def sparse_mqa_drows(q_THL, kv_SL, topk_TK, dout_THV, lse_TH, delta_TH, *, sm_scale, config,
                     interpret=False):
  """Each (token, slot)'s row gradient, [T, K, L] float32; ``delta_TH`` is
  ``rowsum(dout * out) - dlse``. Invalid slots hold zeros (the caller drops them)."""
  (T, H, L), S, K, d_v = q_THL.shape, kv_SL.shape[0], topk_TK.shape[1], dout_THV.shape[-1]
  block_h, block_k = config.block_h, config.block_k
  padded_h = pl.cdiv(H, block_h) * block_h  # every head of the token; the head block overhangs
  padded_k = pl.cdiv(K, block_k) * block_k
  kernel = functools.partial(_sparse_mqa_drows_kernel, layout=_float_layout(L, d_v),
                             sm_scale=sm_scale, num_heads=H, num_rows=S, topk=K, config=config)
  itemsize = q_THL.dtype.itemsize
  cost = pl.CostEstimate(
      flops=4 * T * K * H * (L + d_v), transcendentals=T * K * H,
      bytes_accessed=itemsize * (T * H * (L + d_v) * pl.cdiv(K, block_k) + T * K * L)
      + 4 * (T * K * L + T * K + 2 * T * H))
  sq = _compat.SQUEEZED
  return pl.pallas_call(
      kernel,
      grid=(T, pl.cdiv(K, block_k)),
      in_specs=[
          pl.BlockSpec((sq, padded_h, L), lambda t, j: (t, 0, 0)),
          tiles.whole(kv_SL),
          pl.BlockSpec((sq, padded_k), lambda t, j: (t, 0)),
          pl.BlockSpec((sq, padded_h, d_v), lambda t, j: (t, 0, 0)),
          pl.BlockSpec((sq, padded_h), lambda t, j: (t, 0)),
          pl.BlockSpec((sq, padded_h), lambda t, j: (t, 0)),
      ],
      out_specs=pl.BlockSpec((sq, block_k, L), lambda t, j: (t, j, 0)),
      out_shape=jax.ShapeDtypeStruct((T, K, L), jnp.float32),
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=cost,
      interpret=interpret,
      name="sparse_mqa_drows",
  )(q_THL, kv_SL, topk_TK, dout_THV, lse_TH, delta_TH)


# The row sum reads a row's slots this many at a time (a [16, 512] float32 tile per step).
ROW_SUM_SLOTS, ROW_SUM_WARPS, ROW_SUM_STAGES = 16, 4, 2


def _sparse_mqa_row_sum_kernel(start_ref, end_ref, order_ref, drows_ref, dkv_ref):
  start, end = start_ref[0], end_ref[0]
  chunks = pow2_chunks(drows_ref.shape[-1])

  def body(i, accs):
    p0 = start + i * ROW_SUM_SLOTS
    in_row_N = p0 + jnp.arange(ROW_SUM_SLOTS, dtype=jnp.int32) < end
    slot_N = _compat.load(order_ref.at[pl.ds(p0, ROW_SUM_SLOTS)], mask=in_row_N, other=0)
    return tuple(
        acc_C + jnp.where(in_row_N[:, None], drows_ref[slot_N, pl.ds(c0, cw)], 0.0).sum(axis=0)
        for acc_C, (c0, cw) in zip(accs, chunks))

  accs = jax.lax.fori_loop(0, (end - start + ROW_SUM_SLOTS - 1) // ROW_SUM_SLOTS, body,
                           tuple(jnp.zeros((cw,), jnp.float32) for _, cw in chunks))
  for (c0, cw), acc_C in zip(chunks, accs):
    dkv_ref[pl.ds(c0, cw)] = acc_C


def sparse_mqa_row_sum(drows_NL, order_N, start_S, end_S, *, interpret=False):
  """``dkv[s] = sum of drows[order[p]] for p in [start[s], end[s])``, [S, L] float32: one
  program per row, its slots read in order, ``ROW_SUM_SLOTS`` at a time (a fixed order: no
  atomics)."""
  (N, L), S = drows_NL.shape, start_S.shape[0]
  sq = _compat.SQUEEZED
  return pl.pallas_call(
      _sparse_mqa_row_sum_kernel,
      grid=(S,),
      in_specs=[
          pl.BlockSpec((1,), lambda s: (s,)),
          pl.BlockSpec((1,), lambda s: (s,)),
          tiles.whole(order_N),
          tiles.whole(drows_NL),
      ],
      out_specs=pl.BlockSpec((sq, L), lambda s: (s, 0)),
      out_shape=jax.ShapeDtypeStruct((S, L), jnp.float32),
      compiler_params=_compat.compiler_params(ROW_SUM_WARPS, ROW_SUM_STAGES),
      cost_estimate=pl.CostEstimate(flops=N * L, transcendentals=0,
                                    bytes_accessed=4 * (N * L + S * L + N + 2 * S)),
      interpret=interpret,
      name="sparse_mqa_row_sum",
  )(start_S, end_S, order_N, drows_NL)


def _sum_into_rows(drows_TKL, topk_TK, num_rows, *, interpret):
  """``dkv[s] = sum of drows[t, k] over the slots naming row s`` in a fixed order; invalid slots
  add nothing. A stable sort of the slots by row gives each row its run of slots, which
  ``sparse_mqa_row_sum`` reads in place."""
  idx_N = topk_TK.reshape(-1)
  row_N = jnp.where((idx_N >= 0) & (idx_N < num_rows), idx_N, num_rows)  # invalid: sorted last
  order_N = jnp.argsort(row_N, stable=True).astype(jnp.int32)
  sorted_N = row_N[order_N]
  rows_S = jnp.arange(num_rows, dtype=jnp.int32)
  start_S = jnp.searchsorted(sorted_N, rows_S, side="left").astype(jnp.int32)
  end_S = jnp.searchsorted(sorted_N, rows_S, side="right").astype(jnp.int32)
  return sparse_mqa_row_sum(drows_TKL.reshape(idx_N.shape[0], -1), order_N, start_S, end_S,
                            interpret=interpret)


def _dkv(q_THL, kv_SL, topk_TK, dout_THV, lse_TH, delta_TH, *, sm_scale, config,
         drows_max_bytes, interpret):
  (T, _, L), S, K = q_THL.shape, kv_SL.shape[0], topk_TK.shape[1]
  # Under 2^31 elements a chunk, whatever the budget: the kernels address it with int32 offsets.
  chunk = max(1, min(T, min(drows_max_bytes // 4, 2**31 - 1) // (K * L)))

  def chunk_dkv(t0, size):
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, t0, size)
    topk_CK = take(topk_TK)
    drows_CKL = sparse_mqa_drows(take(q_THL), kv_SL, topk_CK, take(dout_THV), take(lse_TH),
                                 take(delta_TH), sm_scale=sm_scale, config=config,
                                 interpret=interpret)
    return _sum_into_rows(drows_CKL, topk_CK, S, interpret=interpret)

  num_full, rest = divmod(T, chunk)
  if num_full == 1:
    dkv_SL = chunk_dkv(0, chunk)
  else:  # chunks added in token order: the result does not depend on scheduling
    dkv_SL = jax.lax.fori_loop(1, num_full, lambda i, acc: acc + chunk_dkv(i * chunk, chunk),
                               chunk_dkv(0, chunk))
  if rest:
    dkv_SL = dkv_SL + chunk_dkv(num_full * chunk, rest)
  return dkv_SL.astype(kv_SL.dtype)


def sparse_mqa_backward(q_THL, kv_SL, topk_TK, out_THV, lse_TH, dout_THV, dlse_TH, *,
                        sm_scale: float, d_v: int, config: SparseMQABackwardConfig,
                        drows_max_bytes: int, interpret: bool):
  """``(dq_THL, dkv_SL)`` of sparse MQA from the forward's ``out`` and LSE and the cotangents
  of both; ``dkv_SL`` is zeros (each part's dtype) for ``Fp8LatentRows``.

  The arguments were validated by :func:`pallas_kernels.sparse_mqa.sparse_mqa`, which calls
  this from its VJP; T, H, S and K are nonzero.
  """
  delta_TH = (jnp.sum(dout_THV.astype(jnp.float32) * out_THV.astype(jnp.float32), axis=-1)
              - dlse_TH)
  dq_THL = sparse_mqa_dq(q_THL, kv_SL, topk_TK, dout_THV, lse_TH, delta_TH, sm_scale=sm_scale,
                         config=config.dq, interpret=interpret)
  if isinstance(kv_SL, Fp8LatentRows):
    return dq_THL, Fp8LatentRows(*(jnp.zeros_like(part) for part in kv_SL))
  dkv_SL = _dkv(q_THL, kv_SL, topk_TK, dout_THV, lse_TH, delta_TH, sm_scale=sm_scale,
                config=config.drows, drows_max_bytes=drows_max_bytes, interpret=interpret)
  return dq_THL, dkv_SL
