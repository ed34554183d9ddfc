"""The flash-attention backward of :func:`pallas_kernels.dense_mha.dense_mha`.

With the forward's LSE, the probabilities are recomputed per tile, p = exp(s - lse) for the
scaled logits s, and with delta = rowsum(dout * out) - dlse (dlse: the LSE's cotangent)

    dv = p^T dout,  dp = dout v^T,  ds = p * (dp - delta),  dq = ds k * scale,  dk = ds^T q * scale.

Two kernels per variant, each owning the rows it writes, so no atomics and a deterministic
sum order: ``*_dq`` (grid: query blocks x heads) walks the key blocks of the forward's
schedule, ``*_dkv`` (grid: key blocks x heads) walks the query blocks that see some key of its
block. Both recompute p and dp; the second QK^T product is cheaper than a [T, S] probability
buffer or a cross-program reduction.

Masking follows the forward (``dense_mha``'s module docstring): blocks that every query of the
pair sees whole run without masks, the others replace p and ds of hidden pairs with exact
zeros, so a NaN key or value that a query does not see never reaches a gradient. dq multiplies
ds by whole key rows, so the masked blocks zero the non-finite keys first (their pairs' ds is
0 already); a visible NaN row still makes its queries' gradients NaN through p or dp. A row
that sees nothing (LSE +inf) has p = 0 everywhere: zero gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.block_config import DenseMHAKernelConfig, pow2_chunks
from pallas_kernels.dense_mha_tiles import (block_schedule, causal_pairs, causal_walks, mask_bits,
                                            masked_walks, query_rows, sanitize_values,
                                            selected_pairs, visible_keys)


def _load_chunks(ref, rows, row_mask, chunks):
  return [_compat.load(ref.at[rows, pl.ds(c0, cw)], mask=row_mask[:, None], other=0)
          for c0, cw in chunks]


def _dot_t(a_MC, b_NC):
  """a b^T in fp32: [M, C] x [N, C] -> [M, N]."""
  return jax.lax.dot_general(a_MC, b_NC, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32,
                             precision=_compat.dot_precision(a_MC.dtype))


def _dot(a_MN, b_NC):
  return jnp.dot(a_MN, b_NC, preferred_element_type=jnp.float32,
                 precision=_compat.dot_precision(b_NC.dtype))


def _tile(q_chunks, k_chunks, do_chunks, v_chunks, lse_Q, delta_Q, visible_QK, sm_scale):
  """p and ds of one [block_q, block_k] tile; hidden pairs (``visible_QK`` False) give 0."""
  logits_QK = functools.reduce(jnp.add, map(_dot_t, q_chunks, k_chunks)) * sm_scale
  p_QK = jnp.exp(logits_QK - lse_Q[:, None])
  dp_QK = functools.reduce(jnp.add, map(_dot_t, do_chunks, v_chunks))
  ds_QK = p_QK * (dp_QK - delta_Q[:, None])
  if visible_QK is not None:  # where, not a product: a hidden pair's p or dp may be NaN
    p_QK, ds_QK = jnp.where(visible_QK, p_QK, 0.0), jnp.where(visible_QK, ds_QK, 0.0)
  return p_QK, ds_QK


def _dq_walk(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, walks, *, sm_scale,
             num_tokens, num_keys, block_k):
  """dq of one (query block, head) program over the forward's key-block ``walks``."""
  block_q = q_ref.shape[0]
  _, row_mask_Q = query_rows(block_q, num_tokens)
  qk_chunks, v_chunks = pow2_chunks(q_ref.shape[-1]), pow2_chunks(v_ref.shape[-1])
  all_rows = pl.ds(0, block_q)
  q_chunks = _load_chunks(q_ref, all_rows, row_mask_Q, qk_chunks)
  do_chunks = _load_chunks(do_ref, all_rows, row_mask_Q, v_chunks)
  lse_Q = _compat.load(lse_ref, mask=row_mask_Q, other=jnp.inf)
  delta_Q = _compat.load(delta_ref, mask=row_mask_Q, other=0)

  def body(n, accs, *, key_block, visible):
    start = pl.multiple_of(key_block(n) * block_k, block_k)
    cols_K = start + jnp.arange(block_k, dtype=jnp.int32)
    keys = pl.ds(start, block_k)
    k_chunks = _load_chunks(k_ref, keys, cols_K < num_keys, qk_chunks)
    v_chunks_KC = _load_chunks(v_ref, keys, cols_K < num_keys, v_chunks)
    visible_QK = None if visible is None else visible(start, cols_K)
    _, ds_QK = _tile(q_chunks, k_chunks, do_chunks, v_chunks_KC, lse_Q, delta_Q, visible_QK,
                     sm_scale)
    if visible_QK is not None:  # a hidden NaN key times its zero ds would still be NaN
      k_chunks = [sanitize_values(k_KC)[0] for k_KC in k_chunks]
    return tuple(acc_QC + _dot(ds_QK.astype(k_KC.dtype), k_KC)
                 for acc_QC, k_KC in zip(accs, k_chunks))

  accs = tuple(jnp.zeros((block_q, cw), jnp.float32) for _, cw in qk_chunks)
  for lower, upper, key_block, visible in walks:
    accs = jax.lax.fori_loop(
        lower, upper, functools.partial(body, key_block=key_block, visible=visible), accs)
  for (c0, cw), acc_QC in zip(qk_chunks, accs):
    _compat.store(dq_ref.at[:, pl.ds(c0, cw)], (acc_QC * sm_scale).astype(dq_ref.dtype),
                  mask=row_mask_Q[:, None])


