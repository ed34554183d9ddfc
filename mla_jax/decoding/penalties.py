"""Repetition, frequency and presence penalties (vLLM's rules), from each sequence's tokens on
the device.

An engine keeps every cached token's id in a pool beside its key pools (``token_ids``: one
int32 per token row, at the same page slots as its keys), so a step finds a sequence's
tokens through its block table as attention finds its keys: prefix hits and preemptions need
nothing of their own. Counting costs a gather of the block table's rows and a scatter into
``[S, V]``; only the ``FULL`` step programs do it (``decoding.logits``: a step whose batch
asks for a penalty, a bias, log-probabilities or ``min_tokens`` runs one), never a multi-step
decode dispatch.

The rules, per sequence, on the logits before temperature: a token seen in the prompt or the
output has its logit divided by ``repetition`` if positive, multiplied by it otherwise; then
each output token's logit loses ``frequency`` x its count and ``presence`` once.
"""

from __future__ import annotations

import jax.numpy as jnp


def record_ids(token_ids, ids_T, table_TN, pos_T, real_T, page_size: int):
  """``token_ids`` with each real row's token id written at its position's page slot."""
  page_T = jnp.take_along_axis(table_TN, (pos_T // page_size)[:, None], axis=1)[:, 0]
  slot_T = jnp.where(real_T > 0, page_T * page_size + pos_T % page_size, token_ids.shape[0])
  return token_ids.at[slot_T].set(ids_T, mode="drop")


def context_counts(token_ids, table_SN, last_S, num_prompt_S, page_size: int, vocab_size: int):
  """``(output counts [S, V] int32, seen [S, V] bool)`` of each sequence's tokens at positions
  ``[0, last_S]``: how often each id occurs at a position ``>= num_prompt_S`` (the output), and
  whether it occurs at all (prompt or output)."""
  s, n = table_SN.shape
  slots_SL = (table_SN[:, :, None] * page_size + jnp.arange(page_size)).reshape(s, n * page_size)
  ids_SL = token_ids[slots_SL]
  pos_L = jnp.arange(n * page_size)
  in_context_SL = pos_L[None, :] <= last_S[:, None]
  output_SL = in_context_SL & (pos_L[None, :] >= num_prompt_S[:, None])
  rows_SL = jnp.broadcast_to(jnp.arange(s)[:, None], ids_SL.shape)
  zeros_SV = jnp.zeros((s, vocab_size), jnp.int32)
  counts_SV = zeros_SV.at[rows_SL, ids_SL].add(output_SL.astype(jnp.int32))
  seen_SV = zeros_SV.at[rows_SL, ids_SL].add(in_context_SL.astype(jnp.int32)) > 0
  return counts_SV, seen_SV


def penalized(logits_SJV, counts_SV, seen_SV, repetition_S, frequency_S, presence_S):
  """Every row j of sequence s with its penalties applied (the module docstring's rules)."""
  rep_S11 = repetition_S[:, None, None]
  seen_S1V, counts_S1V = seen_SV[:, None], counts_SV[:, None].astype(logits_SJV.dtype)
  logits_SJV = jnp.where(seen_S1V, jnp.where(logits_SJV > 0, logits_SJV / rep_S11,
                                             logits_SJV * rep_S11), logits_SJV)
  return (logits_SJV - frequency_S[:, None, None] * counts_S1V
          - presence_S[:, None, None] * (counts_S1V > 0))
