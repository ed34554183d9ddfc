"""Sparse MQA attention over gathered top-k latent rows (SPEC.md section 8.1).

Kernel layout (STYLE.md sections 9-10): one program handles ``block_h`` query heads of one token,
so heads are the M dimension of every dot and each gathered latent row is loaded once per
program, not once per head. The program walks the token's top-k row ``block_k`` indices at a
time: clamp, gather ``kv[idx]``, mask -1 / >= S with a finite negative, online softmax in fp32.
The 576-wide rows are split into power-of-two column chunks (512 latent + 64 rope) with separate
dots, so no tile is padded to 1024. Head counts that are not a multiple of ``block_h`` overhang
the block and are masked; arrays are never padded.

Batching: the kernel is per sequence, with request-local indices into that sequence's rows.
Batches (ragged prefill or decode) are ``jax.vmap`` of it, which Pallas turns into one more grid
axis; ragged batches therefore need no index offsetting or padding of the top-k rows, and a
decode batch of B tokens is a vmap over B sequences with T = 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.block_config import SparseMQAKernelConfig, pow2_chunks


def sparse_mqa_reference(q_THD, kv_SD, topk_TK, *, sm_scale: float, d_v: int):
  """Attention of every query head over the latent rows its token selected.

  Args:
    q_THD: queries, the absorbed form [q_lat (d_v) | q_pe (D - d_v)] per head.
    kv_SD: latent cache rows [c_kv (d_v) | k_pe (D - d_v)], one shared KV head.
    topk_TK: int32 row indices into ``kv_SD``; -1 and indices >= S are invalid.
    sm_scale: softmax scale, passed explicitly (never d_qk**-0.5 for MLA).
    d_v: width of the value part, the first ``d_v`` columns of each row.

  Returns:
    ``(out_THV, lse_TH)``: out in the dtype of ``q_THD``; the natural-log LSE in float32.
    A row with no valid index gives out 0 and LSE +inf (FlashMLA's "lonely row").
  """
  num_rows = kv_SD.shape[0]
  valid_TK = (topk_TK >= 0) & (topk_TK < num_rows)
  safe_TK = jnp.where(valid_TK, topk_TK, 0)
  rows_TKD = kv_SD[safe_TK]
  logits_THK = jnp.einsum(
      "thd,tkd->thk", q_THD, rows_TKD, preferred_element_type=jnp.float32
  ) * sm_scale
  logits_THK = jnp.where(valid_TK[:, None, :], logits_THK, -jnp.inf)
  lse_TH = jax.nn.logsumexp(logits_THK, axis=-1)
  any_valid_T = valid_TK.any(axis=-1)
  safe_lse_TH = jnp.where(any_valid_T[:, None], lse_TH, 0.0)
  probs_THK = jnp.exp(logits_THK - safe_lse_TH[..., None])
  out_THV = jnp.einsum(
      "thk,tkv->thv", probs_THK, rows_TKD[..., :d_v].astype(jnp.float32)
  )
  lse_TH = jnp.where(any_valid_T[:, None], lse_TH, jnp.inf)
  return out_THV.astype(q_THD.dtype), lse_TH


def _sparse_mqa_kernel(
    q_ref, kv_ref, topk_ref, out_ref, lse_ref, *, sm_scale, d_v, num_heads, num_rows, topk, config
):
  block_h, block_k = config.block_h, config.block_k
  heads_H = pl.program_id(1) * block_h + jnp.arange(block_h, dtype=jnp.int32)
  head_mask_H = heads_H < num_heads
  qk_chunks = pow2_chunks(q_ref.shape[-1])
  precision = _compat.dot_precision(q_ref.dtype)
  q_chunks = [
      _compat.load(q_ref.at[:, pl.ds(c0, cw)], mask=head_mask_H[:, None], other=0)
      for c0, cw in qk_chunks
  ]

  def body(j, carry):
    m_H, l_H, acc_HV = carry
    slots_K = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    idx_K = _compat.load(
        topk_ref.at[pl.ds(pl.multiple_of(j * block_k, block_k), block_k)],
        mask=slots_K < topk, other=-1,
    )
    valid_K = (idx_K >= 0) & (idx_K < num_rows)
    safe_K = jnp.where(valid_K, idx_K, 0)
    logits_HK = None
    for (c0, cw), q_HC in zip(qk_chunks, q_chunks):
      rows_KC = kv_ref[safe_K, pl.ds(c0, cw)]
      part_HK = jax.lax.dot_general(
          q_HC, rows_KC, (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32, precision=precision,
      )
      logits_HK = part_HK if logits_HK is None else logits_HK + part_HK
    logits_HK = jnp.where(valid_K[None, :], logits_HK * sm_scale, _compat.MASK_VALUE)
    m_new_H = jnp.maximum(m_H, logits_HK.max(axis=-1))
    # The where keeps fully masked blocks at 0 while m_new is still the mask value.
    p_HK = jnp.where(valid_K[None, :], jnp.exp(logits_HK - m_new_H[:, None]), 0.0)
    alpha_H = jnp.exp(m_H - m_new_H)
    rows_KV = kv_ref[safe_K, pl.ds(0, d_v)]
    pv_HV = jnp.dot(
        p_HK.astype(rows_KV.dtype), rows_KV,
        preferred_element_type=jnp.float32, precision=precision,
    )
    return m_new_H, l_H * alpha_H + p_HK.sum(axis=-1), acc_HV * alpha_H[:, None] + pv_HV

  init = (
      jnp.full((block_h,), _compat.MASK_VALUE, jnp.float32),
      jnp.zeros((block_h,), jnp.float32),
      jnp.zeros((block_h, d_v), jnp.float32),
  )
  m_H, l_H, acc_HV = jax.lax.fori_loop(0, pl.cdiv(topk, block_k), body, init)
  # Empty rows (no valid index) keep l = 0: explicit out 0 and LSE +inf.
  nonempty_H = l_H > 0.0
  safe_l_H = jnp.where(nonempty_H, l_H, 1.0)
  out_HV = acc_HV / safe_l_H[:, None]
  lse_H = jnp.where(nonempty_H, m_H + jnp.log(safe_l_H), jnp.inf)
  _compat.store(out_ref, out_HV.astype(out_ref.dtype), mask=head_mask_H[:, None])
  _compat.store(lse_ref, lse_H, mask=head_mask_H)


def _validate(q_THD, kv_SD, topk_TK, d_v):
  if q_THD.ndim != 3 or kv_SD.ndim != 2 or topk_TK.ndim != 2:
    raise ValueError(
        "sparse_mqa expects q [T, H, D], kv [S, D], topk [T, K]; got ranks"
        f" {q_THD.ndim}, {kv_SD.ndim}, {topk_TK.ndim}"
    )
  if q_THD.shape[-1] != kv_SD.shape[-1]:
    raise ValueError(f"q width {q_THD.shape[-1]} != kv width {kv_SD.shape[-1]}")
  if topk_TK.shape[0] != q_THD.shape[0]:
    raise ValueError(f"topk has {topk_TK.shape[0]} rows for {q_THD.shape[0]} query tokens")
  if not 0 < d_v <= q_THD.shape[-1]:
    raise ValueError(f"d_v must be in (0, D={q_THD.shape[-1]}], got {d_v}")
  if topk_TK.dtype != jnp.int32:
    raise TypeError(f"topk indices must be int32, got {topk_TK.dtype}")
  for name, x in (("q", q_THD), ("kv", kv_SD)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a float array, got {x.dtype}")
  if q_THD.dtype != kv_SD.dtype:
    raise TypeError(f"q dtype {q_THD.dtype} != kv dtype {kv_SD.dtype}")


def sparse_mqa(
    q_THD, kv_SD, topk_TK, *, sm_scale: float, d_v: int,
    config: SparseMQAKernelConfig | None = None, interpret: bool = False,
):
  """Pallas-Triton sparse MQA; same contract as :func:`sparse_mqa_reference`.

  The returned LSE is natural-log (any exp2 trick stays inside the kernel). Empty rows give
  out 0 and LSE +inf. ``config`` defaults to ``SparseMQAKernelConfig.default_for``.
  """
  _validate(q_THD, kv_SD, topk_TK, d_v)
  (T, H, D), (S, _), K = q_THD.shape, kv_SD.shape, topk_TK.shape[1]
  if config is None:
    config = SparseMQAKernelConfig.default_for(H, K, d_v)
  block_h, block_k = config.block_h, config.block_k
  padded_k = pl.cdiv(K, block_k) * block_k  # the top-k block overhangs; loads are masked
  kernel = functools.partial(
      _sparse_mqa_kernel, sm_scale=float(sm_scale), d_v=d_v, num_heads=H, num_rows=S, topk=K,
      config=config,
  )
  itemsize = q_THD.dtype.itemsize
  cost = pl.CostEstimate(
      flops=2 * T * K * H * (D + d_v),
      transcendentals=T * K * H,
      bytes_accessed=itemsize * (T * H * (D + d_v) + T * K * D * pl.cdiv(H, block_h))
      + 4 * (T * K + T * H),
  )
  sq = _compat.SQUEEZED
  return pl.pallas_call(
      kernel,
      grid=(T, pl.cdiv(H, block_h)),
      in_specs=[
          pl.BlockSpec((sq, block_h, D), lambda t, h: (t, h, 0)),
          pl.BlockSpec((S, D), lambda t, h: (0, 0)),
          pl.BlockSpec((sq, padded_k), lambda t, h: (t, 0)),
      ],
      out_specs=[
          pl.BlockSpec((sq, block_h, d_v), lambda t, h: (t, h, 0)),
          pl.BlockSpec((sq, block_h), lambda t, h: (t, h)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((T, H, d_v), q_THD.dtype),
          jax.ShapeDtypeStruct((T, H), jnp.float32),
      ],
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=cost,
      interpret=interpret,
      name="sparse_mqa_attention",
  )(q_THD, kv_SD, topk_TK)
