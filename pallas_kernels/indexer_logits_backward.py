"""Backward of the lightning-indexer logits (:mod:`pallas_kernels.indexer_logits`).

``logits[t, s] = c[s] * sum_g w[t, g] * relu(q[t, g] . k[s])`` on each row's window, c the key
scales (1 without). With ``ds[t, s] = c[s] * dlogits[t, s]`` on the window (0 elsewhere) and
``m[t, g, s] = 1[q[t, g] . k[s] > 0]`` (relu' is 0 at 0, as ``jax.nn.relu``):

  dw[t, g] = sum_s ds[t, s] * relu(q[t, g] . k[s])
  dq[t, g] = w[t, g] * sum_s ds[t, s] * m[t, g, s] * k[s]
  dk[s]    = sum_{t, g} ds[t, s] * w[t, g] * m[t, g, s] * q[t, g]

Two kernels, each the only writer of what it writes, so every sum is one program's loop in a
fixed order (deterministic, no atomics). ``indexer_logits_dq``: grid (token blocks, heads); a
program recomputes its head's dots over the key blocks that some row of its token block scores
and writes dq and dw of its rows. ``indexer_logits_dk``: grid (key blocks,); a program walks the
token blocks that score one of its keys and, in each, every head. Which blocks meet is worked
out by XLA before the calls from the windows alone (a [T, S / block_s] comparison), as the
masked MHA kernel's block lists.

Pool mode (``key_rows_S``): dk is computed per column, then summed into the pool's rows by a
segmented scan over the columns sorted by row id, so a row named twice gets both terms, in a
fixed order. fp8 keys and key scales are constants: they get no cotangent, and no dk kernel runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.block_config import IndexerLogitsKernelConfig
from pallas_kernels.indexer_logits_tiles import FP8, key_tile, pooled_key_rows, valid_rows


def meeting_blocks(starts_T, ends_T, num_keys: int, block_t: int, block_s: int):
  """[T / block_t, S / block_s] bool: some row of the token block scores a key of the key block
  (its window, clipped to [0, S), reaches into the key block)."""
  T = starts_T.shape[0]
  num_t_blocks, num_s_blocks = pl.cdiv(T, block_t), pl.cdiv(num_keys, block_s)
  lo_T, hi_T = jnp.clip(starts_T, 0, num_keys), jnp.clip(ends_T, 0, num_keys)
  blocks_J = jnp.arange(num_s_blocks, dtype=jnp.int32)
  meets_TJ = ((lo_T < hi_T)[:, None] & (blocks_J[None, :] >= (lo_T // block_s)[:, None])
              & (blocks_J[None, :] <= ((hi_T - 1) // block_s)[:, None]))
  meets_TJ = jnp.pad(meets_TJ, ((0, num_t_blocks * block_t - T), (0, 0)))
  return meets_TJ.reshape(num_t_blocks, block_t, num_s_blocks).any(axis=1)


def _block_lists(meets_NM):
  """Per row: the meeting columns ascending, then the others (never read); and how many meet."""
  order_NM = jnp.argsort(~meets_NM, axis=-1, stable=True).astype(jnp.int32)
  return order_NM, meets_NM.sum(axis=-1, dtype=jnp.int32)


def _key_operands(k_SI, k_scale_S, key_rows_S, dtype, block: int, key_block):
  """``(read_keys, args, specs, num_per_key)`` of the key inputs: the per-key ones (keys and
  scales, or the pool's row ids) in blocks of ``block`` at block ``key_block(*program ids)``,
  the pool and its scales whole; ``read_keys`` is the forward's tile reader (contiguous or
  pooled, from :mod:`pallas_kernels.indexer_logits_tiles`)."""
  scales = () if k_scale_S is None else (k_scale_S.astype(jnp.float32),)
  if key_rows_S is None:
    read_keys, per_key, pool = key_tile, (k_SI, *scales), ()
  else:
    read_keys = functools.partial(pooled_key_rows, dtype=dtype)
    per_key, pool = (key_rows_S,), (k_SI, *scales)
  blocked = lambda a: pl.BlockSpec((block, *a.shape[1:]),
                                   lambda *ids: (key_block(*ids),) + (0,) * (a.ndim - 1))
  whole = lambda a: pl.BlockSpec(a.shape, lambda *ids: (0,) * a.ndim)
  return read_keys, (*per_key, *pool), [*map(blocked, per_key), *map(whole, pool)], len(per_key)


def _second_dot_dtype(dtype):
  """The operand dtype of the dots with relu' weights: fp8 q and k are widened to bf16 (exact)."""
  return jnp.bfloat16 if jnp.dtype(dtype) == FP8 else dtype


