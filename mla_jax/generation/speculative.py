"""Speculative decoding in ``generate``: the positions, and one iteration built from the
shared drafting and acceptance (``mla_jax.decoding.speculative``, the engine's too).

Positions: the main cache holds tokens x_0..x_{n-1} of a sequence; x_n, the last emitted
token, is not in it yet. MTP row p holds the pair (main hidden h_p, token x_{p+1}), so the
MTP cache holds n rows too, and its last one (h_{n-1}, x_n) gave the logits of x_{n+1}: the
first draft's. One iteration:

- Draft: ``draft`` makes d_1 from those logits and d_2..d_k by further one-token MTP steps,
  each a greedy argmax; a sequence means ``min(k, tokens left - 1)`` of them
  (``drafts_wanted``), and their steps write MTP rows from n, all overwritten below.
- Verify: one main forward of [x_n, d_1..d_k] (k + 1 rows from n, ``return_hidden``).
- Accept: ``accept``: greedy, the longest prefix of drafts equal to the main model's argmax,
  then the argmax; sampling, rejection sampling against the greedy drafts, so the tokens have
  the main model's distribution. Row b's draws are keyed by ``fold_in(iteration key, b)``.
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

from mla_jax.decoding.sampling import SamplingConfig, sample
from mla_jax.decoding.speculative import accept, draft, drafts_wanted, row
from mla_jax.decoding.steps import Progress


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
  """What one speculative iteration hands the next, per sequence (the caches and the decode
  loop's ``Progress`` aside)."""

  tokens_B: jax.Array  # int32: x_n, the last emitted token (not in the main cache yet)
  draft_BV: jax.Array  # float32: the MTP's logits for x_{n+1}, the first draft's
  hidden_BD: jax.Array  # the MTP's output at row n - 1: the second draft step's hidden
  accepted_B: jax.Array  # int32: draft tokens accepted so far
  drafted_B: jax.Array  # int32: draft tokens proposed so far


def _mtp_step(model, index, hidden_BTD, next_ids_BT, mtp_caches, num_cached_B, new_lens_B, plan):
  """``mtp_forward`` of layer ``index`` writing from row ``num_cached_B`` (its cache rolled
  there first)."""
  rolled = dataclasses.replace(mtp_caches[index], num_cached_B=num_cached_B)
  mtp_caches = mtp_caches[:index] + (rolled,) + mtp_caches[index + 1:]
  return model.mtp_forward(index, hidden_BTD, next_ids_BT, mtp_caches, new_lens_B=new_lens_B,
                           plan=plan)


def prefill(model, caches, mtp_caches, ids_BT, lens_B, seed, *, plan, sampling: SamplingConfig):
  """The main prefill samples x_P; MTP layer 0 then runs over the prompt's pairs (h_j,
  x_{j+1}), j < P (the last with x_P). Returns ``(tokens_B, caches, mtp_caches, draft_BV,
  hidden_BD)``: the first new token, and the first draft's logits and hidden state."""
  logits_BTV, caches, hidden_BTD = model(ids_BT, caches, new_lens_B=lens_B, plan=plan,
                                         return_hidden=True)
  last_B = lens_B - 1
  tokens_B = sample(row(logits_BTV, last_B), seed, 0, sampling)
  t_T = jnp.arange(ids_BT.shape[1], dtype=jnp.int32)
  next_BT = jnp.where(t_T == last_B[:, None], tokens_B[:, None], jnp.roll(ids_BT, -1, axis=1))
  draft_BTV, mtp_BTD, mtp_caches = model.mtp_forward(0, hidden_BTD, next_BT, mtp_caches,
                                                     new_lens_B=lens_B, plan=plan)
  return tokens_B, caches, mtp_caches, row(draft_BTV, last_B), row(mtp_BTD, last_B)


def _rows_at(mtp_caches, rows_B):
  """The MTP caches with their next rows at ``rows_B`` (later writes overwrite what lies
  past them)."""
  return tuple(dataclasses.replace(c, num_cached_B=rows_B) for c in mtp_caches)


def iteration(model, caches, mtp_caches, state: DraftState, progress: Progress, key, max_new,
              *, verify_plan, draft_plan, sampling: SamplingConfig):
  """One draft-verify-accept-rollback iteration for every active sequence (the others write
  nothing): the decode loop's step (``decoding.steps``), which keeps the emitted tokens up to
  each sequence's end. Returns the caches, the next ``DraftState``, the iteration's tokens
  [B, k + 1] (the accepted drafts, then the next token) and how many of them are real."""
  k = verify_plan.num_new_tokens - 1
  active_B = progress.active_B
  live_B = active_B.astype(jnp.int32)
  n_B = caches.num_cached_B
  b = n_B.shape[0]
  wanted_B = live_B * drafts_wanted(k, max_new - progress.emitted_B)
  drafts_BK, mtp_caches = draft(model, state.draft_BV, state.hidden_BD, mtp_caches, _rows_at,
                                lambda caches: caches, n_B, wanted_B, k, draft_plan)
  ids_BK = jnp.concatenate([state.tokens_B[:, None], drafts_BK], axis=1)
  verify_BKV, caches, hidden_BKD = model(ids_BK, caches, new_lens_B=live_B * (k + 1),
                                         plan=verify_plan, return_hidden=True)
  keys_B = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b, dtype=jnp.uint32))
  accepted_B, tokens_BK = accept(
      verify_BKV, ids_BK, live_B * (wanted_B + 1), keys_B, jnp.zeros((b,), jnp.int32),
      jnp.full((b,), sampling.temperature, jnp.float32),
      jnp.full((b,), sampling.top_p, jnp.float32))
  # x_{n+1}..x_{n+a+1}: the accepted drafts, then the next token (repeated past it, ids only)
  caches = caches.with_num_cached(n_B + live_B * (accepted_B + 1))
  draft_BKV, mtp_BKD, mtp_caches = _mtp_step(model, 0, hidden_BKD, tokens_BK, mtp_caches, n_B,
                                             live_B * (accepted_B + 1), verify_plan)
  state = DraftState(
      tokens_B=jnp.where(active_B, row(tokens_BK, accepted_B), state.tokens_B),
      draft_BV=row(draft_BKV, accepted_B), hidden_BD=row(mtp_BKD, accepted_B),
      accepted_B=state.accepted_B + live_B * accepted_B,
      drafted_B=state.drafted_B + wanted_B)
  return caches, mtp_caches, state, tokens_BK, live_B * (accepted_B + 1)
