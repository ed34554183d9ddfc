"""Lightning-indexer logits (docs/design.md §5, §8).

Kernel layout: one program computes a ``block_t`` x ``block_s`` logits tile. The key tile is
loaded once and the G heads are looped inside, each a plain 2-D dot ``q[:, g, :] @ k^T``
(Triton has no 3-D dots); relu, weighting by ``w[:, g]`` and the head sum happen in fp32
registers. q is viewed as [T, G * I] (a free reshape) so each head is a column slice. Tiles
that lie outside every row's ``[start, end)`` window are written as -inf without any dot.
fp8 q and k go straight into an fp8 x fp8 -> fp32 dot (exact products, fp32 accumulation).

Key rows come one of two ways. Contiguous: ``k_SI`` holds the sequence's keys and each tile
is a BlockSpec block of it. Pooled (``key_rows_S``): ``k_SI`` is a pool of rows that many
sequences share (a paged cache) and column s scores pool row ``key_rows_S[s]``; the pool is a
whole-array input, and each program loads its ``block_s`` row ids, clamps invalid ones (-1)
to row 0, gathers those rows (and their fp8 scales) and replaces the invalid columns by -inf,
the sparse MQA kernel's gather. No per-sequence copy of the keys is ever made.

``indexer_logits`` is a ``jax.custom_vjp``: the forward saves only its inputs, the backward
recomputes the dots in two kernels of their own (:mod:`pallas_kernels.indexer_logits_backward`),
which read the keys with the same two readers (:mod:`pallas_kernels.indexer_logits_tiles`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _checks, _compat
from pallas_kernels.block_config import IndexerLogitsKernelConfig
from pallas_kernels.indexer_logits_backward import indexer_logits_vjp
from pallas_kernels.indexer_logits_tiles import FP8, key_tile, pooled_key_rows, valid_rows


_INDEXER_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn)


def validate_indexer_logits(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S, key_rows_S=None):
  """The one argument check of :func:`indexer_logits` and :func:`indexer_logits_reference`."""
  op = "indexer_logits"
  T, G, I = _checks.array(op, "q_TGI", q_TGI, "TGI")
  S, _ = _checks.array(op, "k_SI", k_SI, "SI")
  _checks.array(op, "w_TG", w_TG, "TG")
  if G == 0 or I == 0:
    raise ValueError(f"{op}: q_TGI needs at least one head and a positive head dim, got G={G}, "
                     f"I={I}")
  if k_SI.shape[1] != I:
    raise ValueError(f"{op}: k_SI width {k_SI.shape[1]} != q_TGI head dim {I}")
  if w_TG.shape != (T, G):
    raise ValueError(f"{op}: w_TG shape {tuple(w_TG.shape)} != (T, G) = {(T, G)} of q_TGI")
  for name, x in (("starts_T", starts_T), ("ends_T", ends_T)):
    _checks.array(op, name, x, "T")
    if x.shape != (T,):
      raise ValueError(f"{op}: {name} shape {tuple(x.shape)} != (T,) = {(T,)} of q_TGI")
    _checks.int32_array(op, name, x)
  _checks.float_dtype(op, "q_TGI", q_TGI, _INDEXER_DTYPES)
  _checks.float_dtype(op, "k_SI", k_SI, _INDEXER_DTYPES)
  if key_rows_S is None:
    _checks.same_dtype(op, q_TGI=q_TGI, k_SI=k_SI)
  else:
    _checks.array(op, "key_rows_S", key_rows_S, "S")
    _checks.int32_array(op, "key_rows_S", key_rows_S)
    if (q_TGI.dtype == FP8) != (k_SI.dtype == FP8):
      raise TypeError(f"{op}: k_SI dtype {k_SI.dtype} and q_TGI dtype {q_TGI.dtype}: fp8 keys "
                      "need fp8 queries (a float pool is cast to the queries' dtype per row)")
  _checks.float_dtype(op, "w_TG", w_TG)
  if k_scale_S is not None:
    _checks.array(op, "k_scale_S", k_scale_S, "S")
    if k_scale_S.shape != (S,):
      raise ValueError(f"{op}: k_scale_S shape {tuple(k_scale_S.shape)} != (S,) = {(S,)} of k_SI")
    _checks.float_dtype(op, "k_scale_S", k_scale_S)


def _num_scored(k_SI, key_rows_S) -> int:
  """Logit columns: the keys, or the pool rows named by ``key_rows_S``."""
  return k_SI.shape[0] if key_rows_S is None else key_rows_S.shape[0]


def _nothing_to_score(q_TGI, k_SI, key_rows_S):
  """T, S or the pool is empty: the logits (all -inf, maybe empty), with no kernel run."""
  T, S = q_TGI.shape[0], _num_scored(k_SI, key_rows_S)
  return jnp.full((T, S), -jnp.inf, jnp.float32) if 0 in (T, S, k_SI.shape[0]) else None


def indexer_logits_reference(q_TGI, k_SI, w_TG, starts_T, ends_T, *, k_scale_S=None,
                             key_rows_S=None):
  """``logits[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s])`` on ``[starts[t], ends[t])``.

  Args:
    q_TGI: indexer queries (float32, bfloat16 or float8_e4m3fn), G >= 1 heads of I >= 1 dims.
      For fp8, fold the per (token, head) dequant scale of q into ``w_TG`` (DeepGEMM's
      convention).
    k_SI: indexer keys, one head shared by all G query heads; same dtype as ``q_TGI``. With
      ``key_rows_S``, a pool of key rows [P, I] instead (float rows of any indexer dtype are
      cast to the dtype of ``q_TGI`` once gathered; fp8 rows need fp8 queries).
    w_TG: float head weights, all score scalings already folded in.
    starts_T, ends_T: int32 causal window of each query row.
    k_scale_S: optional float per-key dequant scale (fp8 keys), one per row of ``k_SI``.
    key_rows_S: optional int32 [S] row of ``k_SI`` that logit column s scores (a paged
      cache's physical rows); -1 (or any id outside the pool) means no key: -inf.

  Returns:
    float32 logits [T, S]; -inf outside each row's window (and in columns without a key).
    T = 0 or S = 0 gives an empty array. Every logit depends on its own key row only, and
    logits outside the window are replaced, so NaN or inf in a key (or key scale) outside a
    row's window, or in a pool row no column names, never reaches that row.

  Gradients (autodiff; the kernel's custom VJP gives the same): relu' is 0 at 0, the
  cotangent of a -inf logit is dropped (NaN there included), and a key that no row scores
  gets exactly 0 and, NaN or not, adds nothing to dq and dw. fp8 keys and ``k_scale_S`` are
  constants (zero cotangents); with ``key_rows_S`` the pool's rows get the sum over the
  columns that name them.

  Raises:
    ValueError, TypeError: from :func:`validate_indexer_logits`, naming the argument.
  """
  validate_indexer_logits(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S, key_rows_S)
  if (empty := _nothing_to_score(q_TGI, k_SI, key_rows_S)) is not None:
    return empty
  has_key_S = jnp.ones(k_SI.shape[:1], bool)
  if key_rows_S is not None:  # the reference gathers the rows it scores
    has_key_S, safe_S = valid_rows(key_rows_S, k_SI.shape[0])
    k_SI = k_SI[safe_S].astype(q_TGI.dtype)
    k_scale_S = None if k_scale_S is None else k_scale_S[safe_S]
  # fp8 keys and their scales are constants (a quantized cache): no cotangent reaches them.
  if k_SI.dtype.itemsize == 1:
    k_SI = jax.lax.stop_gradient(k_SI)
  cols_S = jnp.arange(k_SI.shape[0], dtype=jnp.int32)
  inside_TS = ((cols_S[None, :] >= starts_T[:, None]) & (cols_S[None, :] < ends_T[:, None])
               & has_key_S[None, :])
  # Keys (and scales) that no row scores are zeroed: the forward replaces their columns anyway,
  # but NaN there would reach dq and dw as 0 * NaN.
  scored_S = inside_TS.any(axis=0)
  dots_TGS = jnp.einsum(
      "tgi,si->tgs",
      q_TGI.astype(jnp.float32) if q_TGI.dtype.itemsize == 1 else q_TGI,
      jnp.where(scored_S[:, None],
                k_SI.astype(jnp.float32) if k_SI.dtype.itemsize == 1 else k_SI, 0),
      preferred_element_type=jnp.float32,
  )
  # jax.nn.relu: gradient 0 at exactly 0 (jnp.maximum would split it, 1/2 each).
  logits_TS = jnp.einsum("tg,tgs->ts", w_TG.astype(jnp.float32), jax.nn.relu(dots_TGS))
  if k_scale_S is not None:
    scale_S = jnp.where(scored_S, jax.lax.stop_gradient(k_scale_S).astype(jnp.float32), 0.0)
    logits_TS = logits_TS * scale_S[None, :]
  return jnp.where(inside_TS, logits_TS, -jnp.inf)


# ---- the kernel: one tile body, two ways of reading the key rows --------------------------

def _indexer_logits_kernel(
    q_ref, w_ref, starts_ref, ends_ref, *key_refs, read_keys, num_tokens, num_keys, num_heads,
    dim, config
):
  *key_refs, out_ref = key_refs
  block_t, block_s = config.block_t, config.block_s
  rows_T = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
  cols_S = pl.program_id(1) * block_s + jnp.arange(block_s, dtype=jnp.int32)
  row_mask_T, col_mask_S = rows_T < num_tokens, cols_S < num_keys
  store_mask_TS = row_mask_T[:, None] & col_mask_S[None, :]
  starts_T = _compat.load(starts_ref, mask=row_mask_T, other=num_keys)
  ends_T = _compat.load(ends_ref, mask=row_mask_T, other=0)
  first_col = pl.program_id(1) * block_s
  skip = (first_col >= ends_T.max()) | (first_col + block_s <= starts_T.min())

  @pl.when(skip)
  def _():
    _compat.store(out_ref, jnp.full((block_t, block_s), -jnp.inf, jnp.float32), mask=store_mask_TS)

  @pl.when(jnp.logical_not(skip))
  def _():
    has_key_S, k_SI, read_scale = read_keys(col_mask_S, *key_refs)
    precision = _compat.dot_precision(q_ref.dtype)

    def head(g, acc_TS):
      q_TI = _compat.load(
          q_ref.at[:, pl.ds(pl.multiple_of(g * dim, dim), dim)], mask=row_mask_T[:, None], other=0
      )
      w_T = _compat.load(w_ref.at[g, :], mask=row_mask_T, other=0.0)
      dots_TS = jax.lax.dot_general(
          q_TI, k_SI, (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32, precision=precision,
      )
      return acc_TS + w_T[:, None] * jnp.maximum(dots_TS, 0.0)

    logits_TS = jax.lax.fori_loop(
        0, num_heads, head, jnp.zeros((block_t, block_s), jnp.float32)
    )
    if read_scale is not None:
      # Read only now: scales held across the head loop cost registers (sm_90a fp8 tile:
      # 162 instead of 158; pooled 184 instead of 157).
      logits_TS = logits_TS * read_scale()[None, :]
    # Replaced, not masked by a product: an unnamed row (row 0 for -1) may hold NaN.
    inside_TS = ((cols_S[None, :] >= starts_T[:, None]) & (cols_S[None, :] < ends_T[:, None])
                 & has_key_S[None, :])
    _compat.store(out_ref, jnp.where(inside_TS, logits_TS, -jnp.inf), mask=store_mask_TS)


def indexer_logits(
    q_TGI, k_SI, w_TG, starts_T, ends_T, *, k_scale_S=None, key_rows_S=None,
    config: IndexerLogitsKernelConfig | None = None, interpret: bool = False,
):
  """Pallas-Triton indexer logits; the contract and checks of :func:`indexer_logits_reference`.

  With ``key_rows_S`` the pool ``k_SI`` (and ``k_scale_S``) is read in place, row by row.
  Differentiable in q, w and float keys (the backward kernels of
  :mod:`pallas_kernels.indexer_logits_backward`); fp8 keys and ``k_scale_S`` are constants.
  """
  validate_indexer_logits(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S, key_rows_S)
  _checks.kernel_config("indexer_logits", config, IndexerLogitsKernelConfig)
  if (empty := _nothing_to_score(q_TGI, k_SI, key_rows_S)) is not None:
    return empty
  if config is None:
    config = IndexerLogitsKernelConfig.default_for(q_TGI.shape[0], _num_scored(k_SI, key_rows_S))
  forward = functools.partial(_forward_kernel, config, interpret)
  return with_triton_backward(forward, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S,
                              key_rows_S, interpret=interpret)


def _forward_kernel(config, interpret, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S,
                    key_rows_S):
  (T, G, I), S = q_TGI.shape, _num_scored(k_SI, key_rows_S)
  block_t, block_s = config.block_t, config.block_s
  key_block = lambda *width: pl.BlockSpec((block_s, *width), lambda t, s: (s,) + (0,) * len(width))
  whole = lambda a: pl.BlockSpec(a.shape, lambda t, s: (0,) * a.ndim)  # every program, every row
  scales = () if k_scale_S is None else (k_scale_S.astype(jnp.float32),)
  if key_rows_S is None:
    read_keys = key_tile
    key_args = (k_SI, *scales)
    key_specs = [key_block(I), *(key_block() for _ in scales)]
  else:
    read_keys = functools.partial(pooled_key_rows, dtype=q_TGI.dtype)
    key_args = (key_rows_S, k_SI, *scales)
    key_specs = [key_block(), *(whole(a) for a in key_args[1:])]
  kernel = functools.partial(
      _indexer_logits_kernel, read_keys=read_keys, num_tokens=T, num_keys=S, num_heads=G,
      dim=I, config=config
  )
  in_specs = [
      pl.BlockSpec((block_t, G * I), lambda t, s: (t, 0)),
      pl.BlockSpec((G, block_t), lambda t, s: (0, t)),
      pl.BlockSpec((block_t,), lambda t, s: (t,)),
      pl.BlockSpec((block_t,), lambda t, s: (t,)),
      *key_specs,
  ]
  # w is transposed (tiny) so that each head's weights are one contiguous row.
  args = [q_TGI.reshape(T, G * I), w_TG.astype(jnp.float32).T, starts_T, ends_T, *key_args]
  key_row_bytes = I * k_SI.dtype.itemsize + 4 * (len(scales) + (key_rows_S is not None))
  cost = pl.CostEstimate(
      flops=2 * T * S * G * I + 3 * T * S * G,
      transcendentals=0,
      bytes_accessed=q_TGI.dtype.itemsize * T * G * I * pl.cdiv(S, block_s)
      + key_row_bytes * S * pl.cdiv(T, block_t) + 4 * (T * S + T * G + 2 * T),
  )
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(T, block_t), pl.cdiv(S, block_s)),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((block_t, block_s), lambda t, s: (t, s)),
      out_shape=jax.ShapeDtypeStruct((T, S), jnp.float32),
      compiler_params=_compat.compiler_params(config.num_warps, config.num_stages),
      cost_estimate=cost,
      interpret=interpret,
      name="indexer_logits",
  )(*args)


def with_triton_backward(forward, *args, interpret: bool = False):
  """``forward(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S, key_rows_S) -> logits_TS`` made
  differentiable by the Pallas-Triton backward kernels (any forward kernel with this contract:
  the Triton one, or the Mosaic GPU one). Arguments already validated, nothing empty."""
  return _differentiable_logits(forward, interpret, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _differentiable_logits(forward, interpret, *args):
  del interpret
  return forward(*args)


def _forward_with_residuals(forward, interpret, *args):
  return forward(*args), args


def _backward(forward, interpret, args, dlogits_TS):
  del forward  # the backward kernels are their own, whichever forward ran
  return indexer_logits_vjp(dlogits_TS, *args, interpret=interpret)


_differentiable_logits.defvjp(_forward_with_residuals, _backward)
