"""Speculative decoding with the MTP layers' drafts: the math of one iteration.

Positions: the main cache holds tokens x_0..x_{n-1} of a sequence; x_n, the last emitted
token, is not in it yet. MTP row p holds the pair (main hidden h_p, token x_{p+1}), so the
MTP cache holds n rows too, and its last one (h_{n-1}, x_n) gave the logits of x_{n+1}: the
first draft's. One iteration:

- Draft: d_1 from those logits; d_2..d_k by further one-token MTP steps that feed back the
  MTP's own output hidden state (draft i > 1 runs layer ``min(i - 1, num_mtp_layers - 1)``:
  past the layers the last one repeats, as vLLM does). These steps write MTP rows n..n+k-2,
  all overwritten below.
- Verify: one main forward of [x_n, d_1..d_k] (k + 1 rows from n, ``return_hidden``).
- Accept: greedy, the longest prefix of drafts equal to the main model's argmax, then the
  main model's token at the first disagreement (or after the last draft); sampling,
  rejection sampling (Leviathan et al. 2023), so the tokens have the main model's
  distribution: d_i stays with probability min(1, p(d_i) / q(d_i)), the first rejected one
  is replaced by a draw from normalize(max(0, p - q)), and after k accepted drafts a bonus
  token is drawn from p (p and q after the same temperature and top-p transform).
- Roll back: the main cache's lengths become n + a + 1 (a accepted drafts; the verify wrote
  k + 1 rows), and the MTP cache's go back to n, from where one MTP step of static width
  k + 1 (a + 1 valid rows) writes the verified pairs (h_n..h_{n+a}, x_{n+1}..x_{n+a+1}); its
  row a gives the next iteration's first draft.

MTP layers past the first: only layer 0 sees the prompt and the verified pairs; a later
layer attends to the rows its own draft steps wrote (as in vLLM, whose proposer prefills only
its first step). This costs acceptance, never correctness: the tokens do not depend on the
drafts' quality.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mla_jax.generation.sampling import SamplingConfig, probabilities, sample

MAX_SPECULATIVE_TOKENS = 8  # drafts per iteration; the verify forward is k + 1 tokens wide


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
  """What one speculative iteration hands the next, per sequence (the caches aside)."""

  tokens_B: jax.Array  # int32: x_n, the last emitted token (not in the main cache yet)
  draft_BV: jax.Array  # float32: the MTP's logits for x_{n+1}, the first draft's
  hidden_BD: jax.Array  # the MTP's output at row n - 1: the second draft step's hidden
  done_B: jax.Array  # bool: emitted an end-of-sequence id or all its tokens
  emitted_B: jax.Array  # int32: tokens emitted so far, the prefill's included
  accepted_B: jax.Array  # int32: draft tokens accepted so far
  drafted_B: jax.Array  # int32: draft tokens proposed so far


def _row(x_BT, index_B):
  """Row ``index_B[b]`` of every sequence: [B, T, ...] -> [B, ...]."""
  index = index_B.reshape(-1, *([1] * (x_BT.ndim - 1)))
  return jnp.take_along_axis(x_BT, index, axis=1)[:, 0]


def _mtp_step(model, index, hidden_BTD, next_ids_BT, mtp_caches, lengths_B, new_lens_B, plan):
  """``mtp_forward`` of layer ``index`` writing from row ``lengths_B`` (its cache rolled
  there first)."""
  rolled = dataclasses.replace(mtp_caches[index], lengths_B=lengths_B)
  mtp_caches = mtp_caches[:index] + (rolled,) + mtp_caches[index + 1:]
  return model.mtp_forward(index, hidden_BTD, next_ids_BT, mtp_caches, new_lens_B=new_lens_B,
                           plan=plan)


def prefill(model, caches, mtp_caches, ids_BT, lens_B, key, *, plan, sampling: SamplingConfig):
  """The main prefill samples x_P; MTP layer 0 then runs over the prompt's pairs (h_j,
  x_{j+1}), j < P (the last with x_P). Returns ``(tokens_B, caches, mtp_caches, draft_BV,
  hidden_BD)``: the first new token, and the first draft's logits and hidden state."""
  logits_BTV, caches, hidden_BTD = model(ids_BT, caches, new_lens_B=lens_B, plan=plan,
                                         return_hidden=True)
  last_B = lens_B - 1
  tokens_B = sample(_row(logits_BTV, last_B), key, sampling)
  t_T = jnp.arange(ids_BT.shape[1], dtype=jnp.int32)
  next_BT = jnp.where(t_T == last_B[:, None], tokens_B[:, None], jnp.roll(ids_BT, -1, axis=1))
  draft_BTV, mtp_BTD, mtp_caches = model.mtp_forward(0, hidden_BTD, next_BT, mtp_caches,
                                                     new_lens_B=lens_B, plan=plan)
  return tokens_B, caches, mtp_caches, _row(draft_BTV, last_B), _row(mtp_BTD, last_B)