def _scored(starts_T, ends_T, cols_S, has_key_S):
  return ((cols_S[None, :] >= starts_T[:, None]) & (cols_S[None, :] < ends_T[:, None])
          & has_key_S[None, :])


def _dq_kernel(q_ref, w_ref, starts_ref, ends_ref, dl_ref, blocks_ref, count_ref, *refs,
               read_keys, num_per_key, num_tokens, num_keys, block_s):
  *key_refs, dq_ref, dw_ref = refs
  block_t = q_ref.shape[0]
  rows_T = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
  row_mask_T = rows_T < num_tokens
  starts_T = _compat.load(starts_ref, mask=row_mask_T, other=num_keys)
  ends_T = _compat.load(ends_ref, mask=row_mask_T, other=0)
  q_TI = _compat.load(q_ref, mask=row_mask_T[:, None], other=0)
  w_T = _compat.load(w_ref, mask=row_mask_T, other=0.0)
  mm_dtype = _second_dot_dtype(q_ref.dtype)

  def key_block(n, carry):
    dq_TI, dw_T = carry
    start = pl.multiple_of(blocks_ref[n] * block_s, block_s)
    cols_S = start + jnp.arange(block_s, dtype=jnp.int32)
    col_mask_S = cols_S < num_keys
    tile_refs = [r.at[pl.ds(start, block_s)] for r in key_refs[:num_per_key]]
    has_key_S, k_SI, read_scale = read_keys(col_mask_S, *tile_refs, *key_refs[num_per_key:])
    inside_TS = _scored(starts_T, ends_T, cols_S, has_key_S)
    dl_TS = _compat.load(dl_ref.at[:, pl.ds(start, block_s)],
                         mask=row_mask_T[:, None] & col_mask_S[None, :], other=0.0)
    if read_scale is not None:
      dl_TS = dl_TS * read_scale()[None, :]
    ds_TS = jnp.where(inside_TS, dl_TS, 0.0)  # replaced: dlogits of -inf logits may be NaN
    dots_TS = jax.lax.dot_general(
        q_TI, k_SI, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
        precision=_compat.dot_precision(q_ref.dtype),
    )
    active_TS = inside_TS & (dots_TS > 0)
    dw_T = dw_T + jnp.where(active_TS, ds_TS * dots_TS, 0.0).sum(axis=1)
    # A key no row of the block scores may hold NaN or inf (0 * NaN in the dot): zeroed.
    scored_S = jnp.where(inside_TS, 1.0, 0.0).max(axis=0) > 0  # Triton reduces no bools
    k_SI = jnp.where(scored_S[:, None], k_SI.astype(mm_dtype), 0)
    p_TS = jnp.where(active_TS, ds_TS, 0.0).astype(mm_dtype)
    dq_TI = dq_TI + jnp.dot(p_TS, k_SI, preferred_element_type=jnp.float32,
                            precision=_compat.dot_precision(mm_dtype))
    return dq_TI, dw_T

  dq_TI, dw_T = jax.lax.fori_loop(
      0, count_ref[0], key_block,
      (jnp.zeros(q_ref.shape, jnp.float32), jnp.zeros((block_t,), jnp.float32)))
  _compat.store(dq_ref, (dq_TI * w_T[:, None]).astype(dq_ref.dtype), mask=row_mask_T[:, None])
  _compat.store(dw_ref, dw_T, mask=row_mask_T)


