"""Dense causal multi-head attention for the MHA prefill route (docs/design.md §2).

Kernel layout: flash attention with grid (query blocks, heads); each program walks key blocks
up to the causal diagonal with a dynamic ``fori_loop`` trip count (q_offset and kv_len arrive
as a small int32 array, so they may be traced). Key blocks that every query of the program sees
whole run without masks; the blocks on the diagonal or at ``kv_len`` replace hidden logits and
non-finite values before they meet a probability, so a NaN in a hidden row stays hidden.

Head dims that are not powers of two (192 = 128 nope + 64 rope for DeepSeek, 48 in tests) are
split into power-of-two column chunks with one dot each, accumulated in fp32. We split rather
than pad to 256 with a lane mask because padding wastes a third of the QK dot and of the q/k
loads at 192; the split costs only a second MMA issue and is the same scheme as the sparse MQA
kernel. The value width is chunked the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _checks, _compat
from pallas_kernels.block_config import DenseMHAKernelConfig, pow2_chunks


def validate_dense_mha(q_THQ, k_SHQ, v_SHV, sm_scale, q_offset, kv_len, topk_TK=None):
  """The one argument check of :func:`dense_mha` and :func:`dense_mha_reference`.

  Returns ``(sm_scale, q_offset, kv_len)``: a Python float and two int32 scalars.
  """
  op = "dense_mha"
  T, H, Q = _checks.array(op, "q_THQ", q_THQ, "THQ")
  S, _, _ = _checks.array(op, "k_SHQ", k_SHQ, "SHQ")
  _, _, V = _checks.array(op, "v_SHV", v_SHV, "SHV")
  if k_SHQ.shape[1:] != (H, Q):
    raise ValueError(f"{op}: k_SHQ heads and width {k_SHQ.shape[1:]} != those of q_THQ {(H, Q)}")
  if v_SHV.shape[:2] != (S, H):
    raise ValueError(f"{op}: v_SHV rows and heads {v_SHV.shape[:2]} != those of k_SHQ {(S, H)}")
  if Q == 0 or V == 0:
    raise ValueError(f"{op}: the widths of q_THQ/k_SHQ (Q={Q}) and v_SHV (V={V}) must be positive")
  for name, x in (("q_THQ", q_THQ), ("k_SHQ", k_SHQ), ("v_SHV", v_SHV)):
    _checks.float_dtype(op, name, x)
  _checks.same_dtype(op, q_THQ=q_THQ, k_SHQ=k_SHQ, v_SHV=v_SHV)
  sm_scale = _checks.positive_float(op, "sm_scale", sm_scale)
  # A negative offset puts query rows before position 0: they see no key and would come out
  # as silent zero rows with LSE +inf.
  q_offset = _checks.int32_scalar(op, "q_offset", q_offset, minimum=0)
  kv_len = _checks.int32_scalar(op, "kv_len", kv_len)
  if topk_TK is not None:
    _checks.array(op, "topk_TK", topk_TK, "TK")
    if topk_TK.shape[0] != T:
      raise ValueError(f"{op}: topk_TK has {topk_TK.shape[0]} rows for the {T} tokens of q_THQ")
    _checks.int32_array(op, "topk_TK", topk_TK)
  return sm_scale, q_offset, kv_len


def selected_keys(topk_TK, num_keys: int):
  """The keys each query selected as a bool mask [T, S]: -1 and indices >= S select nothing.

  A scatter of T*K entries (never a [T, K, S] one-hot). A repeated index selects its key once,
  where sparse MQA would count it twice; the indexer's top-k has no repeats.
  """
  valid_TK = (topk_TK >= 0) & (topk_TK < num_keys)
  cols_TK = jnp.where(valid_TK, topk_TK, num_keys)  # invalid slots land in a spare column
  rows_TK = jnp.broadcast_to(jnp.arange(topk_TK.shape[0])[:, None], topk_TK.shape)
  mask_TS = jnp.zeros((topk_TK.shape[0], num_keys + 1), jnp.bool_).at[rows_TK, cols_TK].set(True)
  return mask_TS[:, :num_keys]


def _nothing_to_attend(q_THQ, k_SHQ, v_SHV):
  """T, H or S is 0: every row (if any) sees no key, out 0 and LSE +inf, with no kernel run."""
  (T, H, _), S, V = q_THQ.shape, k_SHQ.shape[0], v_SHV.shape[-1]
  return _checks.no_attention(T, H, V, q_THQ.dtype) if 0 in (T, H, S) else None


def _sanitize_values(values):
  """``values`` with NaN/inf replaced by 0, and a bool mask of the rows (all axes but the last)
  that held any.

  One value row may be hidden from one query and seen by another of the same dot, so it cannot
  be zeroed per query: its non-finite values are zeroed for all (0 * NaN would be NaN for the
  queries that must not see it), and the queries that do see it get a NaN weight for it
  instead, which makes their output and LSE NaN as an unmasked NaN would.
  """
  finite = jnp.isfinite(values)
  bad_rows = jnp.where(finite, 0.0, 1.0).max(axis=-1) > 0  # Triton has no reduction over bools
  return jnp.where(finite, values, 0), bad_rows


def dense_mha_reference(q_THQ, k_SHQ, v_SHV, *, sm_scale: float, q_offset, kv_len,
                        topk_TK=None):
  """Causal attention where query t sits at position ``q_offset + t``, optionally masked.

  Args:
    q_THQ, k_SHQ: per-head queries and keys [nope | rope], Q = N + R wide.
    v_SHV: per-head values.
    sm_scale: softmax scale, a finite positive float.
    q_offset: integer scalar >= 0 (int32 range, may be traced: then unchecked), the position
      of query row 0 (the cached-context length).
    kv_len: integer scalar (may be traced); keys at rows >= kv_len are ignored.
    topk_TK: None, or int32 key rows per query (the MASKED_MHA route): query t then sees only
      the causal keys in ``topk_TK[t]``; -1 and indices >= S are ignored. With the indexer's
      top-k this equals sparse MQA over the same rows (``sparse_mqa_reference``), up to
      rounding.

  Returns:
    ``(out_THV, lse_TH)``; out in the dtype of ``q_THQ``, natural-log LSE in float32.
    A query row that sees no key (with ``topk_TK``: none selected) gives out 0 and LSE +inf;
    so do all rows when S = 0. T = 0 gives empty outputs.

  NaN or inf in a key or value row that a query does not see (a future token, a row at or past
  ``kv_len``) never reaches that query's output or LSE. A non-finite value in a row that a
  query sees makes that query's output NaN (the kernel may give inf or NaN in some columns only,
  when the row lies in a key block that every query of its program sees).

  Raises:
    ValueError, TypeError: from :func:`validate_dense_mha`, naming the argument.
  """
  sm_scale, q_offset, kv_len = validate_dense_mha(q_THQ, k_SHQ, v_SHV, sm_scale, q_offset,
                                                  kv_len, topk_TK)
  if (empty := _nothing_to_attend(q_THQ, k_SHQ, v_SHV)) is not None:
    return empty
  logits_HTS = jnp.einsum(
      "thq,shq->hts", q_THQ, k_SHQ, preferred_element_type=jnp.float32
  ) * sm_scale
  rows_T = q_offset + jnp.arange(q_THQ.shape[0], dtype=jnp.int32)
  cols_S = jnp.arange(k_SHQ.shape[0], dtype=jnp.int32)
  visible_TS = (cols_S[None, :] <= rows_T[:, None]) & (cols_S[None, :] < kv_len)
  if topk_TK is not None:
    visible_TS &= selected_keys(topk_TK, k_SHQ.shape[0])
  v_SHV, bad_SH = _sanitize_values(v_SHV)
  logits_HTS = jnp.where(bad_SH.T[:, None, :], jnp.nan, logits_HTS)  # the NaN weight
  logits_HTS = jnp.where(visible_TS[None], logits_HTS, -jnp.inf)
  lse_HT = jax.nn.logsumexp(logits_HTS, axis=-1)
  any_visible_T = visible_TS.any(axis=-1)
  safe_lse_HT = jnp.where(any_visible_T[None], lse_HT, 0.0)
  probs_HTS = jnp.exp(logits_HTS - safe_lse_HT[..., None])
  out_THV = jnp.einsum("hts,shv->thv", probs_HTS, v_SHV.astype(jnp.float32))
  lse_TH = jnp.where(any_visible_T[None], lse_HT, jnp.inf).T
  return out_THV.astype(q_THQ.dtype), lse_TH


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

  def body(j, carry, *, masked):
    """One key block; ``masked`` blocks hold some key that some query of the block may not see."""
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
    logits_QK = logits_QK * sm_scale
    if masked:  # replaces whatever hidden keys gave, NaN included
      visible_QK = (cols_K[None, :] <= positions_Q[:, None]) & (cols_K[None, :] < kv_len)
      logits_QK = jnp.where(visible_QK, logits_QK, _compat.MASK_VALUE)
    m_new_Q = jnp.maximum(m_Q, logits_QK.max(axis=-1))
    p_QK = jnp.exp(logits_QK - m_new_Q[:, None])
    alpha_Q = jnp.exp(m_Q - m_new_Q)
    v_chunks_KC = [
        _compat.load(v_ref.at[pl.ds(start, block_k), pl.ds(c0, cw)], mask=col_mask_K[:, None],
                     other=0)
        for c0, cw in v_chunks
    ]
    if masked:
      sanitized = [_sanitize_values(v_KC) for v_KC in v_chunks_KC]
      v_chunks_KC = [v_KC for v_KC, _ in sanitized]
      bad_K = functools.reduce(jnp.logical_or, [bad_K for _, bad_K in sanitized])
      # Hidden pairs get p = 0 (also keeping fully masked rows at 0 while m_new is still the
      # mask value); a visible row that held NaN/inf gets the NaN weight.
      p_QK = jnp.where(visible_QK, jnp.where(bad_K[None, :], jnp.nan, p_QK), 0.0)
    new_accs = tuple(
        acc_QC * alpha_Q[:, None] + jnp.dot(
            p_QK.astype(v_KC.dtype), v_KC, preferred_element_type=jnp.float32, precision=precision)
        for acc_QC, v_KC in zip(accs, v_chunks_KC)
    )
    return m_new_Q, l_Q * alpha_Q + p_QK.sum(axis=-1), new_accs

  # Key blocks before num_full are seen whole by every query of the block (no masks needed);
  # keys past the block's last query position or past kv_len are never visible.
  first_position = q_offset + pl.program_id(0) * block_q
  last_visible = jnp.minimum(kv_len, first_position + block_q)
  num_blocks = jnp.clip(pl.cdiv(last_visible, block_k), 0, pl.cdiv(num_keys, block_k))
  seen_by_all = jnp.minimum(jnp.minimum(first_position + 1, kv_len), num_keys)
  num_full = jnp.clip(jnp.maximum(seen_by_all, 0) // block_k, 0, num_blocks)
  init = (
      jnp.full((block_q,), _compat.MASK_VALUE, jnp.float32),
      jnp.zeros((block_q,), jnp.float32),
      tuple(jnp.zeros((block_q, cw), jnp.float32) for _, cw in v_chunks),
  )
  carry = jax.lax.fori_loop(0, num_full, functools.partial(body, masked=False), init)
  m_Q, l_Q, accs = jax.lax.fori_loop(
      num_full, num_blocks, functools.partial(body, masked=True), carry
  )
  # Rows that see no key keep l = 0: explicit out 0 and LSE +inf. A NaN l is not empty.
  empty_Q = l_Q == 0.0
  safe_l_Q = jnp.where(empty_Q, 1.0, l_Q)
  for (c0, cw), acc_QC in zip(v_chunks, accs):
    out_QC = (acc_QC / safe_l_Q[:, None]).astype(out_ref.dtype)
    _compat.store(out_ref.at[:, pl.ds(c0, cw)], out_QC, mask=row_mask_Q[:, None])
  lse_Q = jnp.where(empty_Q, jnp.inf, m_Q + jnp.log(safe_l_Q))
  _compat.store(lse_ref, lse_Q, mask=row_mask_Q)


def dense_mha(
    q_THQ, k_SHQ, v_SHV, *, sm_scale: float, q_offset, kv_len, topk_TK=None,
    config: DenseMHAKernelConfig | None = None, interpret: bool = False,
):
  """Pallas-Triton causal flash attention with the contract and checks of the reference.

  ``topk_TK`` (the masked route) is not in the kernel yet: a ``NotImplementedError``, and
  ``PallasTritonBackend`` does not declare ``supports_masked_mha_prefill``.
  """
  sm_scale, q_offset, kv_len = validate_dense_mha(q_THQ, k_SHQ, v_SHV, sm_scale, q_offset, kv_len,
                                                  topk_TK)
  if topk_TK is not None:
    raise NotImplementedError("dense_mha: the masked (topk_TK) Pallas kernel is still to come; "
                              "use dense_mha_reference")
  _checks.kernel_config("dense_mha", config, DenseMHAKernelConfig)
  if (empty := _nothing_to_attend(q_THQ, k_SHQ, v_SHV)) is not None:
    return empty
  meta = jnp.stack([q_offset, kv_len])
  (T, H, Q), S, V = q_THQ.shape, k_SHQ.shape[0], v_SHV.shape[-1]
  if config is None:
    config = DenseMHAKernelConfig.default_for(T, S, Q, V)
  block_q, block_k = config.block_q, config.block_k
  padded_s = pl.cdiv(S, block_k) * block_k  # the key block overhangs; loads are masked
  kernel = functools.partial(
      _dense_mha_kernel, sm_scale=sm_scale, num_tokens=T, num_keys=S, config=config
  )
  # Causal pairs for q_offset = 0 and kv_len = S, the common prefill case.
  pairs = sum(min(t + 1, S) for t in range(T))
  itemsize = q_THQ.dtype.itemsize
  cost = pl.CostEstimate(
      flops=2 * H * (Q + V) * pairs,
      transcendentals=H * pairs,
      bytes_accessed=itemsize * H * (T * (Q + V) + S * (Q + V) * pl.cdiv(T, block_q)) + 4 * T * H,
  )
  sq = _compat.SQUEEZED
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(T, block_q), H),
      in_specs=[
          pl.BlockSpec((block_q, sq, Q), lambda i, h: (i, h, 0)),
          pl.BlockSpec((padded_s, sq, Q), lambda i, h: (0, h, 0)),
          pl.BlockSpec((padded_s, sq, V), lambda i, h: (0, h, 0)),
          pl.BlockSpec((2,), lambda i, h: (0,)),
      ],
      out_specs=[
          pl.BlockSpec((block_q, sq, V), lambda i, h: (i, h, 0)),
          pl.BlockSpec((block_q, sq), lambda i, h: (i, h)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((T, H, V), q_THQ.dtype),
          jax.ShapeDtypeStruct((T, H), jnp.float32),
      ],
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=cost,
      interpret=interpret,
      name="dense_mha_prefill",
  )(q_THQ, k_SHQ, v_SHV, meta)
