"""The tile helpers that :mod:`pallas_kernels.dense_mha` and its backward share.

Which pairs a query sees (:func:`visible_keys`, the reference's rule and the masked kernels'
input), the key-block walks of the causal and the masked programs, the bitmask test of one
tile, the block schedule and the zeroing of non-finite rows. The backward kernels
(:mod:`pallas_kernels.dense_mha_backward`) recompute the forward's tiles with the same masks, so
both import these from here: the forward can then import its backward for its
``jax.custom_vjp`` without an import cycle.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.block_config import DenseMHAKernelConfig


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


def visible_keys(num_tokens: int, num_keys: int, q_offset, kv_len, topk_TK=None,
                 segment_ids_T=None):
  """[T, S] bool: query t sees key s when ``s <= q_offset + t`` and ``s < kv_len`` and, given
  ``topk_TK``, ``s`` is in ``topk_TK[t]`` (:func:`selected_keys`) and, given
  ``segment_ids_T`` (then the key rows are the query rows), ``s`` is in t's segment."""
  rows_T = q_offset + jnp.arange(num_tokens, dtype=jnp.int32)
  cols_S = jnp.arange(num_keys, dtype=jnp.int32)
  visible_TS = (cols_S[None, :] <= rows_T[:, None]) & (cols_S[None, :] < kv_len)
  if topk_TK is not None:
    visible_TS &= selected_keys(topk_TK, num_keys)
  if segment_ids_T is not None:
    visible_TS &= segment_ids_T[:, None] == segment_ids_T[None, :]
  return visible_TS


def sanitize_values(values):
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


def query_rows(block_q: int, num_tokens: int):
  """This program's query rows and the mask of those that exist (the last block overhangs)."""
  rows_Q = pl.program_id(0) * block_q + jnp.arange(block_q, dtype=jnp.int32)
  return rows_Q, rows_Q < num_tokens


def causal_walks(meta_ref, *, num_keys, block_q, block_k):
  """The key-block loops (the ``walks`` of the forward's flash walk and of the dq walk) of the
  causal program of query block ``program_id(0)``: the blocks it sees whole, then those on the
  diagonal or at ``kv_len``."""
  # kv_len beyond S would let the diagonal mask pass the key block's zero-filled overhang.
  q_offset, kv_len = meta_ref[0], jnp.minimum(meta_ref[1], num_keys)
  rows_Q = pl.program_id(0) * block_q + jnp.arange(block_q, dtype=jnp.int32)
  positions_Q = q_offset + rows_Q

  def causal(start, cols_K):
    return (cols_K[None, :] <= positions_Q[:, None]) & (cols_K[None, :] < kv_len)

  # Key blocks before num_full are seen whole by every query of the block (no masks needed);
  # keys past the block's last query position or past kv_len are never visible.
  first_position = q_offset + pl.program_id(0) * block_q
  last_visible = jnp.minimum(kv_len, first_position + block_q)
  num_blocks = jnp.clip(pl.cdiv(last_visible, block_k), 0, pl.cdiv(num_keys, block_k))
  seen_by_all = jnp.minimum(first_position + 1, kv_len)
  num_full = jnp.clip(jnp.maximum(seen_by_all, 0) // block_k, 0, num_blocks)
  in_order = lambda j: j
  return [(0, num_full, in_order, None), (num_full, num_blocks, in_order, causal)]


_WORD = 32  # keys per word of the selection bitmask


def selected_pairs(bits_ref, rows, row_mask_Q, start, cols_K):
  """[block_q, block_k] bool: query ``rows`` (a slice of the bitmask's token axis) selected key
  ``cols_K`` (the key block from ``start``), read as bit ``s % 32`` of word ``s // 32``: one
  coalesced load of the block's query rows per word."""
  block_k = cols_K.shape[0]
  first_word = start // _WORD
  words = [_compat.load(bits_ref.at[first_word + w, rows], mask=row_mask_Q, other=0)
           for w in range(max(1, block_k // _WORD))]
  word_of_col_K = jnp.arange(block_k, dtype=jnp.int32) // _WORD
  word_QK = words[0][:, None]
  for w in range(1, len(words)):
    word_QK = jnp.where((word_of_col_K == w)[None, :], words[w][:, None], word_QK)
  bit_K = (cols_K % _WORD).astype(jnp.uint32)
  return (jnp.right_shift(word_QK, bit_K[None, :]) & 1) == 1


def masked_walks(bits_ref, key_blocks_ref, num_blocks_ref, *, num_tokens, block_q):
  """The one key-block loop of the masked program of query block ``program_id(0)``: only the
  key blocks in which some of its queries selected a key, in ascending order."""
  _, row_mask_Q = query_rows(block_q, num_tokens)
  selected = functools.partial(selected_pairs, bits_ref, pl.ds(0, block_q), row_mask_Q)
  return [(0, num_blocks_ref[0], lambda n: key_blocks_ref[n], selected)]


def block_schedule(active_XN):
  """Per row of the bool tile map ``active_XN``: its active columns ascending, then the others
  (never read); and how many are active."""
  order_XN = jnp.argsort(~active_XN, axis=-1, stable=True).astype(jnp.int32)
  return order_XN, active_XN.sum(axis=-1, dtype=jnp.int32)


def mask_bits(visible_TS, config: DenseMHAKernelConfig):
  """``(bits_WT, active_QN)``: the bitmask of ``visible_TS`` (see
  :func:`pallas_kernels.dense_mha.mask_operands`) and the [query blocks, key blocks] map of the
  tiles in which some query sees a key."""
  block_q, block_k = config.block_q, config.block_k
  T, S = visible_TS.shape
  num_q_blocks, num_k_blocks = pl.cdiv(T, block_q), pl.cdiv(S, block_k)
  num_words = pl.cdiv(num_k_blocks * block_k, _WORD)
  padded_TS = jnp.pad(visible_TS, ((0, num_q_blocks * block_q - T), (0, num_words * _WORD - S)))
  powers = jnp.left_shift(jnp.uint32(1), jnp.arange(_WORD, dtype=jnp.uint32))
  # Distinct powers of two: their sum is their bitwise or.
  bits_TW = (padded_TS[:T].reshape(T, num_words, _WORD) * powers).sum(-1, dtype=jnp.uint32)
  tiles = padded_TS[:, :num_k_blocks * block_k].reshape(num_q_blocks, block_q, num_k_blocks,
                                                        block_k)
  return bits_TW.T, tiles.any(axis=(1, 3))


def causal_pairs(num_tokens: int, num_keys: int) -> int:
  """The (query, key) pairs of a fresh causal prefill (q_offset 0, kv_len S)."""
  return sum(min(t + 1, num_keys) for t in range(num_tokens))
