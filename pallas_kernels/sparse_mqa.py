"""Sparse MQA attention over gathered top-k latent rows (FlashMLA's semantics, docs/design.md §8).

Kernel layout (docs/design.md §8): one program handles ``block_h`` query heads of one token,
so heads are the M dimension of every dot and each gathered latent row is loaded once per
program, not once per head. The program walks the token's top-k row ``block_k`` indices at a
time: clamp, gather ``kv[idx]``, replace the logits of invalid slots (-1 / >= S) by a finite
negative and their values by zeros, online softmax in fp32.
The 576-wide rows are split into power-of-two column chunks (512 latent + 64 rope) with separate
dots, so no tile is padded to 1024. Head counts that are not a multiple of ``block_h`` overhang
the block and are masked; arrays are never padded.

fp8 rows (``Fp8LatentRows``, the 656-byte cache layout) are gathered by index as they are
stored, e4m3 latent, float32 tile scales and RoPE, and dequantized in the program into the
query dtype before the dots; each latent column chunk lies inside one scale tile and keeps its
own accumulator, so no dequantized row is ever assembled or written back.

Backward (``sparse_mqa_backward.py``): ``sparse_mqa`` is a ``jax.custom_vjp`` whose backward
recomputes the probabilities from the saved LSE in two more kernels, one for dq and one for
each (token, slot)'s row gradient, and a third sums the row gradients per row in a fixed order.
Those read slots and rows with the forward's readers, which both import from
``sparse_mqa_tiles.py``.

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

from pallas_kernels import _checks, _compat
from pallas_kernels import sparse_mqa_tiles as tiles
from pallas_kernels.block_config import (SparseMQABackwardConfig, SparseMQAKernelConfig,
                                         pow2_chunks)
from pallas_kernels.fp8_rows import Fp8LatentRows, dequantize_rows, validate_fp8_rows
from pallas_kernels.sparse_mqa_backward import sparse_mqa_backward

_FP8_QUERY_DTYPES = (jnp.float32, jnp.bfloat16)


def validate_sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale, d_v):
  """The one argument check of :func:`sparse_mqa` and :func:`sparse_mqa_reference`.

  Returns ``(sm_scale, d_v)`` as a Python float and int.
  """
  op = "sparse_mqa"
  T, _, L = _checks.array(op, "q_THL", q_THL, "THL")
  _checks.array(op, "topk_TK", topk_TK, "TK")
  if isinstance(kv_SL, Fp8LatentRows):
    _, A, _, R = validate_fp8_rows(op, "kv_SL", kv_SL)
    if A + R != L:
      raise ValueError(f"{op}: fp8 kv_SL rows are {A} + {R} wide, q_THL is {L} wide")
    _checks.float_dtype(op, "q_THL", q_THL, _FP8_QUERY_DTYPES)
  else:
    _checks.array(op, "kv_SL", kv_SL, "SL")
    if kv_SL.shape[1] != L:
      raise ValueError(f"{op}: kv_SL row width {kv_SL.shape[1]} != q_THL width {L}")
    _checks.float_dtype(op, "q_THL", q_THL)
    _checks.float_dtype(op, "kv_SL", kv_SL)
    _checks.same_dtype(op, q_THL=q_THL, kv_SL=kv_SL)
  if topk_TK.shape[0] != T:
    raise ValueError(f"{op}: topk_TK has {topk_TK.shape[0]} rows for the {T} tokens of q_THL")
  _checks.int32_array(op, "topk_TK", topk_TK)
  sm_scale = _checks.positive_float(op, "sm_scale", sm_scale)
  d_v = _checks.positive_int(op, "d_v", d_v, at_most=L, bound_name="L")
  if isinstance(kv_SL, Fp8LatentRows) and d_v != kv_SL.latent_width:
    raise ValueError(f"{op}: with fp8 kv_SL the values are the latent part: d_v must be "
                     f"A={kv_SL.latent_width}, got {d_v}")
  return sm_scale, d_v


def _num_rows(kv_SL) -> int:
  return kv_SL.num_rows if isinstance(kv_SL, Fp8LatentRows) else kv_SL.shape[0]


def _nothing_to_attend(q_THL, kv_SL, topk_TK, d_v):
  """T, H, S or K is 0: every row (if any) is empty, out 0 and LSE +inf, with no kernel run."""
  (T, H, _), S, K = q_THL.shape, _num_rows(kv_SL), topk_TK.shape[1]
  return _checks.no_attention(T, H, d_v, q_THL.dtype) if 0 in (T, H, S, K) else None


def sparse_mqa_reference(q_THL, kv_SL, topk_TK, *, sm_scale: float, d_v: int):
  """Attention of every query head over the latent rows its token selected.

  Args:
    q_THL: queries, the absorbed form [q_lat (d_v) | q_pe (L - d_v)] per head.
    kv_SL: latent cache rows [c_kv (d_v) | k_pe (L - d_v)], one shared KV head: an array in the
      dtype of ``q_THL``, or ``Fp8LatentRows`` (then ``d_v`` is the latent width A and ``q_THL``
      is float32 or bfloat16); gathered rows are dequantized into the dtype of ``q_THL``.
    topk_TK: int32 row indices into ``kv_SL``; -1 and indices >= S are invalid.
    sm_scale: softmax scale, a finite positive float, passed explicitly (never L**-0.5 for
      MLA).
    d_v: width of the value part, the first ``d_v`` columns of each row (1 <= d_v <= L).

  Returns:
    ``(out_THV, lse_TH)``: out in the dtype of ``q_THL``; the natural-log LSE in float32.
    A row with no valid index gives out 0 and LSE +inf (FlashMLA's "lonely row"); so do all
    rows when K = 0 (no slots) or S = 0 (no rows); T = 0 gives empty outputs.

  Rows that no valid slot of a token selects never reach that token: invalid slots gather row 0
  and are replaced by zeros before any dot, so NaN or inf in an unselected row (or in row 0,
  or in its fp8 scales) cannot poison it. A non-finite value in a selected row makes that
  token's output non-finite.

  Differentiable (plain autodiff; the XLA backend trains through it): unselected rows, invalid
  slots and empty rows get exactly zero gradients, a row selected twice by a token gets both
  slots' gradients, and fp8 rows are constants (zero cotangents).

  Raises:
    ValueError, TypeError: from :func:`validate_sparse_mqa`, naming the argument.
  """
  sm_scale, d_v = validate_sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale, d_v)
  if (empty := _nothing_to_attend(q_THL, kv_SL, topk_TK, d_v)) is not None:
    return empty
  valid_TK = (topk_TK >= 0) & (topk_TK < _num_rows(kv_SL))
  safe_TK = jnp.where(valid_TK, topk_TK, 0)
  if isinstance(kv_SL, Fp8LatentRows):
    # A quantized cache is a constant: no cotangent reaches it, as in the kernel's VJP.
    gathered_TKL = dequantize_rows(
        Fp8LatentRows(*(jax.lax.stop_gradient(part)[safe_TK] for part in kv_SL)), q_THL.dtype)
  else:
    gathered_TKL = kv_SL[safe_TK]
  rows_TKL = jnp.where(valid_TK[..., None], gathered_TKL, 0)
  logits_THK = jnp.einsum(
      "thl,tkl->thk", q_THL, rows_TKL, preferred_element_type=jnp.float32
  ) * sm_scale
  logits_THK = jnp.where(valid_TK[:, None, :], logits_THK, -jnp.inf)
  lse_TH = jax.nn.logsumexp(logits_THK, axis=-1)
  any_valid_T = valid_TK.any(axis=-1)
  safe_lse_TH = jnp.where(any_valid_T[:, None], lse_TH, 0.0)
  probs_THK = jnp.exp(logits_THK - safe_lse_TH[..., None])
  out_THV = jnp.einsum(
      "thk,tkv->thv", probs_THK, rows_TKL[..., :d_v].astype(jnp.float32)
  )
  lse_TH = jnp.where(any_valid_T[:, None], lse_TH, jnp.inf)
  return out_THV.astype(q_THL.dtype), lse_TH


# ---- the kernels: a shared walk over the top-k slots, two ways of reading rows ----------------

def _softmax_step(m_H, l_H, logits_HK, valid_K):
  """One online-softmax update: ``(m_new_H, l_new_H, alpha_H, p_HK)``."""
  # Replaces the logits of invalid slots, whatever the row they read (row 0) holds.
  logits_HK = jnp.where(valid_K[None, :], logits_HK, _compat.MASK_VALUE)
  m_new_H = jnp.maximum(m_H, logits_HK.max(axis=-1))
  # The where keeps fully masked blocks at 0 while m_new is still the mask value.
  p_HK = jnp.where(valid_K[None, :], jnp.exp(logits_HK - m_new_H[:, None]), 0.0)
  alpha_H = jnp.exp(m_H - m_new_H)
  return m_new_H, l_H * alpha_H + p_HK.sum(axis=-1), alpha_H, p_HK


def _walk_slots(body, *, topk, block_h, block_k, acc_widths):
  """Runs ``body(j, carry)`` over every slot block; returns ``(l_H, lse_H, accs)``: the
  accumulators divide by ``l_H`` (1 for empty rows, whose accumulators are 0)."""
  init = (
      jnp.full((block_h,), _compat.MASK_VALUE, jnp.float32),
      jnp.zeros((block_h,), jnp.float32),
      tuple(jnp.zeros((block_h, w), jnp.float32) for w in acc_widths),
  )
  m_H, l_H, accs = jax.lax.fori_loop(0, pl.cdiv(topk, block_k), body, init)
  # Empty rows (no valid index) keep l = 0: explicit out 0 and LSE +inf. A NaN l (a selected
  # row held NaN) is not empty, so the NaN reaches out and LSE instead of hiding as "empty".
  empty_H = l_H == 0.0
  safe_l_H = jnp.where(empty_H, 1.0, l_H)
  return safe_l_H, jnp.where(empty_H, jnp.inf, m_H + jnp.log(safe_l_H)), accs


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
    m_H, l_H, (acc_HV,) = carry
    valid_K, safe_K = tiles.slot_block(topk_ref, j, block_k=block_k, topk=topk, num_rows=num_rows)
    logits_HK = None
    for (c0, cw), q_HC in zip(qk_chunks, q_chunks):
      rows_KC = kv_ref[safe_K, pl.ds(c0, cw)]
      part_HK = jax.lax.dot_general(
          q_HC, rows_KC, (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32, precision=precision,
      )
      logits_HK = part_HK if logits_HK is None else logits_HK + part_HK
    m_new_H, l_new_H, alpha_H, p_HK = _softmax_step(m_H, l_H, logits_HK * sm_scale, valid_K)
    # Invalid slots read row 0: zero their values, or a NaN there would meet p = 0 (0 * NaN).
    rows_KV = jnp.where(valid_K[:, None], kv_ref[safe_K, pl.ds(0, d_v)], 0)
    pv_HV = jnp.dot(
        p_HK.astype(rows_KV.dtype), rows_KV,
        preferred_element_type=jnp.float32, precision=precision,
    )
    return m_new_H, l_new_H, (acc_HV * alpha_H[:, None] + pv_HV,)

  l_H, lse_H, (acc_HV,) = _walk_slots(body, topk=topk, block_h=block_h, block_k=block_k,
                                      acc_widths=(d_v,))
  out_HV = acc_HV / l_H[:, None]
  _compat.store(out_ref, out_HV.astype(out_ref.dtype), mask=head_mask_H[:, None])
  _compat.store(lse_ref, lse_H, mask=head_mask_H)


def _sparse_mqa_fp8_kernel(
    q_ref, values_ref, scales_ref, rope_ref, topk_ref, out_ref, lse_ref, *, sm_scale, num_heads,
    num_rows, topk, tile, config
):
  block_h, block_k = config.block_h, config.block_k
  heads_H = pl.program_id(1) * block_h + jnp.arange(block_h, dtype=jnp.int32)
  head_mask_H = heads_H < num_heads
  latent_width, dtype = values_ref.shape[-1], q_ref.dtype
  latent_chunks = tiles.latent_chunks(latent_width, tile)
  rope_chunks = pow2_chunks(rope_ref.shape[-1])
  precision = _compat.dot_precision(dtype)
  load_q = lambda c0, cw: _compat.load(q_ref.at[:, pl.ds(c0, cw)], mask=head_mask_H[:, None],
                                       other=0)
  q_latent = [load_q(c0, cw) for c0, cw, _ in latent_chunks]
  q_rope = [load_q(latent_width + c0, cw) for c0, cw in rope_chunks]

  def body(j, carry):
    m_H, l_H, accs = carry
    valid_K, safe_K = tiles.slot_block(topk_ref, j, block_k=block_k, topk=topk, num_rows=num_rows)
    latent, rope = tiles.read_fp8_rows(values_ref, scales_ref, rope_ref, safe_K, valid_K,
                                       latent_chunks=latent_chunks, rope_chunks=rope_chunks,
                                       dtype=dtype)
    logits_HK = None
    for q_HC, rows_KC in zip(q_latent + q_rope, latent + rope):
      part_HK = jax.lax.dot_general(
          q_HC, rows_KC, (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32, precision=precision,
      )
      logits_HK = part_HK if logits_HK is None else logits_HK + part_HK
    m_new_H, l_new_H, alpha_H, p_HK = _softmax_step(m_H, l_H, logits_HK * sm_scale, valid_K)
    p_HK = p_HK.astype(dtype)
    accs = tuple(
        acc_HC * alpha_H[:, None]
        + jnp.dot(p_HK, rows_KC, preferred_element_type=jnp.float32, precision=precision)
        for acc_HC, rows_KC in zip(accs, latent)
    )
    return m_new_H, l_new_H, accs

  l_H, lse_H, accs = _walk_slots(
      body, topk=topk, block_h=block_h, block_k=block_k,
      acc_widths=tuple(cw for _, cw, _ in latent_chunks))
  for (c0, cw, _), acc_HC in zip(latent_chunks, accs):
    _compat.store(out_ref.at[:, pl.ds(c0, cw)],
                  (acc_HC / l_H[:, None]).astype(out_ref.dtype),
                  mask=head_mask_H[:, None])
  _compat.store(lse_ref, lse_H, mask=head_mask_H)


# Row gradients held at once per sequence by the backward (sparse_mqa_backward.py): [T, K, L]
# float32 is 4.7 MB a token at DeepSeek-V3.2 widths, so 1 GiB takes 227 tokens a chunk.
DROWS_MAX_BYTES = 1 << 30


def sparse_mqa(
    q_THL, kv_SL, topk_TK, *, sm_scale: float, d_v: int,
    config: SparseMQAKernelConfig | None = None, interpret: bool = False,
    backward_config: SparseMQABackwardConfig | None = None,
    drows_max_bytes: int = DROWS_MAX_BYTES,
):
  """Pallas-Triton sparse MQA; the contract and checks of :func:`sparse_mqa_reference`.

  The returned LSE is natural-log (any exp2 trick stays inside the kernel). Empty rows give
  out 0 and LSE +inf. ``config`` defaults to ``SparseMQAKernelConfig.default_for``.

  Differentiable with respect to ``q_THL`` and float ``kv_SL`` (a ``jax.custom_vjp`` whose
  backward is Pallas-Triton too, :mod:`pallas_kernels.sparse_mqa_backward`), with the
  reference's gradients: both outputs' cotangents count, fp8 rows are constants (zero
  cotangents) and the indices have none. ``backward_config`` defaults to
  ``SparseMQABackwardConfig.default_for``. ``drows_max_bytes`` bounds the per-slot row
  gradients, [T, K, L] float32, that the backward holds at once for one sequence: tokens are
  taken in chunks that fit (a vmapped batch holds one chunk per sequence). The row gradients
  are summed in a fixed order, so ``dkv`` is bitwise reproducible.
  """
  sm_scale, d_v = validate_sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale, d_v)
  _checks.kernel_config("sparse_mqa", config, SparseMQAKernelConfig)
  _checks.kernel_config("sparse_mqa", backward_config, SparseMQABackwardConfig,
                        name="backward_config")
  if isinstance(drows_max_bytes, bool) or not isinstance(drows_max_bytes, int):
    raise TypeError(f"sparse_mqa: drows_max_bytes must be an int, got {drows_max_bytes!r}")
  if drows_max_bytes < 1:
    raise ValueError(f"sparse_mqa: drows_max_bytes must be positive, got {drows_max_bytes}")
  if (empty := _nothing_to_attend(q_THL, kv_SL, topk_TK, d_v)) is not None:
    return empty
  H, K = q_THL.shape[1], topk_TK.shape[1]
  config = config or SparseMQAKernelConfig.default_for(H, K, d_v)
  forward = functools.partial(_forward, sm_scale=sm_scale, d_v=d_v, config=config,
                              interpret=interpret)
  return with_triton_backward(forward, q_THL, kv_SL, topk_TK, sm_scale=sm_scale, d_v=d_v,
                              backward_config=backward_config,
                              drows_max_bytes=drows_max_bytes, interpret=interpret)


def with_triton_backward(forward, q_THL, kv_SL, topk_TK, *, sm_scale: float, d_v: int,
                         backward_config: SparseMQABackwardConfig | None = None,
                         drows_max_bytes: int = DROWS_MAX_BYTES, interpret: bool = False):
  """``forward(q_THL, kv_SL, topk_TK) -> (out_THV, lse_TH)`` made differentiable by the
  Pallas-Triton backward kernels (any forward kernel with this contract: the Triton one, or
  the Mosaic GPU one). Arguments already validated; T, H, S and K nonzero."""
  H, K = q_THL.shape[1], topk_TK.shape[1]
  backward_config = backward_config or SparseMQABackwardConfig.default_for(H, K, d_v)
  return _differentiable(q_THL, kv_SL, topk_TK, forward, sm_scale, d_v, backward_config,
                         drows_max_bytes, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _differentiable(q_THL, kv_SL, topk_TK, forward, sm_scale, d_v, backward_config,
                    drows_max_bytes, interpret):
  del sm_scale, d_v, backward_config, drows_max_bytes, interpret
  return forward(q_THL, kv_SL, topk_TK)


def _differentiable_fwd(q_THL, kv_SL, topk_TK, forward, sm_scale, d_v, backward_config,
                        drows_max_bytes, interpret):
  out_THV, lse_TH = forward(q_THL, kv_SL, topk_TK)
  return (out_THV, lse_TH), (q_THL, kv_SL, topk_TK, out_THV, lse_TH)


def _differentiable_bwd(forward, sm_scale, d_v, backward_config, drows_max_bytes, interpret,
                        residuals, cotangents):
  del forward
  dq_THL, dkv_SL = sparse_mqa_backward(
      *residuals, *cotangents, sm_scale=sm_scale, d_v=d_v, config=backward_config,
      drows_max_bytes=drows_max_bytes, interpret=interpret)
  return dq_THL, dkv_SL, None  # int32 indices: no cotangent


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def _forward(q_THL, kv_SL, topk_TK, *, sm_scale, d_v, config, interpret):
  (T, H, L), S, K = q_THL.shape, _num_rows(kv_SL), topk_TK.shape[1]
  block_h, block_k = config.block_h, config.block_k
  padded_k = pl.cdiv(K, block_k) * block_k  # the top-k block overhangs; loads are masked
  static = dict(sm_scale=sm_scale, num_heads=H, num_rows=S, topk=K, config=config)
  if isinstance(kv_SL, Fp8LatentRows):
    kernel = functools.partial(_sparse_mqa_fp8_kernel, tile=kv_SL.tile, **static)
    kv_args = tuple(kv_SL)
    row_bytes = sum(part.shape[1] * part.dtype.itemsize for part in kv_args)
  else:
    kernel = functools.partial(_sparse_mqa_kernel, d_v=d_v, **static)
    kv_args = (kv_SL,)
    row_bytes = L * kv_SL.dtype.itemsize
  itemsize = q_THL.dtype.itemsize
  cost = pl.CostEstimate(
      flops=2 * T * K * H * (L + d_v),
      transcendentals=T * K * H,
      bytes_accessed=itemsize * T * H * (L + d_v) + row_bytes * T * K * pl.cdiv(H, block_h)
      + 4 * (T * K + T * H),
  )
  sq = _compat.SQUEEZED
  return pl.pallas_call(
      kernel,
      grid=(T, pl.cdiv(H, block_h)),
      in_specs=[
          pl.BlockSpec((sq, block_h, L), lambda t, h: (t, h, 0)),
          *(tiles.whole(a) for a in kv_args),
          pl.BlockSpec((sq, padded_k), lambda t, h: (t, 0)),
      ],
      out_specs=[
          pl.BlockSpec((sq, block_h, d_v), lambda t, h: (t, h, 0)),
          pl.BlockSpec((sq, block_h), lambda t, h: (t, h)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((T, H, d_v), q_THL.dtype),
          jax.ShapeDtypeStruct((T, H), jnp.float32),
      ],
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=cost,
      interpret=interpret,
      name="sparse_mqa_attention",
  )(q_THL, *kv_args, topk_TK)