def _dk_kernel(q_ref, w_ref, starts_ref, ends_ref, dl_ref, blocks_ref, count_ref, *refs,
               read_keys, num_tokens, num_keys, num_heads, dim, block_t):
  *key_refs, dk_ref = refs
  block_s = dk_ref.shape[0]
  cols_S = pl.program_id(0) * block_s + jnp.arange(block_s, dtype=jnp.int32)
  col_mask_S = cols_S < num_keys
  has_key_S, k_SI, read_scale = read_keys(col_mask_S, *key_refs)
  scale_S = None if read_scale is None else read_scale()
  mm_dtype = _second_dot_dtype(q_ref.dtype)

  def token_block(n, dk_SI):
    row0 = pl.multiple_of(blocks_ref[n] * block_t, block_t)
    rows_T = row0 + jnp.arange(block_t, dtype=jnp.int32)
    row_mask_T = rows_T < num_tokens
    starts_T = _compat.load(starts_ref.at[pl.ds(row0, block_t)], mask=row_mask_T, other=num_keys)
    ends_T = _compat.load(ends_ref.at[pl.ds(row0, block_t)], mask=row_mask_T, other=0)
    inside_TS = _scored(starts_T, ends_T, cols_S, has_key_S)
    dl_TS = _compat.load(dl_ref.at[pl.ds(row0, block_t)],
                         mask=row_mask_T[:, None] & col_mask_S[None, :], other=0.0)
    if scale_S is not None:
      dl_TS = dl_TS * scale_S[None, :]
    ds_TS = jnp.where(inside_TS, dl_TS, 0.0)

    def head(g, dk_SI):
      q_TI = _compat.load(
          q_ref.at[pl.ds(row0, block_t), pl.ds(pl.multiple_of(g * dim, dim), dim)],
          mask=row_mask_T[:, None], other=0,
      )
      w_T = _compat.load(w_ref.at[g, pl.ds(row0, block_t)], mask=row_mask_T, other=0.0)
      dots_TS = jax.lax.dot_general(
          q_TI, k_SI, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
          precision=_compat.dot_precision(q_ref.dtype),
      )
      # Replaced, not multiplied: a NaN key gives NaN dots, which must not reach dk.
      p_TS = jnp.where(inside_TS & (dots_TS > 0), ds_TS * w_T[:, None], 0.0)
      return dk_SI + jax.lax.dot_general(
          p_TS.astype(mm_dtype), q_TI.astype(mm_dtype), (((0,), (0,)), ((), ())),
          preferred_element_type=jnp.float32, precision=_compat.dot_precision(mm_dtype),
      )

    return jax.lax.fori_loop(0, num_heads, head, dk_SI)

  dk_SI = jax.lax.fori_loop(0, count_ref[0], token_block,
                            jnp.zeros((block_s, dim), jnp.float32))
  _compat.store(dk_ref, dk_SI, mask=col_mask_S[:, None])


def _common_operands(dlogits_TS, q_TGI, w_TG, starts_T, ends_T):
  T, G, I = q_TGI.shape
  return [q_TGI.reshape(T, G * I), w_TG.astype(jnp.float32).T, starts_T, ends_T,
          dlogits_TS.astype(jnp.float32)]