def accept_greedy(verify_BKV, drafts_BK):
  """``(accepted_B, next_B)``: the longest prefix of drafts equal to the main argmax, and
  the main argmax after it."""
  best_BK = jnp.argmax(verify_BKV, axis=-1).astype(jnp.int32)
  accepted_B = jnp.cumprod(best_BK[:, :-1] == drafts_BK, axis=1).sum(axis=1)
  return accepted_B.astype(jnp.int32), _row(best_BK, accepted_B)


def residual(p_BV, q_BV):
  """Where a rejected draft's replacement is drawn: max(0, p - q) (unnormalized); p itself
  where that is all zero (p == q up to rounding, when a rejection is all but impossible)."""
  r_BV = jnp.maximum(p_BV - q_BV, 0.0)
  return jnp.where(r_BV.sum(-1, keepdims=True) > 0, r_BV, p_BV)


def accept_sampled(verify_BKV, draft_BKV, drafts_BK, key, sampling: SamplingConfig):
  """Rejection sampling: ``(accepted_B, next_B)`` with draft i kept while u_i q(d_i) <
  p(d_i), and the next token drawn from ``residual`` at the first rejection (q = 0 after
  the last draft, so the bonus is drawn from p)."""
  p_BKV = probabilities(verify_BKV, sampling)
  q_BKV = probabilities(draft_BKV, sampling)
  pick = lambda x_BKV: jnp.take_along_axis(x_BKV, drafts_BK[..., None], axis=-1)[..., 0]
  key_u, key_r = jax.random.split(key)
  u_BK = jax.random.uniform(key_u, drafts_BK.shape)
  accepted_B = jnp.cumprod(u_BK * pick(q_BKV) < pick(p_BKV[:, :-1]), axis=1).sum(axis=1)
  q_BKV = jnp.concatenate([q_BKV, jnp.zeros_like(q_BKV[:, :1])], axis=1)
  r_BV = residual(_row(p_BKV, accepted_B), _row(q_BKV, accepted_B))
  next_B = jax.random.categorical(key_r, jnp.log(r_BV), axis=-1)
  return accepted_B.astype(jnp.int32), next_B.astype(jnp.int32)


def _draft(model, state: DraftState, mtp_caches, n_B, live_B, keys_K, *, plan,
           sampling: SamplingConfig):
  """``(drafts_BK, logits_BKV, mtp_caches)``: d_1 from ``state.draft_BV``, then d_{i+2}
  from the pair (the previous MTP output, d_{i+1}) at MTP row n + i, by layer ``min(i + 1,
  num_mtp_layers - 1)``. The steps of the repeated last layer run as one ``lax.scan`` (so
  the compile time does not grow with k); the logits are None when greedy."""
  k, last = keys_K.shape[0], model.config.num_mtp_layers - 1
  keep_logits = sampling.temperature > 0

  def step(carry, xs, layer):
    d_B, hidden_B1D, mtp_caches = carry
    i, step_key = xs
    # A finished sequence stays at n (writing nothing), so its lengths never pass the cache.
    logits_B1V, hidden_B1D, mtp_caches = _mtp_step(model, layer, hidden_B1D, d_B[:, None],
                                                   mtp_caches, n_B + live_B * i, live_B, plan)
    d_B = sample(logits_B1V[:, 0], step_key, sampling)
    return (d_B, hidden_B1D, mtp_caches), (d_B, logits_B1V[:, 0] if keep_logits else None)

  carry = (sample(state.draft_BV, keys_K[0], sampling), state.hidden_BD[:, None], mtp_caches)
  outs = [(carry[0][None], state.draft_BV[None] if keep_logits else None)]
  distinct = min(max(last - 1, 0), k - 1)  # steps before the last layer: layers 1..last-1
  for i in range(distinct):
    carry, (d_B, logits_BV) = step(carry, (i, keys_K[i + 1]), i + 1)
    outs.append((d_B[None], None if logits_BV is None else logits_BV[None]))
  if distinct < k - 1:
    carry, scanned = jax.lax.scan(lambda c, xs: step(c, xs, last), carry,
                                  (jnp.arange(distinct, k - 1), keys_K[distinct + 1:]))
    outs.append(scanned)
  drafts_KB, logits_KBV = (None if parts[0] is None else jnp.concatenate(parts)
                           for parts in zip(*outs))
  return (drafts_KB.T, None if logits_KBV is None else logits_KBV.swapaxes(0, 1),
          carry[2])