def _dkv_walk(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, walks, *,
              sm_scale, num_tokens, num_keys, block_q):
  """dk and dv of one (key block, head) program over query-block ``walks``.

  ``walks``: ``(lower, upper, query_block, visible)`` loops; step n reads query block
  ``query_block(n)``; ``visible(start, rows_Q)`` is the [block_q, block_k] mask of the pairs
  its queries see, or None when they all see the whole key block.
  """
  block_k = k_ref.shape[0]
  cols_K = pl.program_id(0) * block_k + jnp.arange(block_k, dtype=jnp.int32)
  col_mask_K = cols_K < num_keys
  qk_chunks, v_chunks = pow2_chunks(q_ref.shape[-1]), pow2_chunks(v_ref.shape[-1])
  all_keys = pl.ds(0, block_k)
  k_chunks = _load_chunks(k_ref, all_keys, col_mask_K, qk_chunks)
  v_chunks_KC = _load_chunks(v_ref, all_keys, col_mask_K, v_chunks)

  def body(n, carry, *, query_block, visible):
    dk_accs, dv_accs = carry
    start = pl.multiple_of(query_block(n) * block_q, block_q)
    rows_Q = start + jnp.arange(block_q, dtype=jnp.int32)
    row_mask_Q = rows_Q < num_tokens
    queries = pl.ds(start, block_q)
    q_chunks = _load_chunks(q_ref, queries, row_mask_Q, qk_chunks)
    do_chunks = _load_chunks(do_ref, queries, row_mask_Q, v_chunks)
    # Rows past T load LSE +inf: p = 0 without a mask in the whole blocks.
    lse_Q = _compat.load(lse_ref.at[queries], mask=row_mask_Q, other=jnp.inf)
    delta_Q = _compat.load(delta_ref.at[queries], mask=row_mask_Q, other=0)
    visible_QK = None if visible is None else visible(start, rows_Q)
    p_QK, ds_QK = _tile(q_chunks, k_chunks, do_chunks, v_chunks_KC, lse_Q, delta_Q, visible_QK,
                        sm_scale)
    p_KQ, ds_KQ = p_QK.T, ds_QK.T
    dk_accs = tuple(acc + _dot(ds_KQ.astype(q_QC.dtype), q_QC)
                    for acc, q_QC in zip(dk_accs, q_chunks))
    dv_accs = tuple(acc + _dot(p_KQ.astype(do_QC.dtype), do_QC)
                    for acc, do_QC in zip(dv_accs, do_chunks))
    return dk_accs, dv_accs

  carry = (tuple(jnp.zeros((block_k, cw), jnp.float32) for _, cw in qk_chunks),
           tuple(jnp.zeros((block_k, cw), jnp.float32) for _, cw in v_chunks))
  for lower, upper, query_block, visible in walks:
    carry = jax.lax.fori_loop(
        lower, upper, functools.partial(body, query_block=query_block, visible=visible), carry)
  for ref, chunks, accs, scale in ((dk_ref, qk_chunks, carry[0], sm_scale),
                                   (dv_ref, v_chunks, carry[1], 1.0)):
    for (c0, cw), acc_KC in zip(chunks, accs):
      _compat.store(ref.at[:, pl.ds(c0, cw)], (acc_KC * scale).astype(ref.dtype),
                    mask=col_mask_K[:, None])


