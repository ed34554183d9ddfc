"""The lightning indexer: scores past tokens and selects each query's top-k (docs/design.md §5).

``I[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s])`` with ``w`` already scaled by
``I**-0.5 * G**-0.5``. Its q/k layout is [rope | nope], the reverse of the main attention.
Selection is deterministic: ``lax.top_k`` breaks ties by the lower index. Rows that see
fewer than top-k keys are padded with -1. A NaN score counts as -inf: that key is never
selected and never displaces a finite one (see ``topk_indices``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.config import MLAConfig
from mla_jax.fp8_cache import Fp8Keys, quantize_indexer_queries
from mla_jax.layers import LayerNorm, Linear
from mla_jax.rope import apply_rope


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int) -> np.ndarray:
  """Orthonormal, symmetric Walsh-Hadamard matrix of size n (a power of two)."""
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return (h * n**-0.5).astype(np.float32)


def topk_indices(logits_BTS, k: int):
  """int32 [B, T, k] indices of the largest logits; -1 where a row has fewer finite ones.

  A NaN logit is treated as -inf, so it is never selected: ``lax.top_k`` alone would rank a
  NaN by its sign bit, above every finite score, and a poisoned key (or cache row) would push
  real keys out of the selection. A row whose scores are all NaN or -inf gets no index; the
  attention then refuses it (``mla_jax.checks.rows_attend``, eager or checked) or, unchecked
  under ``jit``, gives that row a zero output. Ties go to the lower index (``lax.top_k``'s
  documented order), so selection is stable from run to run.
  """
  width = min(k, logits_BTS.shape[-1])
  logits_BTS = jnp.where(jnp.isnan(logits_BTS), -jnp.inf, logits_BTS)
  values, idx = jax.lax.top_k(logits_BTS, width)
  idx = jnp.where(values == -jnp.inf, -1, idx).astype(jnp.int32)
  if width < k:
    idx = jnp.pad(idx, ((0, 0), (0, 0), (0, k - width)), constant_values=-1)
  return idx


def scoring_operands(q_BTGI, keys, w_BTG, *, pooled: bool):
  """``(q, keys, w, key scales or None)`` for ``Backend.indexer_logits``.

  With fp8 keys (``Fp8Keys``) the queries are quantized to e4m3 too, one scale per (token,
  head) folded into the head weights, and the per-key scales go to the backend; float keys
  are cast to the queries' dtype (a cache may be wider than the model's dtype). A pool
  (``pooled``) is left as it is: the op casts the rows it reads, the pool is never copied.
  """
  if isinstance(keys, Fp8Keys):
    q_BTGI, w_BTG = quantize_indexer_queries(q_BTGI, w_BTG)
    return q_BTGI, keys.values, w_BTG, keys.scales
  return q_BTGI, keys if pooled else keys.astype(q_BTGI.dtype), w_BTG, None


class Indexer(nnx.Module):
  """Parameters named as in Hugging Face: ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``."""

  def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
    ic = config.indexer
    self.config = config
    self.wq_b = Linear(config.q_lora_rank, ic.num_heads * ic.head_dim, rngs=rngs,
                       param_dtype=param_dtype)
    self.wk = Linear(config.hidden_size, ic.head_dim, rngs=rngs, param_dtype=param_dtype)
    self.k_norm = LayerNorm(ic.head_dim, eps=ic.norm_eps, param_dtype=param_dtype)
    # HF keeps weights_proj in float32 (_keep_in_fp32_modules); so do we.
    self.weights_proj = Linear(config.hidden_size, ic.num_heads, rngs=rngs,
                               param_dtype=jnp.float32)

  def _rope_and_rotate(self, x, positions_BT):
    """RoPE on the first R dims (pairing per model), then the optional Hadamard rotation."""
    ic, rope_dim = self.config.indexer, self.config.qk_rope_head_dim
    x_pe = apply_rope(x[..., :rope_dim], positions_BT, self.config.rope,
                      interleaved=ic.rope_interleave,
                      max_position=self.config.max_position_embeddings)
    x = jnp.concatenate([x_pe, x[..., rope_dim:]], axis=-1)
    if ic.use_hadamard:  # exact in fp32; it only spreads outliers before fp8 quantization
      x = jnp.einsum("...i,ij->...j", x, jnp.asarray(hadamard_matrix(ic.head_dim), x.dtype),
                     preferred_element_type=jnp.float32).astype(x.dtype)
    return x

  def keys(self, x_BTD, positions_BT):
    """The single-head keys k_I [B, T, I] that the key cache stores."""
    return self._rope_and_rotate(self.k_norm(self.wk(x_BTD)), positions_BT)

  def scores_inputs(self, x_BTD, q_resid_BTC, positions_BT):
    """Queries q_I [B, T, G, I] and scaled head weights w [B, T, G] (float32)."""
    ic = self.config.indexer
    b, t = x_BTD.shape[:2]
    q_BTGI = self.wq_b(q_resid_BTC).reshape(b, t, ic.num_heads, ic.head_dim)
    q_BTGI = self._rope_and_rotate(q_BTGI, positions_BT)
    w_BTG = self.weights_proj(x_BTD.astype(jnp.float32)) * ic.score_scale
    return q_BTGI, w_BTG

  def logits(self, x_BTD, q_resid_BTC, positions_BT, keys_BSI, backend, *, key_rows_BS=None):
    """Every query's scores [B, T, S] against the cached keys, -inf past its causal end.

    Unchunked, for training: the indexer loss needs the whole score matrix. ``keys_BSI`` and
    ``key_rows_BS`` as in ``select``.
    """
    q_BTGI, w_BTG = self.scores_inputs(x_BTD, q_resid_BTC, positions_BT)
    q_BTGI, keys, w_BTG, k_scale = scoring_operands(q_BTGI, keys_BSI, w_BTG,
                                                     pooled=key_rows_BS is not None)
    ends_BT = positions_BT + 1  # causal, self included
    return backend.indexer_logits(q_BTGI, keys, w_BTG, jnp.zeros_like(ends_BT), ends_BT,
                                  k_scale_BS=k_scale, key_rows_BS=key_rows_BS)

  def select(self, x_BTD, q_resid_BTC, positions_BT, keys_BSI, backend, *, chunk_size: int,
             key_rows_BS=None):
    """Top-k positions of the cached keys for every query: int32 [B, T, topk], -1 padded.

    ``keys_BSI`` is an array or ``Fp8Keys`` (an fp8 cache, see ``scoring_operands``): each
    sequence's keys [B, S, I], or, with ``key_rows_BS`` (int32 [B, S], what
    ``CacheView.index_keys`` gives), a pool of key rows [P, I] that position s of sequence b
    reads at row ``key_rows_BS[b, s]``. Query rows are scored ``chunk_size`` at a time so that
    a long prefill never holds more than a [B, chunk_size, S] block of logits.
    """
    q_BTGI, w_BTG = self.scores_inputs(x_BTD, q_resid_BTC, positions_BT)
    q_BTGI, keys, w_BTG, k_scale = scoring_operands(q_BTGI, keys_BSI, w_BTG,
                                                     pooled=key_rows_BS is not None)
    ends_BT = positions_BT + 1  # causal, self included
    topk = self.config.indexer.topk

    def score(q, w, ends):
      logits = backend.indexer_logits(q, keys, w, jnp.zeros_like(ends), ends,
                                      k_scale_BS=k_scale, key_rows_BS=key_rows_BS)
      return topk_indices(logits, topk)

    b, t = ends_BT.shape
    if t <= chunk_size:
      return score(q_BTGI, w_BTG, ends_BT)
    pad = -t % chunk_size
    n = (t + pad) // chunk_size

    def to_chunks(a):
      a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
      return jnp.moveaxis(a.reshape(b, n, chunk_size, *a.shape[2:]), 1, 0)

    idx = jax.lax.map(lambda args: score(*args), (to_chunks(q_BTGI), to_chunks(w_BTG),
                                                  to_chunks(ends_BT)))
    return jnp.moveaxis(idx, 0, 1).reshape(b, n * chunk_size, topk)[:, :t]

  def select_in_blocks(self, x_BTD, q_resid_BTC, positions_BT, key_pool, key_rows,
                       ops, *, blocks: KeyBlocks, key_chunk: int, context_topk: str = "exact"):
    """``select`` over a page pool for a flat step (each row b one token, ``T`` = 1),
    scoring only each row's own keys: the (row, key chunk) pairs of ``blocks``, each
    ``key_chunk`` positions, then a per-row top-k over them (``segmented_topk``): [B, 1, k]. So the work
    grows with the sum of the rows' reaches, not rows x the longest, and no loop runs on a
    traced bound. Equal to ``select`` (the same indices in the same order).

    ``key_pool``: the pool of key rows (as ``select``'s pooled ``keys_BSI``);
    ``key_rows(rows_N, positions_NC)``: the pool row of each position of row ``rows_N``'s
    sequence (-1: none); ``ops``: the layer's ``MeshOps``. On a mesh with a ``context`` axis
    ``context_topk`` says how the ranks' selections combine (``MeshOps.ragged_topk``).
    """
    q_BTGI, w_BTG = self.scores_inputs(x_BTD, q_resid_BTC, positions_BT)
    q_BTGI, keys, w_BTG, k_scale = scoring_operands(q_BTGI, key_pool, w_BTG, pooled=True)
    b = positions_BT.shape[0]
    rows_N = jnp.minimum(blocks.row_N, b - 1)  # padding blocks: any row, an empty window
    starts_N = blocks.start_N
    ends_N1 = jnp.where((blocks.row_N < b)[:, None],
                        jnp.clip(positions_BT[rows_N, :1] + 1 - starts_N[:, None], 0, key_chunk),
                        0)
    positions_NC = starts_N[:, None] + jnp.arange(key_chunk, dtype=jnp.int32)
    return ops.ragged_topk(q_BTGI[rows_N], keys, w_BTG[rows_N], ends_N1, k_scale,
                           key_rows(rows_N, positions_NC), blocks,
                           self.config.indexer.topk, context_topk)[:, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyBlocks:
  """The (row, key chunk) pairs a flat step's indexer scores: block n covers key positions
  ``[start_N[n], start_N[n] + key_chunk)`` of row ``row_N[n]``'s sequence (its window ends at
  the row's reach). A row's blocks are consecutive, rows in order: row r's are
  ``[first_R[r], first_R[r] + count_R[r])``; padding blocks (``row_N`` = rows, past every
  real row) come last."""

  row_N: jax.Array
  start_N: jax.Array
  first_R: jax.Array
  count_R: jax.Array

  @classmethod
  def for_reaches(cls, reach_R, key_chunk: int, num_blocks: int) -> KeyBlocks:
    """The blocks of rows whose keys end at ``reach_R`` (0: none) in ``num_blocks`` slots
    (on the device, from the rows' reaches alone; ``blocks_needed`` of them are real, the
    rest padding). More than ``num_blocks`` needed is the caller's error: the rows past the
    slots would score nothing."""
    reach_R = jnp.asarray(reach_R, jnp.int32)
    count_R = (reach_R + key_chunk - 1) // key_chunk
    ends_R = jnp.cumsum(count_R, dtype=jnp.int32)
    first_R = ends_R - count_R
    n_N = jnp.arange(num_blocks, dtype=jnp.int32)
    row_N = jnp.searchsorted(ends_R, n_N, side="right").astype(jnp.int32)  # padding: R
    start_N = (n_N - first_R[jnp.minimum(row_N, len(count_R) - 1)]) * key_chunk
    return cls(row_N, jnp.where(row_N < len(count_R), start_N, 0), first_R, count_R)


def blocks_needed(reach_R, key_chunk: int) -> int:
  """How many key blocks rows reaching ``reach_R`` keys need (``KeyBlocks.for_reaches``)."""
  return int((-(-np.asarray(reach_R, np.int64) // key_chunk)).sum())


def segmented_topk(logits_NC, blocks: KeyBlocks, k: int):
  """``(values [R, k], positions [R, k])``: each row's top-k over the logits of its own blocks
  (``logits_NC[n, c]``: key ``blocks.start_N[n] + c`` of row ``blocks.row_N[n]``), as
  ``topk_indices`` orders them (by value, ties to the lower position; a NaN counts as -inf;
  -1 / -inf where a row has fewer finite scores than k).

  Each block keeps its own top ``min(k, C)`` (every key of a row's top-k is in its block's),
  then one stable sort by (row, -value) lays each row's candidates end to end in selection
  order: the work follows the blocks, never rows x the longest row."""
  n, c = logits_NC.shape
  width = min(k, c)
  values_NW, cols_NW = jax.lax.top_k(jnp.where(jnp.isnan(logits_NC), -jnp.inf, logits_NC),
                                     width)
  positions_NW = blocks.start_N[:, None] + cols_NW
  rows_NW = jnp.broadcast_to(blocks.row_N[:, None], (n, width))
  # Stable: within a row, blocks come in position order and top_k puts ties lower first.
  _, neg_M, positions_M = jax.lax.sort(
      (rows_NW.reshape(-1), -values_NW.reshape(-1), positions_NW.reshape(-1)), num_keys=2,
      is_stable=True)
  j_K = jnp.arange(k, dtype=jnp.int32)
  take_RK = jnp.minimum(blocks.first_R[:, None] * width + j_K, n * width - 1)
  values_RK = jnp.where(j_K < (blocks.count_R * width)[:, None], -neg_M[take_RK], -jnp.inf)
  return values_RK, jnp.where(values_RK > -jnp.inf, positions_M[take_RK], -1)
