"""Dense causal multi-head attention for the MHA prefill route (SPEC.md section 5.1).

Kernel layout: flash attention with grid (query blocks, heads); each program walks key blocks
up to the causal diagonal with a dynamic ``fori_loop`` trip count (q_offset and kv_len arrive
as a small int32 array, so they may be traced). Head dims that are not powers of two (192 =
128 nope + 64 rope for DeepSeek, 48 in tests) are split into power-of-two column chunks with one
dot each, accumulated in fp32. We split rather than pad to 256 with a lane mask because padding
wastes a third of the QK dot and of the q/k loads at 192; the split costs only a second MMA
issue and is the same scheme as the sparse MQA kernel. The value width is chunked the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.block_config import DenseMHAKernelConfig, pow2_chunks


def dense_mha_reference(q_THD, k_SHD, v_SHV, *, sm_scale: float, q_offset, kv_len):
  """Causal attention where query t sits at position ``q_offset + t``.

  Args:
    q_THD, k_SHD: per-head queries and keys [nope | rope].
    v_SHV: per-head values.
    sm_scale: softmax scale.
    q_offset: int32 scalar, the position of query row 0 (the cached-context length).
    kv_len: int32 scalar, keys at rows >= kv_len are ignored.

  Returns:
    ``(out_THV, lse_TH)``; out in the dtype of ``q_THD``, natural-log LSE in float32.
    A query row that sees no key gives out 0 and LSE +inf.
  """
  logits_HTS = jnp.einsum(
      "thd,shd->hts", q_THD, k_SHD, preferred_element_type=jnp.float32
  ) * sm_scale
  rows_T = q_offset + jnp.arange(q_THD.shape[0], dtype=jnp.int32)
  cols_S = jnp.arange(k_SHD.shape[0], dtype=jnp.int32)
  visible_TS = (cols_S[None, :] <= rows_T[:, None]) & (cols_S[None, :] < kv_len)
  logits_HTS = jnp.where(visible_TS[None], logits_HTS, -jnp.inf)
  lse_HT = jax.nn.logsumexp(logits_HTS, axis=-1)
  any_visible_T = visible_TS.any(axis=-1)
  safe_lse_HT = jnp.where(any_visible_T[None], lse_HT, 0.0)
  probs_HTS = jnp.exp(logits_HTS - safe_lse_HT[..., None])
  out_THV = jnp.einsum("hts,shv->thv", probs_HTS, v_SHV.astype(jnp.float32))
  lse_TH = jnp.where(any_visible_T[None], lse_HT, jnp.inf).T
  return out_THV.astype(q_THD.dtype), lse_TH


def _dense_mha_kernel(
    q_ref, k_ref, v_ref, meta_ref, out_ref, lse_ref, *, sm_scale, num_tokens, num_keys, config
):
  block_q, block_k = config.block_q, config.block_k
  q_offset, kv_len = meta_ref[0], meta_ref[1]
  rows_Q = pl.program_id(0) * block_q + jnp.arange(block_q, dtype=jnp.int32)
  row_mask_Q = rows_Q < num_tokens
  positions_Q = q_offset + rows_Q
  qk_chunks, v_chunks = pow2_chunks(q_ref.shape[-1]), pow2_chunks(v_ref.shape[-1])
  precision = _compat.dot_precision(q_ref.dtype)
  q_chunks = [
      _compat.load(q_ref.at[:, pl.ds(c0, cw)], mask=row_mask_Q[:, None], other=0)
      for c0, cw in qk_chunks
  ]

  def body(j, carry):
    m_Q, l_Q, accs = carry
    start = pl.multiple_of(j * block_k, block_k)
    cols_K = start + jnp.arange(block_k, dtype=jnp.int32)
    col_mask_K = cols_K < num_keys
    logits_QK = None
    for (c0, cw), q_QC in zip(qk_chunks, q_chunks):
      k_KC = _compat.load(k_ref.at[pl.ds(start, block_k), pl.ds(c0, cw)], mask=col_mask_K[:, None], other=0)
      part_QK = jax.lax.dot_general(
          q_QC, k_KC, (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32, precision=precision,
      )
      logits_QK = part_QK if logits_QK is None else logits_QK + part_QK
    visible_QK = (cols_K[None, :] <= positions_Q[:, None]) & (cols_K[None, :] < kv_len)
    logits_QK = jnp.where(visible_QK, logits_QK * sm_scale, _compat.MASK_VALUE)
    m_new_Q = jnp.maximum(m_Q, logits_QK.max(axis=-1))
    # The where keeps fully masked blocks at 0 while m_new is still the mask value.
    p_QK = jnp.where(visible_QK, jnp.exp(logits_QK - m_new_Q[:, None]), 0.0)
    alpha_Q = jnp.exp(m_Q - m_new_Q)
    new_accs = []
    for (c0, cw), acc_QC in zip(v_chunks, accs):
      v_KC = _compat.load(v_ref.at[pl.ds(start, block_k), pl.ds(c0, cw)], mask=col_mask_K[:, None], other=0)
      pv_QC = jnp.dot(
          p_QK.astype(v_KC.dtype), v_KC, preferred_element_type=jnp.float32, precision=precision
      )
      new_accs.append(acc_QC * alpha_Q[:, None] + pv_QC)
    return m_new_Q, l_Q * alpha_Q + p_QK.sum(axis=-1), tuple(new_accs)

  # Keys past the block's last query position or past kv_len are never visible.
  last_visible = jnp.minimum(kv_len, q_offset + (pl.program_id(0) + 1) * block_q)
  num_blocks = jnp.clip(pl.cdiv(last_visible, block_k), 0, pl.cdiv(num_keys, block_k))
  init = (
      jnp.full((block_q,), _compat.MASK_VALUE, jnp.float32),
      jnp.zeros((block_q,), jnp.float32),
      tuple(jnp.zeros((block_q, cw), jnp.float32) for _, cw in v_chunks),
  )
  m_Q, l_Q, accs = jax.lax.fori_loop(0, num_blocks, body, init)
  # Rows that see no key keep l = 0: explicit out 0 and LSE +inf.
  nonempty_Q = l_Q > 0.0
  safe_l_Q = jnp.where(nonempty_Q, l_Q, 1.0)
  for (c0, cw), acc_QC in zip(v_chunks, accs):
    out_QC = (acc_QC / safe_l_Q[:, None]).astype(out_ref.dtype)
    _compat.store(out_ref.at[:, pl.ds(c0, cw)], out_QC, mask=row_mask_Q[:, None])
  lse_Q = jnp.where(nonempty_Q, m_Q + jnp.log(safe_l_Q), jnp.inf)
  _compat.store(lse_ref, lse_Q, mask=row_mask_Q)


def _validate(q_THD, k_SHD, v_SHV):
  if q_THD.ndim != 3 or k_SHD.ndim != 3 or v_SHV.ndim != 3:
    raise ValueError(
        "dense_mha expects q [T, H, D], k [S, H, D], v [S, H, V]; got ranks"
        f" {q_THD.ndim}, {k_SHD.ndim}, {v_SHV.ndim}"
    )
  if k_SHD.shape[1:] != q_THD.shape[1:]:
    raise ValueError(f"k heads/width {k_SHD.shape[1:]} != q heads/width {q_THD.shape[1:]}")
  if v_SHV.shape[:2] != k_SHD.shape[:2]:
    raise ValueError(f"v rows/heads {v_SHV.shape[:2]} != k rows/heads {k_SHD.shape[:2]}")
  for name, x in (("q", q_THD), ("k", k_SHD), ("v", v_SHV)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a float array, got {x.dtype}")
  if not q_THD.dtype == k_SHD.dtype == v_SHV.dtype:
    raise TypeError(f"q, k, v dtypes differ: {q_THD.dtype}, {k_SHD.dtype}, {v_SHV.dtype}")


def _int32_scalar(name, x):
  x = jnp.asarray(x)
  if x.shape != () or not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer scalar, got {x.dtype}{list(x.shape)}")
  return x.astype(jnp.int32)


def dense_mha(
    q_THD, k_SHD, v_SHV, *, sm_scale: float, q_offset, kv_len,
    config: DenseMHAKernelConfig | None = None, interpret: bool = False,
):
  """Pallas-Triton causal flash attention; same contract as :func:`dense_mha_reference`."""
  _validate(q_THD, k_SHD, v_SHV)
  meta = jnp.stack([_int32_scalar("q_offset", q_offset), _int32_scalar("kv_len", kv_len)])
  (T, H, D), S, V = q_THD.shape, k_SHD.shape[0], v_SHV.shape[-1]
  if config is None:
    config = DenseMHAKernelConfig.default_for(T, S, D, V)
  block_q, block_k = config.block_q, config.block_k
  padded_s = pl.cdiv(S, block_k) * block_k  # the key block overhangs; loads are masked
  kernel = functools.partial(
      _dense_mha_kernel, sm_scale=float(sm_scale), num_tokens=T, num_keys=S, config=config
  )
  # Causal pairs for q_offset = 0 and kv_len = S, the common prefill case.
  pairs = sum(min(t + 1, S) for t in range(T))
  itemsize = q_THD.dtype.itemsize
  cost = pl.CostEstimate(
      flops=2 * H * (D + V) * pairs,
      transcendentals=H * pairs,
      bytes_accessed=itemsize * H * (T * (D + V) + S * (D + V) * pl.cdiv(T, block_q)) + 4 * T * H,
  )
  sq = _compat.SQUEEZED
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(T, block_q), H),
      in_specs=[
          pl.BlockSpec((block_q, sq, D), lambda i, h: (i, h, 0)),
          pl.BlockSpec((padded_s, sq, D), lambda i, h: (0, h, 0)),
          pl.BlockSpec((padded_s, sq, V), lambda i, h: (0, h, 0)),
          pl.BlockSpec((2,), lambda i, h: (0,)),
      ],
      out_specs=[
          pl.BlockSpec((block_q, sq, V), lambda i, h: (i, h, 0)),
          pl.BlockSpec((block_q, sq), lambda i, h: (i, h)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((T, H, V), q_THD.dtype),
          jax.ShapeDtypeStruct((T, H), jnp.float32),
      ],
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=cost,
      interpret=interpret,
      name="dense_mha_prefill",
  )(q_THD, k_SHD, v_SHV, meta)
