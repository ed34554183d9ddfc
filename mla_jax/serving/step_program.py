"""The function an engine step program runs: the model over the page pools on one flat batch
of tokens, then each sequence's new tokens; with MTP layers (a speculative engine) also their
caches and the next drafts. A multi-step decode program runs several decode steps of that
function in one dispatch, as a fixed-length ``lax.scan``: no loop or branch in a step program
waits on a value of the device (XLA:GPU would copy such a predicate to the host and block on
it, every iteration).

The step's tokens lie end to end, one per row (``step_inputs``): each row is a sequence of
one token for the layers, at its own position and with its sequence's block table, and the
rows of one sequence share a segment id. Every route but the dense one is per token already
(the indexer scores a row's query against its sequence's keys in the key blocks the host laid
out, sparse MQA gathers its top-k rows); the dense route, in a program whose sequences all
start empty, attends within segments over the step's rows (``StepPlan.segmented``). Rows are
written before any is read, so a prefill chunk's later tokens see its earlier ones.

A decode row whose token was still being computed when the host built the step carries -1;
the program takes that token from ``last_tokens`` (one per persistent slot, carried from step
to step on the device), and writes there each sequence's newest token.

A sequence samples from up to J of its rows' logits (``logit_rows_SJ``): a chunk reaching its
last token samples one token after it; a decode with drafts holds its last token and the drafts
to verify, the longest acceptable prefix of drafts is kept and one token follows it, so it
emits ``accepted + 1`` tokens (``decoding.logits.process_logits``; the acceptance, the
drafting and the draft count are ``generate``'s own). Only those rows go through the
vocabulary projection. A sequence's draws are keyed by its seed and token index alone.

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
from mla_jax.decoding.logits import (Adjustments, Sampler, Sampling, allowed_rows, bias_rows,
                                     process_logits, stop_mask)
from mla_jax.decoding.protocol import FlatRows
from mla_jax.decoding.sampling import seed_keys
from mla_jax.decoding.speculative import draft, drafts_wanted, row
from mla_jax.decoding.steps import Progress, decode_steps
from mla_jax.indexer import KeyBlocks
from mla_jax.serving.sequence import MAX_LOGPROBS
from mla_jax.serving.step_inputs import Layout, StepInputs


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """What a step program is built from (static).

  ``layout``: the step's shape and where its inputs and outputs lie in the packed arrays.
  ``plan``: the flat step's ``StepPlan`` (``plan_flat_step``: the main model's and the MTP
  layers' pairs'); ``draft_plan``: a one-token step per sequence for the further drafts
  (None without drafting). ``mtp``: run the MTP layers. ``context``: the ranks of a mesh's
  ``context`` axis the pools' rows are split over (``PagedLayerCache.context``).
  """

  layout: Layout
  plan: object  # the model's flat step plan (the decode protocol's ``flat_step_plan``)
  draft_plan: object | None
  page_size: int
  context: int = 1

  @property
  def shape(self):
    return self.layout.shape

  def build(self, graphdef, state_def, pool_shardings=None):
    """``step(state_leaves, pools, last_tokens, ints, floats) -> (outputs, pools,
    last_tokens)``: ``ints`` / ``floats`` the packed ``StepInputs``, ``outputs`` the packed
    outputs (``Layout.output_fields``). ``pool_shardings``: where the pools live on the mesh,
    kept for the pools the step returns (None: no mesh)."""
    keep = lambda pools: (pools if pool_shardings is None
                          else jax.lax.with_sharding_constraint(pools, pool_shardings))
    run = self._decode_steps if self.shape.decode_steps > 1 else self._one_step

    def step(state_leaves, pools, last_tokens, ints, floats):
      model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
      x = self.layout.unpack(ints, floats)
      # Placeholders: the tokens the step before computed, kept on the device.
      ids_T = jnp.where(x.ids_T < 0, last_tokens[x.slot_S[x.seq_T]], x.ids_T)
      outputs, pools, last_tokens = run(model, pools, last_tokens, ids_T, x)
      return self.layout.pack_outputs(outputs), keep(pools), last_tokens

    return step

  def _key_blocks(self, x: StepInputs):
    """The indexer's (row, key chunk) pairs, laid out from the rows' reaches."""
    if x.reach_T is None:
      return None
    return KeyBlocks.for_reaches(x.reach_T, self.plan.key_chunk, self.shape.key_blocks)

  def _forward(self, model, pools, ids_T, pos_T, real_T, x: StepInputs, blocks,
               state_src_S=None):
    """The main model on the flat rows (its paged caches: the decode protocol's
    ``paged_cache``; ``state_src_S``: where each sequence's state is read, by default
    ``x``'s): hidden states [T, ...] and the pools (the rows' token ids recorded too)."""
    main_pools, mtp_pools, token_ids = pools
    token_ids = penalties.record_ids(token_ids, ids_T, x.table_SN[x.seq_T], pos_T, real_T,
                                     self.page_size)
    rows = FlatRows(x.seq_T, pos_T, x.table_SN, x.slot_S, self.page_size, blocks,
                    x.state_src_S if state_src_S is None else state_src_S, x.snapshot_S,
                    x.snapshot_at_S, context=self.context)
    hidden_T1X, caches = model.forward_hidden(ids_T[:, None], model.paged_cache(main_pools, rows),
                                              new_lens_B=real_T, plan=self.plan)
    return hidden_T1X[:, 0], (caches.pools, mtp_pools, token_ids)

  def _sampling(self, x: StepInputs, counters_S):
    return Sampling(seed_keys(x.seeds_S), counters_S, x.temperature_S, x.top_p_S, x.top_k_S,
                    x.min_p_S)

  def _adjustments(self, x: StepInputs, token_ids, last_S, vocab: int):
    """A ``FULL`` program's: the bias, the penalties' counts (from the pool of token ids, up
    to each sequence's sampled row), the stop ids ``min_tokens`` holds back and, masked, the
    tokens each sequence's constraint allows."""
    counts_SV, seen_SV = penalties.context_counts(token_ids, x.table_SN, last_S, x.num_prompt_S,
                                                  self.page_size, vocab)
    return Adjustments(bias_rows(x.bias_ids_SB, x.bias_SB, vocab), counts_SV, seen_SV,
                       x.repetition_S, x.frequency_S, x.presence_S,
                       stop_mask(x.stop_ids_SM, vocab), x.min_left_S,
                       None if x.allowed_SW is None else allowed_rows(x.allowed_SW, vocab))

  def _one_step(self, model, pools, last_tokens, ids_T, x: StepInputs):
    blocks = self._key_blocks(x)
    hidden_TD, pools = self._forward(model, pools, ids_T, x.pos_T, x.real_T, x, blocks)
    logits_SJV = model.logits(hidden_TD[x.logit_rows_SJ])
    sampler = self.shape.sampler
    adjustments = None
    if sampler is Sampler.FULL:
      adjustments = self._adjustments(x, pools[2], x.pos_T[x.logit_rows_SJ[:, 0]],
                                      model.vocab_size)
    accepted_S, tokens_SJ = process_logits(logits_SJV, ids_T[x.logit_rows_SJ], x.num_logits_S,
                                           self._sampling(x, x.counters_S), sampler,
                                           adjustments)
    outputs = {"tokens": tokens_SJ, "accepted": accepted_S}
    if sampler is Sampler.FULL:
      outputs.update(_logprobs(logits_SJV, tokens_SJ))
    if self.layout.mtp:
      pools, drafts = self._mtp(model, pools, hidden_TD, accepted_S, tokens_SJ, x, blocks)
      outputs.update(drafts)
    if self.shape.scores:
      outputs.update(_row_scores(model.logits(hidden_TD), x.next_ids_T))
    sampled_S = x.num_logits_S > 0
    newest_S = row(tokens_SJ, accepted_S)
    last_tokens = _set_slots(last_tokens, x.slot_S, sampled_S, newest_S)
    return outputs, pools, last_tokens

  def _mtp(self, model, pools, hidden_TD, accepted_S, tokens_SJ, x: StepInputs, blocks):
    """MTP layer 0 over every row's pair, then each sampling sequence's next drafts."""
    main_pools, mtp_pools, token_ids = pools
    # Row t's pair: (h_t, the token after it): known on the host, or sampled here.
    sampled_T = tokens_SJ[x.seq_T, jnp.maximum(x.logit_row_T, 0)]
    pairs_T = jnp.where(x.next_ids_T < 0, sampled_T, x.next_ids_T)
    valid_T = x.real_T * ((x.logit_row_T < 0) | (x.logit_row_T <= accepted_S[x.seq_T]))
    views = model.mtp_paged_caches(mtp_pools, x.table_SN[x.seq_T], x.pos_T,
                                   page_size=self.page_size, context=self.context,
                                   segment_ids_B=x.seq_T, key_blocks=blocks)
    _, mtp_hidden_T1D, views = model.mtp_forward(
        0, hidden_TD[:, None], pairs_T[:, None], views, new_lens_B=valid_T, plan=self.plan,
        logits=False)
    mtp_pools = model.mtp_pools_of(views)
    outputs = {}
    if self.draft_plan is not None:
      emitted_S = accepted_S + 1
      last_S = row(x.logit_rows_SJ, accepted_S)
      wanted_S = (x.num_logits_S > 0) * drafts_wanted(x.speculative_S, x.remaining_S - emitted_S)
      last_hidden_SD = mtp_hidden_T1D[last_S, 0]
      table_SN, page_size, context = x.table_SN, self.page_size, self.context
      drafts_SD, mtp_pools = draft(
          model, model.mtp_logits(0, last_hidden_SD), last_hidden_SD, mtp_pools,
          lambda pools, rows_S: model.mtp_paged_caches(pools, table_SN, rows_S,
                                                       page_size=page_size, context=context),
          model.mtp_pools_of, x.pos_T[last_S] + 1, wanted_S, self.layout.logit_rows - 1,
          self.draft_plan)
      outputs = {"drafts": drafts_SD, "wanted": wanted_S}
    return (main_pools, mtp_pools, token_ids), outputs

  def _decode_steps(self, model, pools, last_tokens, ids_T, x: StepInputs):
    """N decode steps of every real row (row s: sequence s's last token), each sampling one
    token, through the one device decode loop (``decoding.steps``): a sequence that stopped
    (a stop id or its last allowed token) writes and emits nothing more (-1)."""
    sampler = self.shape.sampler
    no_drafts_S = jnp.ones_like(x.num_logits_S)
    blocks = self._key_blocks(x)  # reaching the last step: past a row's end, windows end

    def one_step(carry, progress, i):
      pools, ids_S = carry
      # A sequence's state: where the first step reads it (a prefix hit's snapshot), then its own.
      src_S = None if x.state_src_S is None else jnp.where(i == 0, x.state_src_S, x.slot_S)
      hidden_SD, pools = self._forward(model, pools, ids_S, x.pos_T + i,
                                       progress.active_B.astype(jnp.int32), x, blocks, src_S)
      _, new_S1 = process_logits(model.logits(hidden_SD)[:, None], ids_S[:, None], no_drafts_S,
                                 self._sampling(x, x.counters_S + i), sampler)
      return (pools, jnp.where(progress.active_B, new_S1[:, 0], ids_S)), new_S1, no_drafts_S, None

    start = Progress.start(x.real_T * (x.remaining_S > 0) > 0, 0)
    (pools, ids_S), _, tokens_NS1, _ = decode_steps(
        one_step, (pools, ids_T), start, self.shape.decode_steps, stop_ids=x.stop_ids_SM,
        max_tokens=x.remaining_S)
    last_tokens = _set_slots(last_tokens, x.slot_S, start.active_B, ids_S)
    return {"tokens": tokens_NS1[..., 0]}, pools, last_tokens


def _set_slots(last_tokens, slot_S, which_S, tokens_S):
  """``last_tokens`` with ``tokens_S`` at the slots of the sequences ``which_S``."""
  slots_S = jnp.where(which_S, slot_S, last_tokens.shape[0])  # out of range: dropped
  return last_tokens.at[slots_S].set(tokens_S, mode="drop")


def _logprobs(logits_SJV, tokens_SJ):
  """Log-probabilities of the model's distribution (before bias, penalties, temperature and
  the cuts): the tokens' [S, J] and the most likely ones' ids and values [S, J, K]."""
  logprobs_SJV = jax.nn.log_softmax(logits_SJV.astype(jnp.float32), axis=-1)
  chosen_SJ = jnp.take_along_axis(logprobs_SJV, tokens_SJ[..., None], axis=-1)[..., 0]
  top_SJK, top_ids_SJK = jax.lax.top_k(logprobs_SJV, min(MAX_LOGPROBS, logprobs_SJV.shape[-1]))
  return {"logprob": chosen_SJ, "top_ids": _pad_k(top_ids_SJK, -1),
          "top": _pad_k(top_SJK, -jnp.inf)}


def _row_scores(logits_TV, next_ids_T):
  """Each row's log-probability of the token after it (-1: none; row ignored), that token's
  rank (1 + the tokens more likely) and the most likely ones' ids and log-probabilities."""
  logprobs_TV = jax.nn.log_softmax(logits_TV.astype(jnp.float32), axis=-1)
  chosen_T = jnp.take_along_axis(logprobs_TV, jnp.maximum(next_ids_T, 0)[:, None], axis=-1)
  rank_T = 1 + (logprobs_TV > chosen_T).sum(axis=-1, dtype=jnp.int32)
  top_TK, top_ids_TK = jax.lax.top_k(logprobs_TV, min(MAX_LOGPROBS, logprobs_TV.shape[-1]))
  return {"row_logprob": chosen_T[:, 0], "row_rank": rank_T,
          "row_top_ids": _pad_k(top_ids_TK, -1), "row_top": _pad_k(top_TK, -jnp.inf)}


def _pad_k(x_XK, fill):
  """The top entries padded to ``MAX_LOGPROBS`` (a vocabulary may be smaller)."""
  pad = MAX_LOGPROBS - x_XK.shape[-1]
  return jnp.pad(x_XK, [(0, 0)] * (x_XK.ndim - 1) + [(0, pad)], constant_values=fill)
