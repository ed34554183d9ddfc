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
emits ``accepted + 1`` tokens. Only those rows go through the vocabulary projection.

- Greedy rows accept a draft equal to the main model's argmax; the token after is the argmax.
- Sampled rows draft greedily (the draft distribution q is one-hot on the draft, as vLLM's
  MTP proposer), so rejection sampling (Leviathan et al. 2023) keeps draft d with
  probability p(d) and replaces the first rejected one by a draw from p without d: the
  tokens have the main model's distribution p (after each row's temperature and top-p).
  The randomness of a sequence's output token i comes from ``fold_in(key(seed), i)`` alone
  (the plain sampler's key for the bonus token; folds 1 and 2 for the acceptance test and
  the replacement), so a sequence's tokens never depend on the others.

MTP row p holds the pair (main hidden state h_p, token p + 1) at the main cache's page ids:
every row of the step writes its pair, from the token after it (known on the host, or the
token the step samples there), except a decode's rows past what its verification accepted, so
the MTP cache is never ahead of what the main cache holds. Then each sequence that sampled
drafts its next tokens: d_1 from its last pair's MTP output, then one-token MTP steps (layer
``min(i, num_mtp_layers - 1)``, past the layers the last one repeats). A sequence drafts
``min(speculative_S, remaining - 1)`` tokens, so no MTP write passes its last token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.generation.sampling import row_keys, row_logits, sample_rows
from mla_jax.generation.speculative import residual
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
  multi-step decode dispatch (row s is sequence s, one token per step).
  """

  plan: StepPlan
  draft_plan: StepPlan | None
  mtp: bool
  page_size: int
  logit_rows: int
  decode_steps: int = 1

  def build(self, graphdef, state_def, layout):
    """``step(state_leaves, pools, *StepInputs arrays) -> (outputs, pools)``.

    One step's outputs: new tokens [S, J] (the first ``accepted + 1`` of a sequence are its),
    accepted drafts [S], the tokens' log-probabilities [S, J] and the most likely ones' ids
    and log-probabilities [S, J, K], next drafts [S, D]. A multi-step dispatch's: new tokens
    [N, S] (-1 once a sequence stopped), their log-probabilities [N, S] and the most likely
    ones' [N, S, K]."""
    page_size = self.page_size

    def forward(model, pools, ids_T, seq_T, pos_T, real_T, table_SN):
      """The main model on the flat rows: hidden states [T, D] and the pools."""
      main_pools, mtp_pools = pools
      table_TN = table_SN[seq_T]
      caches = ModelCache(tuple(
          tuple(PagedLayerCache(latent, keys, table_TN,
                                jnp.broadcast_to(pos_T, (group.reps, *pos_T.shape)), page_size,
                                seq_T)
                for latent, keys in unit)
          for group, unit in zip(layout, main_pools)), layout)
      hidden_T1D, caches = model.forward_hidden(ids_T[:, None], caches, new_lens_B=real_T,
                                                plan=self.plan)
      main_pools = tuple(tuple(c.pools for c in unit) for unit in caches.groups)
      return hidden_T1D[:, 0], (main_pools, mtp_pools)

    def step(state_leaves, pools, ids_T, seq_T, pos_T, real_T, next_ids_T, logit_row_T,
             table_SN, seeds_S, counters_S, temps_S, top_ps_S, logit_rows_SJ, num_logits_S,
             speculative_S, remaining_S, stop_ids_SM):
      model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
      hidden_TD, pools = forward(model, pools, ids_T, seq_T, pos_T, real_T, table_SN)
      logits_SJV = model.logits(hidden_TD[logit_rows_SJ])
      accepted_S, tokens_SJ = accept(logits_SJV, ids_T[logit_rows_SJ], num_logits_S, seeds_S,
                                     counters_S, temps_S, top_ps_S)
      drafts_SD = jnp.zeros((seeds_S.shape[0], 0), jnp.int32)
      if self.mtp:
        main_pools, mtp_pools = pools
        # Row t's pair: (h_t, the token after it): known on the host, or sampled here.
        sampled_T = tokens_SJ[seq_T, jnp.maximum(logit_row_T, 0)]
        pairs_T = jnp.where(next_ids_T < 0, sampled_T, next_ids_T)
        valid_T = real_T * ((logit_row_T < 0) | (logit_row_T <= accepted_S[seq_T]))
        views = _mtp_views(mtp_pools, table_SN[seq_T], pos_T, page_size, seq_T)
        _, mtp_hidden_T1D, views = model.mtp_forward(
            0, hidden_TD[:, None], pairs_T[:, None], views, new_lens_B=valid_T,
            plan=self.plan, logits=False)
        mtp_pools = tuple(v.buffers.pools for v in views)
        if self.draft_plan is not None:
          emitted_S = (num_logits_S > 0) * (accepted_S + 1)
          last_S = jnp.take_along_axis(logit_rows_SJ, accepted_S[:, None], axis=1)[:, 0]
          wanted_S = jnp.clip(jnp.minimum(speculative_S, remaining_S - emitted_S - 1), 0)
          wanted_S = jnp.where(num_logits_S > 0, wanted_S, 0)
          last_hidden_SD = mtp_hidden_T1D[last_S, 0]
          drafts_SD, mtp_pools = _draft(
              model, model.mtp_logits(0, last_hidden_SD), last_hidden_SD, mtp_pools, table_SN,
              pos_T[last_S] + 1, wanted_S, self.logit_rows - 1, self.draft_plan, page_size)
        pools = (main_pools, mtp_pools)
      return (tokens_SJ, accepted_S, *_logprobs(logits_SJV, tokens_SJ), drafts_SD), pools

    def decode_steps(state_leaves, pools, ids_T, seq_T, pos_T, real_T, next_ids_T,
                     logit_row_T, table_SN, seeds_S, counters_S, temps_S, top_ps_S,
                     logit_rows_SJ, num_logits_S, speculative_S, remaining_S, stop_ids_SM):
      """Up to N decode steps of every real row (row s: sequence s's last token), each
      sampling one token; a sequence stops at a stop id or its last allowed token, and the
      loop ends early once every sequence has."""
      model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
      n, s = self.decode_steps, ids_T.shape[0]
      k = min(MAX_LOGPROBS, model.config.vocab_size)

      def one_step(carry):
        i, pools, ids_S, active_S, tokens_NS, chosen_NS, top_ids_NSK, top_NSK = carry
        hidden_SD, pools = forward(model, pools, ids_S, seq_T, pos_T + i, active_S, table_SN)
        logits_SV = model.logits(hidden_SD)
        new_S = sample_rows(logits_SV, seeds_S, counters_S + i, temps_S, top_ps_S)
        chosen_S1, top_ids_S1K, top_S1K = _logprobs(logits_SV[:, None], new_S[:, None])
        emit_S = active_S > 0
        stopped_S = emit_S & ((new_S[:, None] == stop_ids_SM).any(axis=1)
                              | (i + 1 >= remaining_S))
        put = lambda buffer, value, fill: buffer.at[i].set(
            jnp.where(emit_S.reshape(-1, *[1] * (value.ndim - 1)), value, fill))
        return (i + 1, pools, jnp.where(emit_S, new_S, ids_S),
                active_S * ~stopped_S, put(tokens_NS, new_S, -1),
                put(chosen_NS, chosen_S1[:, 0], 0.0), put(top_ids_NSK, top_ids_S1K[:, 0], 0),
                put(top_NSK, top_S1K[:, 0], 0.0))

      carry = (jnp.int32(0), pools, ids_T, real_T * (remaining_S > 0),
               jnp.full((n, s), -1, jnp.int32), jnp.zeros((n, s), jnp.float32),
               jnp.zeros((n, s, k), jnp.int32), jnp.zeros((n, s, k), jnp.float32))
      carry = jax.lax.while_loop(lambda c: (c[0] < n) & (c[3].sum() > 0), one_step, carry)
      _, pools, _, _, tokens_NS, chosen_NS, top_ids_NSK, top_NSK = carry
      return (tokens_NS, chosen_NS, top_ids_NSK, top_NSK), pools

    return step if self.decode_steps == 1 else decode_steps


