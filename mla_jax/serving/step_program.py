"""The function an engine step program runs: the model over the page pools on one flat batch
of tokens, then each sequence's new tokens; with MTP layers (a speculative engine) also their
caches and the next drafts. A multi-step decode program runs several decode steps of that
function in one dispatch.

The step's tokens lie end to end, one per row (``step_inputs``): each row is a sequence of
one token for the layers, at its own position and with its sequence's block table, and the
rows of one sequence share a segment id. Every route but the dense one is per token already
(the indexer scores a row's query against its sequence's keys, sparse MQA gathers its top-k
rows); the dense route, in a program whose sequences all start empty, attends within
segments over the step's rows (``StepPlan.segmented``). Rows are written before any is read,
so a prefill chunk's later tokens see its earlier ones.

A sequence samples from up to J of its rows' logits (``logit_rows_SJ``): a chunk reaching its
last token samples one token after it; a decode with drafts holds its last token and the drafts
to verify, the longest acceptable prefix of drafts is kept and one token follows it, so it
emits ``accepted + 1`` tokens (``mla_jax.decoding.speculative``: the acceptance, the drafting
and the draft count are ``generate``'s own). Only those rows go through the vocabulary
projection. A sequence's draws are keyed by its seed and token index alone.

MTP row p holds the pair (main hidden state h_p, token p + 1) at the main cache's page ids:
every row of the step writes its pair, from the token after it (known on the host, or the
token the step samples there), except a decode's rows past what its verification accepted, so
the MTP cache is never ahead of what the main cache holds. Then each sequence that sampled
drafts its next tokens (``decoding.speculative.draft``), and returns how many it meant.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.decoding import penalties
from mla_jax.decoding.sampling import sample_rows, seed_keys
from mla_jax.decoding.speculative import accept, draft, drafts_wanted, row
from mla_jax.decoding.stops import ends
from mla_jax.models.lm import ModelCache
from mla_jax.paged_cache import PagedLayerCache
from mla_jax.serving.requests import MAX_LOGPROBS
from mla_jax.step_plan import StepPlan


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """What a step program is built from (static).

  ``plan``: the flat step's ``StepPlan`` (``plan_flat_step``: the main model's and the MTP
  layers' pairs'); ``draft_plan``: a one-token step per sequence for the further drafts
  (None without drafting). ``mtp``: run the MTP layers. ``logit_rows``: J, rows a sequence
  samples from (1 + the most draft tokens). ``decode_steps``: 1 for one step; more for a
  multi-step decode dispatch (row s is sequence s, one token per step; no log-probabilities
  and no penalties: the engine runs one only when no sequence asks for them), ``greedy``
  taking every row's argmax. ``scores``: every row also goes through the vocabulary projection, for the
  log-probability of the token after it (prompt log-probabilities).
  """

  plan: StepPlan
  draft_plan: StepPlan | None
  mtp: bool
  page_size: int
  logit_rows: int
  decode_steps: int = 1
  greedy: bool = False
  scores: bool = False
  context: int = 1

  def build(self, graphdef, state_def, layout, pool_shardings=None):
    """``step(state_leaves, pools, *StepInputs arrays) -> (outputs, pools)``.

    One step's outputs: new tokens [S, J] (the first ``accepted + 1`` of a sequence are its),
    accepted drafts [S], the tokens' log-probabilities [S, J] and the most likely ones' ids
    and log-probabilities [S, J, K], next drafts [S, D] and how many of them are meant [S]
    (``drafts_wanted``); a scoring step's then also, per row t, the log-probability of the
    token after it (``next_ids_T``), its rank, and the most likely ones' ids and
    log-probabilities [T, K]. A multi-step dispatch's: new tokens [N, S] (-1 once a sequence
    stopped).

    ``context``: the ranks of a mesh's ``context`` axis the pools' rows are split over
    (``PagedLayerCache.context``); ``pool_shardings``: where the pools live on the mesh, kept
    for the pools the step returns (None: no mesh)."""
    page_size, context = self.page_size, self.context
    keep = lambda pools: (pools if pool_shardings is None
                          else jax.lax.with_sharding_constraint(pools, pool_shardings))

    def forward(model, pools, ids_T, seq_T, pos_T, real_T, table_SN):
      """The main model on the flat rows: hidden states [T, D] and the pools (the rows' token
      ids recorded too)."""
      main_pools, mtp_pools, token_ids = pools
      table_TN = table_SN[seq_T]
      token_ids = penalties.record_ids(token_ids, ids_T, table_TN, pos_T, real_T, page_size)
      caches = ModelCache(tuple(
          tuple(PagedLayerCache(latent, keys, table_TN,
                                jnp.broadcast_to(pos_T, (group.reps, *pos_T.shape)), page_size,
                                seq_T, reps=group.reps, context=context)
                for latent, keys in unit)
          for group, unit in zip(layout, main_pools)), layout)
      hidden_T1D, caches = model.forward_hidden(ids_T[:, None], caches, new_lens_B=real_T,
                                                plan=self.plan)
      main_pools = tuple(tuple(c.pools for c in unit) for unit in caches.groups)
      return hidden_T1D[:, 0], (main_pools, mtp_pools, token_ids)

    def step(state_leaves, pools, ids_T, seq_T, pos_T, real_T, next_ids_T, logit_row_T,
             table_SN, seeds_S, counters_S, temps_S, top_ps_S, top_ks_S, min_ps_S,
             logit_rows_SJ, num_logits_S, speculative_S, remaining_S, min_left_S, stop_ids_SM,
             bias_ids_SB, bias_SB, repetition_S, frequency_S, presence_S, num_prompt_S):
      model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
      hidden_TD, pools = forward(model, pools, ids_T, seq_T, pos_T, real_T, table_SN)
      logits_SJV = model.logits(hidden_TD[logit_rows_SJ])
      vocab = model.config.vocab_size
      stop_SV = _stop_mask(stop_ids_SM, vocab)
      biased_SJV = logits_SJV + _bias(bias_ids_SB, bias_SB, vocab)[:, None, :]
      biased_SJV = penalties.penalize_rows(biased_SJV, pools[2], table_SN,
                                           pos_T[logit_rows_SJ[:, 0]], num_prompt_S, page_size,
                                           repetition_S, frequency_S, presence_S)
      accepted_S, tokens_SJ = accept(_no_stop_before_min(biased_SJV, stop_SV, min_left_S),
                                     ids_T[logit_rows_SJ], num_logits_S, seed_keys(seeds_S),
                                     counters_S, temps_S, top_ps_S, top_ks_S, min_ps_S)
      drafts_SD = jnp.zeros((seeds_S.shape[0], 0), jnp.int32)
      wanted_S = jnp.zeros_like(seeds_S)
      if self.mtp:
        main_pools, mtp_pools, token_ids = pools
        # Row t's pair: (h_t, the token after it): known on the host, or sampled here.
        sampled_T = tokens_SJ[seq_T, jnp.maximum(logit_row_T, 0)]
        pairs_T = jnp.where(next_ids_T < 0, sampled_T, next_ids_T)
        valid_T = real_T * ((logit_row_T < 0) | (logit_row_T <= accepted_S[seq_T]))
        views = _mtp_views(mtp_pools, table_SN[seq_T], pos_T, page_size, context, seq_T)
        _, mtp_hidden_T1D, views = model.mtp_forward(
            0, hidden_TD[:, None], pairs_T[:, None], views, new_lens_B=valid_T,
            plan=self.plan, logits=False)
        mtp_pools = tuple(v.buffers.pools for v in views)
        if self.draft_plan is not None:
          emitted_S = accepted_S + 1
          last_S = row(logit_rows_SJ, accepted_S)
          wanted_S = (num_logits_S > 0) * drafts_wanted(speculative_S, remaining_S - emitted_S)
          last_hidden_SD = mtp_hidden_T1D[last_S, 0]
          drafts_SD, mtp_pools = draft(
              model, model.mtp_logits(0, last_hidden_SD), last_hidden_SD, mtp_pools,
              lambda pools, rows_S: _mtp_views(pools, table_SN, rows_S, page_size, context),
              lambda views: tuple(v.buffers.pools for v in views), pos_T[last_S] + 1,
              wanted_S, self.logit_rows - 1, self.draft_plan)
        pools = (main_pools, mtp_pools, token_ids)
      outputs = (tokens_SJ, accepted_S, *_logprobs(logits_SJV, tokens_SJ), drafts_SD, wanted_S)
      if self.scores:
        outputs += _row_scores(model.logits(hidden_TD), next_ids_T)
      return outputs, keep(pools)

    def decode_steps(state_leaves, pools, ids_T, seq_T, pos_T, real_T, next_ids_T,
                     logit_row_T, table_SN, seeds_S, counters_S, temps_S, top_ps_S, top_ks_S,
                     min_ps_S, logit_rows_SJ, num_logits_S, speculative_S, remaining_S,
                     min_left_S, stop_ids_SM, bias_ids_SB, bias_SB, repetition_S, frequency_S,
                     presence_S, num_prompt_S):
      """Up to N decode steps of every real row (row s: sequence s's last token), each
      sampling one token; a sequence stops at a stop id or its last allowed token, and the
      loop ends early once every sequence has."""
      model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
      n, s = self.decode_steps, ids_T.shape[0]
      vocab = model.config.vocab_size
      stop_SV = _stop_mask(stop_ids_SM, vocab)  # once, not per step
      bias_SV = _bias(bias_ids_SB, bias_SB, vocab)
      keys_S = seed_keys(seeds_S)

      def one_step(carry):
        i, pools, ids_S, active_S, tokens_NS = carry
        hidden_SD, pools = forward(model, pools, ids_S, seq_T, pos_T + i, active_S, table_SN)
        logits_SV = _no_stop_before_min((model.logits(hidden_SD) + bias_SV)[:, None], stop_SV,
                                        min_left_S - i)[:, 0]
        if self.greedy:
          new_S = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
        else:
          new_S = sample_rows(logits_SV, keys_S, counters_S + i, temps_S, top_ps_S, top_ks_S,
                              min_ps_S)
        emit_S = active_S > 0
        stopped_S = emit_S & ends(new_S, stop_ids_SM, i + 1, remaining_S)
        return (i + 1, pools, jnp.where(emit_S, new_S, ids_S), active_S * ~stopped_S,
                tokens_NS.at[i].set(jnp.where(emit_S, new_S, -1)))

      carry = (jnp.int32(0), pools, ids_T, real_T * (remaining_S > 0),
               jnp.full((n, s), -1, jnp.int32))
      carry = jax.lax.while_loop(lambda c: (c[0] < n) & (c[3].sum() > 0), one_step, carry)
      _, pools, _, _, tokens_NS = carry
      return (tokens_NS,), keep(pools)

    return step if self.decode_steps == 1 else decode_steps


def _stop_mask(stop_ids_SM, vocab_size: int):
  """[S, V]: whether each id is one of sequence s's stop ids (-1 pads none)."""
  return jax.nn.one_hot(stop_ids_SM, vocab_size, dtype=jnp.bool_).any(axis=1)


def _bias(bias_ids_SB, bias_SB, vocab_size: int):
  """[S, V]: each sequence's ``logit_bias`` (ids -1 pad: dropped) as a row to add."""
  ids_SB = jnp.where(bias_ids_SB < 0, vocab_size, bias_ids_SB)  # out of range: dropped
  rows_SB = jnp.broadcast_to(jnp.arange(ids_SB.shape[0])[:, None], ids_SB.shape)
  return jnp.zeros((ids_SB.shape[0], vocab_size), jnp.float32).at[rows_SB, ids_SB].add(
      bias_SB, mode="drop")


def _no_stop_before_min(logits_SJV, stop_SV, min_left_S):
  """The logits with a sequence's stop ids (``_stop_mask``) at -inf in its first
  ``min_left_S`` rows: the tokens before its ``min_tokens`` are never stop ids (vLLM's)."""
  early_SJ = jnp.arange(logits_SJV.shape[1])[None, :] < min_left_S[:, None]
  return jnp.where(early_SJ[..., None] & stop_SV[:, None, :], -jnp.inf, logits_SJV)


def _logprobs(logits_SJV, tokens_SJ):
  """Log-probabilities of the model's distribution (before temperature and top_p): the
  tokens' [S, J] and the most likely ones' ids and values [S, J, K] (a top-k over the
  vocabulary is small beside the step)."""
  logprobs_SJV = jax.nn.log_softmax(logits_SJV.astype(jnp.float32), axis=-1)
  chosen_SJ = jnp.take_along_axis(logprobs_SJV, tokens_SJ[..., None], axis=-1)[..., 0]
  top_SJK, top_ids_SJK = jax.lax.top_k(logprobs_SJV, min(MAX_LOGPROBS, logprobs_SJV.shape[-1]))
  return chosen_SJ, top_ids_SJK, top_SJK


def _row_scores(logits_TV, next_ids_T):
  """Each row's log-probability of the token after it (-1: none; row ignored), that token's
  rank (1 + the tokens more likely) and the most likely ones' ids and log-probabilities."""
  logprobs_TV = jax.nn.log_softmax(logits_TV.astype(jnp.float32), axis=-1)
  chosen_T = jnp.take_along_axis(logprobs_TV, jnp.maximum(next_ids_T, 0)[:, None], axis=-1)
  rank_T = 1 + (logprobs_TV > chosen_T).sum(axis=-1, dtype=jnp.int32)
  top_TK, top_ids_TK = jax.lax.top_k(logprobs_TV, min(MAX_LOGPROBS, logprobs_TV.shape[-1]))
  return chosen_T[:, 0], rank_T, top_ids_TK, top_TK


def _mtp_views(mtp_pools, table_BN, num_cached_B, page_size, context, segment_ids_B=None):
  """The MTP layers' paged caches (one layer each) at ``num_cached_B``."""
  return tuple(PagedLayerCache(latent, keys, table_BN, num_cached_B[None], page_size,
                               segment_ids_B, context=context).layer_view(0)
               for latent, keys in mtp_pools)