def iteration(model, caches, mtp_caches, state: DraftState, key, max_new, *, verify_plan,
              draft_plan, sampling: SamplingConfig, eos_id):
  """One draft-verify-accept-rollback iteration for every unfinished sequence (the others
  write nothing). Returns the caches, the next ``DraftState`` and the emitted tokens [B, k+1]
  (-1 past each sequence's accepted ones, its end-of-sequence id or its last token)."""
  k = verify_plan.num_new_tokens - 1
  active_B = ~state.done_B
  live_B = active_B.astype(jnp.int32)
  n_B = caches.lengths_B
  keys = jax.random.split(key, k + 1)
  drafts_BK, draft_BKV, mtp_caches = _draft(model, state, mtp_caches, n_B, live_B, keys[:k],
                                            plan=draft_plan, sampling=sampling)
  ids_BK = jnp.concatenate([state.tokens_B[:, None], drafts_BK], axis=1)
  verify_BKV, caches, hidden_BKD = model(ids_BK, caches, new_lens_B=live_B * (k + 1),
                                         plan=verify_plan, return_hidden=True)
  if sampling.temperature == 0:
    accepted_B, next_B = accept_greedy(verify_BKV, drafts_BK)
  else:
    accepted_B, next_B = accept_sampled(verify_BKV, draft_BKV, drafts_BK, keys[k], sampling)
  # x_{n+1}..x_{n+a+1}: the accepted drafts, then the next token (repeated past it, ids only)
  t_K = jnp.arange(k + 1, dtype=jnp.int32)
  a_B1 = accepted_B[:, None]
  tokens_BK = jnp.where(t_K < a_B1, jnp.concatenate([drafts_BK, next_B[:, None]], axis=1),
                        next_B[:, None])
  keep_BK = active_B[:, None] & (t_K <= a_B1) & (state.emitted_B[:, None] + t_K < max_new)
  if eos_id is not None:
    eos_BK = keep_BK & jnp.isin(tokens_BK, jnp.asarray(eos_id, jnp.int32))
    keep_BK = keep_BK & (jnp.cumsum(eos_BK, axis=1) - eos_BK == 0)  # drop what follows eos
    ended_B = eos_BK.any(axis=1)
  else:
    ended_B = jnp.zeros_like(active_B)
  emitted_B = state.emitted_B + keep_BK.sum(axis=1, dtype=jnp.int32)
  caches = caches.with_lengths(n_B + live_B * (accepted_B + 1))
  draft_BKV, mtp_BKD, mtp_caches = _mtp_step(model, 0, hidden_BKD, tokens_BK, mtp_caches, n_B,
                                             live_B * (accepted_B + 1), verify_plan)
  state = DraftState(
      tokens_B=jnp.where(active_B, next_B, state.tokens_B),
      draft_BV=_row(draft_BKV, accepted_B), hidden_BD=_row(mtp_BKD, accepted_B),
      done_B=state.done_B | (active_B & (ended_B | (emitted_B >= max_new))),
      emitted_B=emitted_B, accepted_B=state.accepted_B + live_B * accepted_B,
      drafted_B=state.drafted_B + live_B * k)
  return caches, mtp_caches, state, jnp.where(keep_BK, tokens_BK, -1)