# ---- the four kernels: the causal and masked schedules around the two walks ----------------

def _dense_mha_dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, meta_ref, dq_ref, *,
                         sm_scale, num_tokens, num_keys, config):
  walks = causal_walks(meta_ref, num_keys=num_keys, block_q=config.block_q,
                       block_k=config.block_k)
  _dq_walk(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, walks, sm_scale=sm_scale,
           num_tokens=num_tokens, num_keys=num_keys, block_k=config.block_k)


def _masked_mha_dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bits_ref,
                          key_blocks_ref, num_blocks_ref, dq_ref, *, sm_scale, num_tokens,
                          num_keys, config):
  walks = masked_walks(bits_ref, key_blocks_ref, num_blocks_ref, num_tokens=num_tokens,
                       block_q=config.block_q)
  _dq_walk(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, walks, sm_scale=sm_scale,
           num_tokens=num_tokens, num_keys=num_keys, block_k=config.block_k)


def _dense_mha_dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, meta_ref, dk_ref,
                          dv_ref, *, sm_scale, num_tokens, num_keys, config):
  block_q, block_k = config.block_q, config.block_k
  q_offset, kv_len = meta_ref[0], jnp.minimum(meta_ref[1], num_keys)
  first_key = pl.program_id(0) * block_k
  cols_K = first_key + jnp.arange(block_k, dtype=jnp.int32)

  def causal(start, rows_Q):
    return (cols_K[None, :] <= q_offset + rows_Q[:, None]) & (cols_K[None, :] < kv_len)

  # Query t sees key s from t = s - q_offset on. The query blocks from num_masked on see the
  # whole key block (when it lies below kv_len); a block past kv_len is seen by none.
  num_q_blocks = pl.cdiv(num_tokens, block_q)
  first = jnp.where(first_key < kv_len,
                    jnp.clip(jnp.maximum(first_key - q_offset, 0) // block_q, 0, num_q_blocks),
                    num_q_blocks)
  whole = first_key + block_k <= kv_len
  first_whole = pl.cdiv(jnp.maximum(first_key + block_k - 1 - q_offset, 0), block_q)
  num_masked = jnp.where(whole, jnp.clip(first_whole, first, num_q_blocks), num_q_blocks)
  in_order = lambda i: i
  walks = [(first, num_masked, in_order, causal), (num_masked, num_q_blocks, in_order, None)]
  _dkv_walk(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, walks,
            sm_scale=sm_scale, num_tokens=num_tokens, num_keys=num_keys, block_q=block_q)


def _masked_mha_dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bits_ref,
                           query_blocks_ref, num_blocks_ref, dk_ref, dv_ref, *, sm_scale,
                           num_tokens, num_keys, config):
  block_q, block_k = config.block_q, config.block_k
  first_key = pl.program_id(0) * block_k
  cols_K = first_key + jnp.arange(block_k, dtype=jnp.int32)

  def selected(start, rows_Q):
    return selected_pairs(bits_ref, pl.ds(start, block_q), rows_Q < num_tokens, first_key,
                          cols_K)

  walks = [(0, num_blocks_ref[0], lambda n: query_blocks_ref[n], selected)]
  _dkv_walk(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, walks,
            sm_scale=sm_scale, num_tokens=num_tokens, num_keys=num_keys, block_q=block_q)