def indexer_logits_dq(dlogits_TS, q_TGI, k_SI, w_TG, starts_T, ends_T, *, k_scale_S=None,
                      key_rows_S=None, config: IndexerLogitsKernelConfig | None = None,
                      interpret: bool = False):
  """``(dq_TGI, dw_TG)`` of the logits' cotangent ``dlogits_TS`` (in the dtypes of q and w).

  The arguments are those of :func:`pallas_kernels.indexer_logits.indexer_logits` (already
  validated, T and S nonzero). Masked pairs and keys no row scores (NaN there included)
  contribute exactly 0.
  """
  (T, G, I), S = q_TGI.shape, dlogits_TS.shape[1]
  config = config or IndexerLogitsKernelConfig.backward_for(T, S)
  block_t, block_s = config.block_t, config.block_s
  padded_s = pl.cdiv(S, block_s) * block_s  # the last key block overhangs; loads are masked
  key_blocks_NJ, counts_N = _block_lists(meeting_blocks(starts_T, ends_T, S, block_t, block_s))
  read_keys, key_args, key_specs, num_per_key = _key_operands(
      k_SI, k_scale_S, key_rows_S, q_TGI.dtype, padded_s, lambda t, g: 0)
  sq = _compat.SQUEEZED
  kernel = functools.partial(_dq_kernel, read_keys=read_keys, num_per_key=num_per_key,
                             num_tokens=T, num_keys=S, block_s=block_s)
  dq_TX, dw_GT = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(T, block_t), G),
      in_specs=[
          pl.BlockSpec((block_t, I), lambda t, g: (t, g)),
          pl.BlockSpec((sq, block_t), lambda t, g: (g, t)),
          pl.BlockSpec((block_t,), lambda t, g: (t,)),
          pl.BlockSpec((block_t,), lambda t, g: (t,)),
          pl.BlockSpec((block_t, padded_s), lambda t, g: (t, 0)),
          pl.BlockSpec((sq, key_blocks_NJ.shape[1]), lambda t, g: (t, 0)),
          pl.BlockSpec((1,), lambda t, g: (t,)),
          *key_specs,
      ],
      out_specs=[
          pl.BlockSpec((block_t, I), lambda t, g: (t, g)),
          pl.BlockSpec((sq, block_t), lambda t, g: (g, t)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((T, G * I), q_TGI.dtype),
          jax.ShapeDtypeStruct((G, T), jnp.float32),
      ],
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=pl.CostEstimate(flops=4 * T * S * G * I, transcendentals=0,
                                    bytes_accessed=4 * T * S * G + q_TGI.dtype.itemsize * (
                                        2 * T * G * I + G * S * I * pl.cdiv(T, block_t))),
      interpret=interpret,
      name="indexer_logits_dq",
  )(*_common_operands(dlogits_TS, q_TGI, w_TG, starts_T, ends_T), key_blocks_NJ, counts_N,
    *key_args)
  return dq_TX.reshape(T, G, I), dw_GT.T.astype(w_TG.dtype)