def _logprobs(logits_SJV, tokens_SJ):
  """Log-probabilities of the model's distribution (before temperature and top_p): the
  tokens' [S, J] and the most likely ones' ids and values [S, J, K] (a top-k over the
  vocabulary is small beside the step)."""
  logprobs_SJV = jax.nn.log_softmax(logits_SJV.astype(jnp.float32), axis=-1)
  chosen_SJ = jnp.take_along_axis(logprobs_SJV, tokens_SJ[..., None], axis=-1)[..., 0]
  top_SJK, top_ids_SJK = jax.lax.top_k(logprobs_SJV, min(MAX_LOGPROBS, logprobs_SJV.shape[-1]))
  return chosen_SJ, top_ids_SJK, top_SJK


def _row(x_BT, index_B):
  """Row ``index_B[b]`` of every sequence: [B, T, ...] -> [B, ...]."""
  index = index_B.reshape(-1, *([1] * (x_BT.ndim - 1)))
  return jnp.take_along_axis(x_BT, index, axis=1)[:, 0]


def accept(logits_BJV, ids_BJ, new_lens_B, seeds_B, counters_B, temps_B, top_ps_B):
  """``(accepted_B, tokens_BJ)``: the drafts ``ids_BJ[:, 1:new_lens_B]`` each row keeps (see
  the module docstring) and its new tokens, the kept drafts then the next token (repeated
  past it)."""
  b, j, v = logits_BJV.shape
  k = j - 1
  if k == 0:  # plain decoding
    return jnp.zeros((b,), jnp.int32), sample_rows(logits_BJV[:, 0], seeds_B, counters_B,
                                                    temps_B, top_ps_B)[:, None]
  drafts_BK = ids_BJ[:, 1:]
  offered_BK = jnp.arange(k, dtype=jnp.int32) < (new_lens_B - 1)[:, None]
  repeat = lambda x_B: jnp.repeat(x_B, j)
  p_BJV = jax.nn.softmax(row_logits(logits_BJV.reshape(b * j, v), repeat(temps_B),
                                    repeat(top_ps_B)), axis=-1).reshape(b, j, v)
  keys_BJ = row_keys(repeat(seeds_B), (counters_B[:, None] + jnp.arange(j)).reshape(-1))
  u_BK = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(
      keys_BJ).reshape(b, j)[:, :k]
  pick_BK = jnp.take_along_axis(p_BJV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
  greedy_BK = jnp.argmax(logits_BJV[:, :k], axis=-1) == drafts_BK
  keep_BK = jnp.where((temps_B == 0)[:, None], greedy_BK, u_BK < pick_BK) & offered_BK
  accepted_B = jnp.cumprod(keep_BK, axis=1).sum(axis=1).astype(jnp.int32)
  plain_B = sample_rows(_row(logits_BJV, accepted_B), seeds_B, counters_B + accepted_B,
                        temps_B, top_ps_B)
  padded_BJ = jnp.concatenate([drafts_BK, jnp.zeros((b, 1), jnp.int32)], axis=1)
  rejected_BV = residual(_row(p_BJV, accepted_B),
                         jax.nn.one_hot(_row(padded_BJ, accepted_B), v, dtype=p_BJV.dtype))
  replace_keys_B = jax.vmap(lambda key: jax.random.fold_in(key, 2))(
      _row(keys_BJ.reshape(b, j), accepted_B))
  replaced_B = jax.vmap(jax.random.categorical)(replace_keys_B, jnp.log(rejected_BV))
  rejected_B = (temps_B > 0) & (accepted_B < new_lens_B - 1)
  next_B = jnp.where(rejected_B, replaced_B.astype(jnp.int32), plain_B)
  t_J = jnp.arange(j, dtype=jnp.int32)
  return accepted_B, jnp.where(t_J < accepted_B[:, None], padded_BJ, next_B[:, None])


def _mtp_views(mtp_pools, table_BN, lengths_B, page_size, segment_ids_B=None):
  """The MTP layers' paged caches (one layer each) at ``lengths_B``."""
  return tuple(PagedLayerCache(latent, keys, table_BN, lengths_B[None], page_size,
                               segment_ids_B).layer_view(0)
               for latent, keys in mtp_pools)


def _draft(model, logits_BV, hidden_BD, mtp_pools, table_BN, start_B, wanted_B, count: int,
           plan: StepPlan, page_size: int):
  """``(drafts_BD, mtp_pools)``: ``count`` greedy drafts per sequence, d_1 from
  ``logits_BV``, then one MTP step each on (the previous output, the previous draft) at MTP
  row ``start_B + i`` (written only for the ``wanted_B`` drafts a sequence asks for). The
  steps of the repeated last layer run as one ``lax.scan``, so the compile time does not
  grow with the drafts."""
  last = model.config.num_mtp_layers - 1

  def step(carry, i, layer):
    d_B, hidden_B1D, pools = carry
    views = _mtp_views(pools, table_BN, start_B + i, page_size)
    _, hidden_B1D, views = model.mtp_forward(
        layer, hidden_B1D, d_B[:, None], views,
        new_lens_B=(i + 1 < wanted_B).astype(jnp.int32), plan=plan, logits=False)
    d_B = jnp.argmax(model.mtp_logits(layer, hidden_B1D[:, 0]), axis=-1).astype(jnp.int32)
    return (d_B, hidden_B1D, tuple(v.buffers.pools for v in views)), d_B

  carry = (jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), hidden_BD[:, None], mtp_pools)
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
