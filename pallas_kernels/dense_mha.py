"""Dense causal multi-head attention for the MHA prefill routes (docs/design.md §2, §6).

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

The MASKED_MHA route (``topk_TK``) runs the same flash walk as a second kernel,
``masked_mha_prefill``. Each query's top-k reaches it as a bitmask, not as sorted indices:
bit ``s % 32`` of word ``s // 32`` says whether query t sees key s (selected, causal and below
``kv_len``, all folded in by XLA before the call), stored word-major [W, T] so that one word of
a program's query rows is one contiguous load, and a [block_q, block_k] tile is tested with a
shift and an and per pair. Sorted indices would need, per tile, a search (Triton lowers no sort
or search) or a [block_q, K, block_k] comparison. The bitmask is T*S/8 bytes; a visited key
block reads block_k/32 words per query row beside its block_k*(Q+V) key and value elements.
Beside it go, per query block, the ascending list of key blocks in which some query
of the block sees a key, and its length: the program walks that list only, so a key block that
no query of the block selected is never loaded. Every visited block is masked (a top-k pattern
is never whole), with the causal kernel's NaN rules.

Both variants are differentiable: ``dense_mha`` is a ``jax.custom_vjp`` whose backward
(:mod:`pallas_kernels.dense_mha_backward`) runs from the saved LSE with the same walks, bitmask
test and block schedule, which both import from :mod:`pallas_kernels.dense_mha_tiles`.
``dense_mha_reference`` is differentiated by plain autodiff (the XLA backend's training path);
it zeroes non-finite keys and values before the dots, so a hidden NaN cannot reach a gradient
through a zero cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _checks, _compat
from pallas_kernels.block_config import DenseMHAKernelConfig, pow2_chunks
from pallas_kernels.dense_mha_backward import dense_mha_backward
from pallas_kernels.dense_mha_tiles import (block_schedule, causal_pairs, causal_walks, mask_bits,
                                            masked_walks, query_rows, sanitize_values,
                                            selected_keys, selected_pairs, visible_keys)


def validate_dense_mha(q_THQ, k_SHQ, v_SHV, sm_scale, q_offset, kv_len, topk_TK=None,
                       segment_ids_T=None):
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
  if segment_ids_T is not None:
    _checks.array(op, "segment_ids_T", segment_ids_T, "T")
    _checks.int32_array(op, "segment_ids_T", segment_ids_T)
    if segment_ids_T.shape[0] != T or S != T:
      raise ValueError(f"{op}: segment_ids_T names the segment of each of the T query rows, "
                       f"which are also the key rows: need T == S == {segment_ids_T.shape[0]}, "
                       f"got T={T}, S={S}")
  return sm_scale, q_offset, kv_len


def _nothing_to_attend(q_THQ, k_SHQ, v_SHV):
  """T, H or S is 0: every row (if any) sees no key, out 0 and LSE +inf, with no kernel run."""
  (T, H, _), S, V = q_THQ.shape, k_SHQ.shape[0], v_SHV.shape[-1]
  return _checks.no_attention(T, H, V, q_THQ.dtype) if 0 in (T, H, S) else None


def dense_mha_reference(q_THQ, k_SHQ, v_SHV, *, sm_scale: float, q_offset, kv_len,
                        topk_TK=None, segment_ids_T=None):
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
    segment_ids_T: None, or int32 [T] with S == T: the rows are several sequences laid end to
      end (an engine's flat step), and query t sees only the keys of its own segment (with
      the causal rule, its segment's rows up to itself). -1 is a segment like any other.

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
                                                  kv_len, topk_TK, segment_ids_T)
  if (empty := _nothing_to_attend(q_THQ, k_SHQ, v_SHV)) is not None:
    return empty
  # Non-finite keys and values are zeroed and the queries that see their row get the NaN weight
  # instead: a hidden NaN times its zero cotangent would make every gradient NaN.
  k_SHQ, bad_k_SH = sanitize_values(k_SHQ)
  v_SHV, bad_v_SH = sanitize_values(v_SHV)
  logits_HTS = jnp.einsum(
      "thq,shq->hts", q_THQ, k_SHQ, preferred_element_type=jnp.float32
  ) * sm_scale
  visible_TS = visible_keys(q_THQ.shape[0], k_SHQ.shape[0], q_offset, kv_len, topk_TK,
                            segment_ids_T)
  logits_HTS = jnp.where((bad_k_SH | bad_v_SH).T[:, None, :], jnp.nan, logits_HTS)
  logits_HTS = jnp.where(visible_TS[None], logits_HTS, -jnp.inf)
  any_visible_T = visible_TS.any(axis=-1)
  # Rows that see no key take the logsumexp of zeros: one of -infs has a NaN gradient.
  lse_HT = jax.nn.logsumexp(jnp.where(any_visible_T[None, :, None], logits_HTS, 0.0), axis=-1)
  probs_HTS = jnp.exp(logits_HTS - lse_HT[..., None])
  out_THV = jnp.einsum("hts,shv->thv", probs_HTS, v_SHV.astype(jnp.float32))
  lse_TH = jnp.where(any_visible_T[None], lse_HT, jnp.inf).T
  return out_THV.astype(q_THQ.dtype), lse_TH


# ---- the kernels: one flash walk over key blocks, two ways of choosing and masking them ------

def _flash_walk(q_ref, k_ref, v_ref, out_ref, lse_ref, walks, *, sm_scale, num_tokens, num_keys,
                block_k):
  """The online softmax of one (query block, head) program over key blocks; stores out and LSE.

  ``walks``: ``(lower, upper, key_block, visible)`` loops run one after the other. Step n of a
  loop reads key block ``key_block(n)``; ``visible(start, cols_K)`` gives the [block_q, block_k]
  bool mask of the pairs the queries see, or ``visible`` is None for blocks that every query of
  the program sees whole (no mask work at all).
  """
  block_q = q_ref.shape[0]
  _, row_mask_Q = query_rows(block_q, num_tokens)
  qk_chunks, v_chunks = pow2_chunks(q_ref.shape[-1]), pow2_chunks(v_ref.shape[-1])
  precision = _compat.dot_precision(q_ref.dtype)
  q_chunks = [
      _compat.load(q_ref.at[:, pl.ds(c0, cw)], mask=row_mask_Q[:, None], other=0)
      for c0, cw in qk_chunks
  ]

  def body(n, carry, *, key_block, visible):
    m_Q, l_Q, accs = carry
    start = pl.multiple_of(key_block(n) * block_k, block_k)
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
    visible_QK = None if visible is None else visible(start, cols_K)
    if visible_QK is not None:  # replaces whatever hidden keys gave, NaN included
      logits_QK = jnp.where(visible_QK, logits_QK, _compat.MASK_VALUE)
    m_new_Q = jnp.maximum(m_Q, logits_QK.max(axis=-1))
    p_QK = jnp.exp(logits_QK - m_new_Q[:, None])
    alpha_Q = jnp.exp(m_Q - m_new_Q)
    v_chunks_KC = [
        _compat.load(v_ref.at[pl.ds(start, block_k), pl.ds(c0, cw)], mask=col_mask_K[:, None],
                     other=0)
        for c0, cw in v_chunks
    ]
    if visible_QK is not None:
      sanitized = [sanitize_values(v_KC) for v_KC in v_chunks_KC]
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

  carry = (
      jnp.full((block_q,), _compat.MASK_VALUE, jnp.float32),
      jnp.zeros((block_q,), jnp.float32),
      tuple(jnp.zeros((block_q, cw), jnp.float32) for _, cw in v_chunks),
  )
  for lower, upper, key_block, visible in walks:
    carry = jax.lax.fori_loop(
        lower, upper, functools.partial(body, key_block=key_block, visible=visible), carry)
  m_Q, l_Q, accs = carry
  # Rows that see no key keep l = 0: explicit out 0 and LSE +inf. A NaN l is not empty.
  empty_Q = l_Q == 0.0
  safe_l_Q = jnp.where(empty_Q, 1.0, l_Q)
  for (c0, cw), acc_QC in zip(v_chunks, accs):
    out_QC = (acc_QC / safe_l_Q[:, None]).astype(out_ref.dtype)
    _compat.store(out_ref.at[:, pl.ds(c0, cw)], out_QC, mask=row_mask_Q[:, None])
  lse_Q = jnp.where(empty_Q, jnp.inf, m_Q + jnp.log(safe_l_Q))
  _compat.store(lse_ref, lse_Q, mask=row_mask_Q)


def _dense_mha_kernel(
    q_ref, k_ref, v_ref, meta_ref, out_ref, lse_ref, *, sm_scale, num_tokens, num_keys, config
):
  walks = causal_walks(meta_ref, num_keys=num_keys, block_q=config.block_q,
                       block_k=config.block_k)
  _flash_walk(q_ref, k_ref, v_ref, out_ref, lse_ref, walks, sm_scale=sm_scale,
              num_tokens=num_tokens, num_keys=num_keys, block_k=config.block_k)


def _masked_mha_kernel(
    q_ref, k_ref, v_ref, bits_ref, key_blocks_ref, num_blocks_ref, out_ref, lse_ref, *, sm_scale,
    num_tokens, num_keys, config
):
  walks = masked_walks(bits_ref, key_blocks_ref, num_blocks_ref, num_tokens=num_tokens,
                       block_q=config.block_q)
  _flash_walk(q_ref, k_ref, v_ref, out_ref, lse_ref, walks, sm_scale=sm_scale,
              num_tokens=num_tokens, num_keys=num_keys, block_k=config.block_k)


def mask_operands(visible_TS, config: DenseMHAKernelConfig):
  """The masked kernel's view of ``visible_TS`` [T, S]: ``(bits_WT, key_blocks_QN, num_blocks_Q)``.

  ``bits_WT`` (uint32 [W, T]): bit ``s % 32`` of word ``s // 32`` is set when query t sees key
  s; word-major, so one word of a program's query rows is one contiguous load, and W covers the
  last key block's overhang. ``key_blocks_QN`` (int32, per query block): the key blocks in which
  some query of the block sees a key, ascending, then the others (never read);
  ``num_blocks_Q``: how many of the former there are.
  """
  bits_WT, active_QN = mask_bits(visible_TS, config)
  return (bits_WT, *block_schedule(active_QN))


def _causal_variant(q_offset, kv_len, static):
  """``dense_mha_prefill``: the kernel, its name, and its operands and specs after q, k, v."""
  kernel = functools.partial(_dense_mha_kernel, **static)
  return kernel, "dense_mha_prefill", (jnp.stack([q_offset, kv_len]),), [
      pl.BlockSpec((2,), lambda i, h: (0,))]


def _masked_variant(visible_TS, static, name: str = "masked_mha_prefill"):
  """``masked_mha_prefill`` (or another ``name`` for the same kernel): the kernel, its name,
  and its operands and specs after q, k, v."""
  config = static["config"]
  bits_WT, key_blocks_QN, num_blocks_Q = mask_operands(visible_TS, config)
  kernel = functools.partial(_masked_mha_kernel, **static)
  return kernel, name, (bits_WT, key_blocks_QN, num_blocks_Q), [
      pl.BlockSpec((bits_WT.shape[0], config.block_q), lambda i, h: (0, i)),
      pl.BlockSpec((_compat.SQUEEZED, key_blocks_QN.shape[1]), lambda i, h: (i, 0)),
      pl.BlockSpec((1,), lambda i, h: (i,)),
  ]


def _cost_estimate(q_THQ, k_SHQ, v_SHV, side_args, block_q: int) -> pl.CostEstimate:
  """Every causal pair of a fresh prefill (q_offset 0, kv_len S) at 2H(Q + V) FLOPs: exact for
  the causal kernel, an upper bound for the masked one (its skipped blocks depend on the data).
  Each program reads its query block, every key row once and its side inputs (the offsets, or
  the masked kernel's bitmask and key-block lists)."""
  (T, H, Q), S, V = q_THQ.shape, k_SHQ.shape[0], v_SHV.shape[-1]
  pairs = causal_pairs(T, S)
  side_bytes = sum(a.size * a.dtype.itemsize for a in side_args)
  return pl.CostEstimate(
      flops=2 * H * (Q + V) * pairs,
      transcendentals=H * pairs,
      bytes_accessed=q_THQ.dtype.itemsize * H * (T * (Q + V) + S * (Q + V) * pl.cdiv(T, block_q))
      + 4 * T * H + H * side_bytes,
  )


def dense_mha(
    q_THQ, k_SHQ, v_SHV, *, sm_scale: float, q_offset, kv_len, topk_TK=None,
    segment_ids_T=None, config: DenseMHAKernelConfig | None = None, interpret: bool = False,
):
  """Pallas-Triton causal flash attention with the contract and checks of the reference.

  Without ``topk_TK``: the kernel ``dense_mha_prefill``. With it (the MASKED_MHA route):
  ``masked_mha_prefill``, which visits only the key blocks in which some query of a query
  block sees a selected key. With ``segment_ids_T`` (an engine's flat step): the same kernel
  as ``segmented_mha_prefill``, its bitmask the causal pairs within segments, so a key block
  of other sequences only is never loaded. Differentiable in q, k and v through out and LSE (a
  ``jax.custom_vjp``): the backward kernels of :mod:`pallas_kernels.dense_mha_backward` run
  from the saved LSE with their own blocks (``DenseMHAKernelConfig.backward_for``).
  """
  sm_scale, q_offset, kv_len = validate_dense_mha(q_THQ, k_SHQ, v_SHV, sm_scale, q_offset, kv_len,
                                                  topk_TK, segment_ids_T)
  _checks.kernel_config("dense_mha", config, DenseMHAKernelConfig)
  if (empty := _nothing_to_attend(q_THQ, k_SHQ, v_SHV)) is not None:
    return empty
  (T, _, Q), S, V = q_THQ.shape, k_SHQ.shape[0], v_SHV.shape[-1]
  if config is None:
    config = DenseMHAKernelConfig.default_for(T, S, Q, V)
  return _attention((sm_scale, config, interpret), q_THQ, k_SHQ, v_SHV, q_offset, kv_len,
                    topk_TK, segment_ids_T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q_THQ, k_SHQ, v_SHV, q_offset, kv_len, topk_TK, segment_ids_T):
  """``dense_mha`` on validated, non-empty inputs; ``static`` = (sm_scale, config, interpret).
  Differentiable in q, k and v (and through out and LSE both); the integer inputs get none."""
  sm_scale, config, interpret = static
  (T, H, Q), S, V = q_THQ.shape, k_SHQ.shape[0], v_SHV.shape[-1]
  static = dict(sm_scale=sm_scale, num_tokens=T, num_keys=S, config=config)
  if topk_TK is None and segment_ids_T is None:
    kernel, name, side_args, side_specs = _causal_variant(q_offset, kv_len, static)
  else:
    kernel, name, side_args, side_specs = _masked_variant(
        visible_keys(T, S, q_offset, kv_len, topk_TK, segment_ids_T), static,
        "masked_mha_prefill" if segment_ids_T is None else "segmented_mha_prefill")
  block_q, block_k = config.block_q, config.block_k
  padded_s = pl.cdiv(S, block_k) * block_k  # the key block overhangs; loads are masked
  sq = _compat.SQUEEZED
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(T, block_q), H),
      in_specs=[
          pl.BlockSpec((block_q, sq, Q), lambda i, h: (i, h, 0)),
          pl.BlockSpec((padded_s, sq, Q), lambda i, h: (0, h, 0)),
          pl.BlockSpec((padded_s, sq, V), lambda i, h: (0, h, 0)),
          *side_specs,
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
      cost_estimate=_cost_estimate(q_THQ, k_SHQ, v_SHV, side_args, block_q),
      interpret=interpret,
      name=name,
  )(q_THQ, k_SHQ, v_SHV, *side_args)


def _attention_fwd(static, q_THQ, k_SHQ, v_SHV, q_offset, kv_len, topk_TK, segment_ids_T):
  out_THV, lse_TH = _attention(static, q_THQ, k_SHQ, v_SHV, q_offset, kv_len, topk_TK,
                               segment_ids_T)
  return (out_THV, lse_TH), (q_THQ, k_SHQ, v_SHV, q_offset, kv_len, topk_TK, segment_ids_T,
                             out_THV, lse_TH)


def _attention_bwd(static, residuals, cotangents):
  sm_scale, _, interpret = static
  q_THQ, k_SHQ, v_SHV, q_offset, kv_len, topk_TK, segment_ids_T, out_THV, lse_TH = residuals
  dout_THV, dlse_TH = cotangents
  grads = dense_mha_backward(q_THQ, k_SHQ, v_SHV, out_THV, lse_TH, dout_THV, dlse_TH,
                             sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len,
                             topk_TK=topk_TK, segment_ids_T=segment_ids_T, interpret=interpret)
  return (*grads, None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