def dense_mha_backward(q_THQ, k_SHQ, v_SHV, out_THV, lse_TH, dout_THV, dlse_TH, *,
                       sm_scale: float, q_offset, kv_len, topk_TK=None, segment_ids_T=None,
                       configs: tuple[DenseMHAKernelConfig, DenseMHAKernelConfig] | None = None,
                       interpret: bool = False):
  """``(dq, dk, dv)`` of ``dense_mha`` (validated inputs, T, H, S > 0) given its outputs and
  their cotangents; ``configs``: the blocks of the dq and the dk/dv kernel (default
  ``DenseMHAKernelConfig.backward_for``)."""
  (T, H, Q), S, V = q_THQ.shape, k_SHQ.shape[0], v_SHV.shape[-1]
  dq_config, dkv_config = configs or DenseMHAKernelConfig.backward_for(T, S, Q, V)
  # Rows that see nothing (LSE +inf) have p = 0: whatever their dlse, it meets no pair.
  delta_TH = jnp.einsum("thv,thv->th", dout_THV.astype(jnp.float32),
                        out_THV.astype(jnp.float32))
  delta_TH = jnp.where(jnp.isfinite(lse_TH), delta_TH - dlse_TH, 0.0)
  sq = _compat.SQUEEZED
  padded_t = pl.cdiv(T, dkv_config.block_q) * dkv_config.block_q  # dk/dv programs read all q
  if topk_TK is None and segment_ids_T is None:
    meta = jnp.stack([q_offset, kv_len])
    meta_spec = pl.BlockSpec((2,), lambda i, h: (0,))
    dq_kernel, dq_name, dq_side, dq_specs = (
        _dense_mha_dq_kernel, "dense_mha_dq", (meta,), [meta_spec])
    dkv_kernel, dkv_name, dkv_side, dkv_specs = (
        _dense_mha_dkv_kernel, "dense_mha_dkv", (meta,), [meta_spec])
  else:
    # Each kernel tiles the pairs its own way: a bitmask and a block schedule for each.
    visible_TS = visible_keys(T, S, q_offset, kv_len, topk_TK, segment_ids_T)
    dq_bits_WT, dq_active_QN = mask_bits(visible_TS, dq_config)
    dkv_bits_WT, dkv_active_QN = mask_bits(visible_TS, dkv_config)
    key_blocks_QN, num_key_blocks_Q = block_schedule(dq_active_QN)
    query_blocks_KN, num_query_blocks_K = block_schedule(dkv_active_QN.T)
    dq_kernel, dq_name, dq_side, dq_specs = (
        _masked_mha_dq_kernel, "masked_mha_dq", (dq_bits_WT, key_blocks_QN, num_key_blocks_Q), [
            pl.BlockSpec((dq_bits_WT.shape[0], dq_config.block_q), lambda i, h: (0, i)),
            pl.BlockSpec((sq, key_blocks_QN.shape[1]), lambda i, h: (i, 0)),
            pl.BlockSpec((1,), lambda i, h: (i,)),
        ])
    dkv_kernel, dkv_name, dkv_side, dkv_specs = (
        _masked_mha_dkv_kernel, "masked_mha_dkv",
        (dkv_bits_WT, query_blocks_KN, num_query_blocks_K), [
            pl.BlockSpec((dkv_bits_WT.shape[0], padded_t), lambda j, h: (0, 0)),
            pl.BlockSpec((sq, query_blocks_KN.shape[1]), lambda j, h: (j, 0)),
            pl.BlockSpec((1,), lambda j, h: (j,)),
        ])
  args = (q_THQ, k_SHQ, v_SHV, dout_THV, lse_TH, delta_TH)
  static = dict(sm_scale=sm_scale, num_tokens=T, num_keys=S)
  # As the forward's estimate: every causal pair, an upper bound for the masked kernels. dq
  # takes three dots a pair (s, dp, ds k), dk/dv four (s, dp, p^T dout, ds^T q).
  pairs, itemsize = causal_pairs(T, S), q_THQ.dtype.itemsize
  row_bytes = itemsize * H * (T * (2 * Q + V) + S * (2 * Q + 2 * V)) + 8 * T * H
  estimate = lambda flops: pl.CostEstimate(flops=flops, transcendentals=H * pairs,
                                           bytes_accessed=row_bytes)

  block_q, block_k = dq_config.block_q, dq_config.block_k
  padded_s = pl.cdiv(S, block_k) * block_k
  dq_THQ = pl.pallas_call(
      functools.partial(dq_kernel, config=dq_config, **static),
      grid=(pl.cdiv(T, block_q), H),
      in_specs=[
          pl.BlockSpec((block_q, sq, Q), lambda i, h: (i, h, 0)),
          pl.BlockSpec((padded_s, sq, Q), lambda i, h: (0, h, 0)),
          pl.BlockSpec((padded_s, sq, V), lambda i, h: (0, h, 0)),
          pl.BlockSpec((block_q, sq, V), lambda i, h: (i, h, 0)),
          pl.BlockSpec((block_q, sq), lambda i, h: (i, h)),
          pl.BlockSpec((block_q, sq), lambda i, h: (i, h)),
          *dq_specs,
      ],
      out_specs=pl.BlockSpec((block_q, sq, Q), lambda i, h: (i, h, 0)),
      out_shape=jax.ShapeDtypeStruct((T, H, Q), q_THQ.dtype),
      compiler_params=_compat.compiler_params(dq_config.num_warps, dq_config.num_stages),
      cost_estimate=estimate(2 * H * (2 * Q + V) * pairs), interpret=interpret, name=dq_name,
  )(*args, *dq_side)

  block_q, block_k = dkv_config.block_q, dkv_config.block_k
  dk_SHQ, dv_SHV = pl.pallas_call(
      functools.partial(dkv_kernel, config=dkv_config, **static),
      grid=(pl.cdiv(S, block_k), H),
      in_specs=[
          pl.BlockSpec((padded_t, sq, Q), lambda j, h: (0, h, 0)),
          pl.BlockSpec((block_k, sq, Q), lambda j, h: (j, h, 0)),
          pl.BlockSpec((block_k, sq, V), lambda j, h: (j, h, 0)),
          pl.BlockSpec((padded_t, sq, V), lambda j, h: (0, h, 0)),
          pl.BlockSpec((padded_t, sq), lambda j, h: (0, h)),
          pl.BlockSpec((padded_t, sq), lambda j, h: (0, h)),
          *dkv_specs,
      ],
      out_specs=[
          pl.BlockSpec((block_k, sq, Q), lambda j, h: (j, h, 0)),
          pl.BlockSpec((block_k, sq, V), lambda j, h: (j, h, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((S, H, Q), k_SHQ.dtype),
          jax.ShapeDtypeStruct((S, H, V), v_SHV.dtype),
      ],
      compiler_params=_compat.compiler_params(dkv_config.num_warps, dkv_config.num_stages),
      cost_estimate=estimate(4 * H * (Q + V) * pairs), interpret=interpret, name=dkv_name,
  )(*args, *dkv_side)
  return dq_THQ, dk_SHQ, dv_SHV