def indexer_logits_dk(dlogits_TS, q_TGI, k_SI, w_TG, starts_T, ends_T, *, k_scale_S=None,
                      key_rows_S=None, config: IndexerLogitsKernelConfig | None = None,
                      interpret: bool = False):
  """The cotangent of float keys ``k_SI`` (of the pool's rows with ``key_rows_S``), its dtype.

  Same arguments as :func:`indexer_logits_dq`. Pool rows no column names get 0; a row named by
  several columns gets the sum of their terms.
  """
  (T, G, I), S = q_TGI.shape, dlogits_TS.shape[1]
  config = config or IndexerLogitsKernelConfig.backward_for(T, S)
  block_t, block_s = config.block_t, config.block_s
  padded_t = pl.cdiv(T, block_t) * block_t
  token_blocks_JN, counts_J = _block_lists(
      meeting_blocks(starts_T, ends_T, S, block_t, block_s).T)
  read_keys, key_args, key_specs, _ = _key_operands(
      k_SI, k_scale_S, key_rows_S, q_TGI.dtype, block_s, lambda s: s)
  sq = _compat.SQUEEZED
  kernel = functools.partial(_dk_kernel, read_keys=read_keys, num_tokens=T, num_keys=S,
                             num_heads=G, dim=I, block_t=block_t)
  dk_SI = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(S, block_s),),
      in_specs=[
          pl.BlockSpec((padded_t, G * I), lambda s: (0, 0)),
          pl.BlockSpec((G, padded_t), lambda s: (0, 0)),
          pl.BlockSpec((padded_t,), lambda s: (0,)),
          pl.BlockSpec((padded_t,), lambda s: (0,)),
          pl.BlockSpec((padded_t, block_s), lambda s: (0, s)),
          pl.BlockSpec((sq, token_blocks_JN.shape[1]), lambda s: (s, 0)),
          pl.BlockSpec((1,), lambda s: (s,)),
          *key_specs,
      ],
      out_specs=pl.BlockSpec((block_s, I), lambda s: (s, 0)),
      out_shape=jax.ShapeDtypeStruct((S, I), jnp.float32),
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=pl.CostEstimate(flops=4 * T * S * G * I, transcendentals=0,
                                    bytes_accessed=4 * T * S + 4 * S * I + q_TGI.dtype.itemsize
                                    * T * G * I * pl.cdiv(S, block_s)),
      interpret=interpret,
      name="indexer_logits_dk",
  )(*_common_operands(dlogits_TS, q_TGI, w_TG, starts_T, ends_T), token_blocks_JN, counts_J,
    *key_args)
  if key_rows_S is not None:
    dk_SI = sum_into_rows(dk_SI, key_rows_S, k_SI.shape[0])
  return dk_SI.astype(k_SI.dtype)


def sum_into_rows(d_SI, rows_S, num_rows: int):
  """[num_rows, I]: row r is the sum of ``d_SI[s]`` over the columns with ``rows_S[s] == r``
  (ids outside [0, num_rows) are dropped), deterministically: a segmented scan over the columns
  sorted by row id, then one write per distinct row (no scatter-add, whose atomics would sum a
  repeated row in a varying order)."""
  valid_S, _ = valid_rows(rows_S, num_rows)
  order_S = jnp.argsort(jnp.where(valid_S, rows_S, num_rows), stable=True)
  rows_S, d_SI = jnp.where(valid_S, rows_S, num_rows)[order_S], d_SI[order_S]
  new_row_S = jnp.concatenate([jnp.ones((1,), bool), rows_S[1:] != rows_S[:-1]])

  def add(a, b):  # segmented sum: a run restarts where b starts a new row
    (new_a, sum_a), (new_b, sum_b) = a, b
    return new_a | new_b, jnp.where(new_b[:, None], sum_b, sum_a + sum_b)

  _, sums_SI = jax.lax.associative_scan(add, (new_row_S, d_SI))
  last_S = jnp.concatenate([rows_S[1:] != rows_S[:-1], jnp.ones((1,), bool)])
  spare_S = num_rows + jnp.arange(rows_S.shape[0], dtype=rows_S.dtype)  # distinct, dropped
  target_S = jnp.where(last_S, rows_S, spare_S)
  return jnp.zeros((num_rows, d_SI.shape[1]), d_SI.dtype).at[target_S].set(
      sums_SI, mode="drop", unique_indices=True)


def indexer_logits_vjp(dlogits_TS, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S, key_rows_S,
                       *, interpret: bool = False):
  """The cotangents of :func:`pallas_kernels.indexer_logits.indexer_logits`'s array arguments:
  ``(dq, dk, dw, None, None, None, None)``; dk is None (zero) for fp8 keys, and the windows,
  key scales and row ids get none."""
  kwargs = dict(k_scale_S=k_scale_S, key_rows_S=key_rows_S, interpret=interpret)
  args = (dlogits_TS, q_TGI, k_SI, w_TG, starts_T, ends_T)
  dq_TGI, dw_TG = indexer_logits_dq(*args, **kwargs)
  dk_SI = None if k_SI.dtype == FP8 else indexer_logits_dk(*args, **kwargs)
  return dq_TGI, dk_SI, dw_TG, None, None, None, None
