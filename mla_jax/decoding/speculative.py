"""Speculative decoding's shared parts: how many drafts a sequence makes, how the MTP layers
draft them, and how a verification accepts them. ``generate``'s iterations
(``mla_jax.generation.speculative``) and the engine's step programs
(``mla_jax.serving.step_program``) both call these, so the two decode alike.

- **Drafts.** d_1 is the argmax of the MTP layer's logits at the last verified pair; d_{i+1}
  is the argmax of one more MTP step on (the previous MTP output, d_i), by layer
  ``min(i, num_mtp_layers - 1)`` (past the layers the last one repeats, as vLLM does). A
  sequence drafts ``min(k, tokens left - 1)``, so no write passes its last token.
- **Acceptance.** Greedy rows keep the longest prefix of drafts equal to the main model's
  argmax, then the argmax. Sampled rows draft greedily (the draft distribution q is one-hot on
  the draft, as vLLM's MTP proposer), so rejection sampling (Leviathan et al. 2023) keeps
  draft d with probability p(d) and replaces the first rejected one by a draw from p without
  d: the tokens have the main model's distribution p (after each row's temperature, top_k,
  min_p and top_p). A row's randomness for its output token i comes from
  ``fold_in(row key, i)`` alone (the plain sampler's key for the bonus token; folds 1 and 2
  for the acceptance test and the replacement), so a row's tokens never depend on the other
  rows.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mla_jax.decoding.sampling import row_keys, row_logits, sample_rows

MAX_SPECULATIVE_TOKENS = 8  # drafts per step; a verification is k + 1 tokens wide


def drafts_wanted(speculative_B, remaining_B):
  """Drafts a sequence asking for ``speculative_B`` makes with ``remaining_B`` tokens still to
  emit after the ones it has: never its last token's, so no write passes it."""
  return jnp.clip(jnp.minimum(speculative_B, remaining_B - 1), 0)


def residual(p_BV, q_BV):
  """Where a rejected draft's replacement is drawn: max(0, p - q) (unnormalized); p itself
  where that is all zero (p == q up to rounding, when a rejection is all but impossible)."""
  r_BV = jnp.maximum(p_BV - q_BV, 0.0)
  return jnp.where(r_BV.sum(-1, keepdims=True) > 0, r_BV, p_BV)


def row(x_BT, index_B):
  """Row ``index_B[b]`` of every sequence: [B, T, ...] -> [B, ...]."""
  index = index_B.reshape(-1, *([1] * (x_BT.ndim - 1)))
  return jnp.take_along_axis(x_BT, index, axis=1)[:, 0]


def accept(logits_BJV, ids_BJ, new_lens_B, keys_B, counters_B, temps_B, top_ps_B,
           top_ks_B=None, min_ps_B=None):
  """``(accepted_B, tokens_BJ)``: how many of the drafts ``ids_BJ[:, 1:new_lens_B]`` each
  row keeps (see the module docstring; ``logits_BJV[:, j]`` are the main model's after
  ``ids_BJ[:, j]``), and its new tokens: the kept drafts, then the next token (repeated past
  it). A row with ``new_lens_B`` 1 samples one token; ``keys_B`` and ``counters_B`` (its
  tokens so far) key its draws; ``top_ks_B`` and ``min_ps_B`` cut its distribution as
  ``sampling.row_logits`` does."""
  b, j, v = logits_BJV.shape
  k = j - 1
  if k == 0:  # plain decoding
    return jnp.zeros((b,), jnp.int32), sample_rows(logits_BJV[:, 0], keys_B, counters_B,
                                                    temps_B, top_ps_B, top_ks_B,
                                                    min_ps_B)[:, None]
  drafts_BK = ids_BJ[:, 1:]
  offered_BK = jnp.arange(k, dtype=jnp.int32) < (new_lens_B - 1)[:, None]
  each_j_times = jnp.repeat(jnp.arange(b), j)
  repeat = lambda x_B: x_B[each_j_times]  # (index: key arrays too)
  cut = lambda x_B: None if x_B is None else repeat(x_B)
  p_BJV = jax.nn.softmax(row_logits(logits_BJV.reshape(b * j, v), repeat(temps_B),
                                    repeat(top_ps_B), cut(top_ks_B), cut(min_ps_B)),
                         axis=-1).reshape(b, j, v)
  keys_BJ = row_keys(repeat(keys_B), (counters_B[:, None] + jnp.arange(j)).reshape(-1))
  u_BK = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(
      keys_BJ).reshape(b, j)[:, :k]
  pick_BK = jnp.take_along_axis(p_BJV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
  greedy_BK = jnp.argmax(logits_BJV[:, :k], axis=-1) == drafts_BK
  keep_BK = jnp.where((temps_B == 0)[:, None], greedy_BK, u_BK < pick_BK) & offered_BK
  accepted_B = jnp.cumprod(keep_BK, axis=1).sum(axis=1).astype(jnp.int32)
  plain_B = sample_rows(row(logits_BJV, accepted_B), keys_B, counters_B + accepted_B,
                        temps_B, top_ps_B, top_ks_B, min_ps_B)
  padded_BJ = jnp.concatenate([drafts_BK, jnp.zeros((b, 1), jnp.int32)], axis=1)
  rejected_BV = residual(row(p_BJV, accepted_B),
                         jax.nn.one_hot(row(padded_BJ, accepted_B), v, dtype=p_BJV.dtype))
  replace_keys_B = jax.vmap(lambda key: jax.random.fold_in(key, 2))(
      row(keys_BJ.reshape(b, j), accepted_B))
  replaced_B = jax.vmap(jax.random.categorical)(replace_keys_B, jnp.log(rejected_BV))
  rejected_B = (temps_B > 0) & (accepted_B < new_lens_B - 1)
  next_B = jnp.where(rejected_B, replaced_B.astype(jnp.int32), plain_B)
  t_J = jnp.arange(j, dtype=jnp.int32)
  return accepted_B, jnp.where(t_J < accepted_B[:, None], padded_BJ, next_B[:, None])


def draft(model, logits_BV, hidden_BD, buffers, rows_at: Callable, buffers_of: Callable,
          start_B, wanted_B, count: int, plan):
  """``(drafts_BD, buffers)``: ``count`` greedy drafts per sequence (``wanted_B`` of them are
  meant; the rest are never verified), d_1 from the MTP logits ``logits_BV`` and hidden state
  ``hidden_BD`` of its last verified pair, then one MTP step each at MTP row ``start_B + i``,
  written only for the drafts a sequence wants.

  The MTP caches come from ``buffers`` (their arrays, carried through the steps):
  ``rows_at(buffers, rows_B)`` is the tuple of MTP layer caches whose next rows are
  ``rows_B``, ``buffers_of(caches)`` their arrays after a step. The steps of the repeated last
  layer run as one ``lax.scan``, so the compile time does not grow with the drafts.
  """
  last = model.config.num_mtp_layers - 1

  def step(carry, i, layer):
    d_B, hidden_B1D, buffers = carry
    _, hidden_B1D, caches = model.mtp_forward(
        layer, hidden_B1D, d_B[:, None], rows_at(buffers, start_B + i),
        new_lens_B=(i + 1 < wanted_B).astype(jnp.int32), plan=plan, logits=False)
    d_B = jnp.argmax(model.mtp_logits(layer, hidden_B1D[:, 0]), axis=-1).astype(jnp.int32)
    return (d_B, hidden_B1D, buffers_of(caches)), d_B

  carry = (jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), hidden_BD[:, None], buffers)
  drafts = [carry[0][:, None]]
  distinct = min(max(last - 1, 0), count - 1)  # steps before the last layer: layers 1..last-1
  for i in range(distinct):
    carry, d_B = step(carry, i, i + 1)
    drafts.append(d_B[:, None])
  if distinct < count - 1:
    carry, scanned_DB = jax.lax.scan(lambda c, i: step(c, i, last), carry,
                                     jnp.arange(distinct, count - 1))
    drafts.append(scanned_DB.T)
  return jnp.concatenate(drafts, axis=1), carry[2]
