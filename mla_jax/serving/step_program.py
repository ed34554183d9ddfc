"""The function an engine step program runs: the model over the page pools, then each row's
new tokens; with MTP layers (a speculative engine) also their caches and the next drafts.

A prefill row samples one token after its chunk. A decode row holds its last token and the
draft tokens to verify (``new_lens_B[b] - 1`` of them, up to ``T - 1``): the main model runs
all of them, the longest acceptable prefix of drafts is kept and one token follows it, so a
row emits ``accepted + 1`` tokens (one without drafts).

- Greedy rows accept a draft equal to the main model's argmax; the token after is the argmax.
- Sampled rows draft greedily (the draft distribution q is one-hot on the draft, as vLLM's
  MTP proposer), so rejection sampling (Leviathan et al. 2023) keeps draft d with
  probability p(d) and replaces the first rejected one by a draw from p without d: the
  tokens have the main model's distribution p (after each row's temperature and top-p).
  The randomness of a row's output token i comes from ``fold_in(key(seed), i)`` alone (the
  plain sampler's key for the bonus token; folds 1 and 2 for the acceptance test and the
  replacement), so a row's tokens never depend on the other rows.

MTP row p holds the pair (main hidden state h_p, token p + 1) at the main cache's page ids: a
prefill writes its chunk's pairs, a decode the pairs of the tokens it accepted (the last with
the token it sampled), from the row's cached length, so the MTP cache is never ahead of what
is verified. It then drafts the row's next tokens: d_1 from the MTP's output at the last
verified pair, d_{i+1} by one-token MTP steps on (its previous output, d_i) written past it
(overwritten by the next step's pairs; past the MTP layers the last one repeats). A row
drafts ``min(speculative_B, remaining - 1)`` tokens, so no MTP write passes its last token.
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
  """What a step program is built from (static): the kind of step, its plans and the model.

  ``plan``: the main model's (and the MTP layers' pairs'); ``draft_plan``: a one-token step
  for the further drafts (None without drafting). ``mtp``: run the MTP layers.
  """

  kind: str
  plan: StepPlan
  draft_plan: StepPlan | None
  mtp: bool
  page_size: int

  def build(self, graphdef, state_def, layout):
    """``step(state_leaves, pools, *StepInputs arrays) -> (outputs, pools)``; outputs: new
    tokens [B, J], accepted drafts [B], the tokens' log-probabilities [B, J] and the most
    likely ones' ids and log-probabilities [B, J, K], next drafts [B, D]."""
    page_size, num_drafts = self.page_size, self.plan.num_new_tokens - 1

    def step(state_leaves, pools, ids_BT, new_lens_B, lengths_B, table_BN, seeds_B,
             counters_B, temps_B, top_ps_B, next_ids_BT, speculative_B, remaining_B):
      model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
      main_pools, mtp_pools = pools
      caches = ModelCache(tuple(
          tuple(PagedLayerCache(latent, keys, table_BN,
                                jnp.broadcast_to(lengths_B, (group.reps, *lengths_B.shape)),
                                page_size)
                for latent, keys in unit)
          for group, unit in zip(layout, main_pools)), layout)
      logits_BTV, caches, hidden_BTD = model(ids_BT, caches, new_lens_B=new_lens_B,
                                             plan=self.plan, return_hidden=True)
      sampling = (seeds_B, counters_B, temps_B, top_ps_B)
      if self.kind == "decode":
        accepted_B, tokens_BJ = accept(logits_BTV, ids_BT, new_lens_B, *sampling)
        logits_BJV = logits_BTV
      else:
        logits_BJV = _row(logits_BTV, jnp.maximum(new_lens_B - 1, 0))[:, None]
        tokens_BJ = sample_rows(logits_BJV[:, 0], *sampling)[:, None]
        accepted_B = jnp.zeros_like(new_lens_B)
      drafts_BD = jnp.zeros((ids_BT.shape[0], 0), jnp.int32)
      if self.mtp:
        views = _mtp_views(mtp_pools, table_BN, lengths_B, page_size)
        if self.kind == "decode":  # the accepted pairs: tokens_BJ follow the verified ids
          pairs_BT, pair_lens_B = tokens_BJ, (new_lens_B > 0) * (accepted_B + 1)
        else:
          pairs_BT = jnp.where(next_ids_BT < 0, tokens_BJ, next_ids_BT)
          pair_lens_B = new_lens_B
        mtp_logits_BTV, mtp_hidden_BTD, views = model.mtp_forward(
            0, hidden_BTD, pairs_BT, views, new_lens_B=pair_lens_B, plan=self.plan)
        if self.kind == "decode" and num_drafts:
          last_B = jnp.maximum(pair_lens_B - 1, 0)
          wanted_B = jnp.clip(jnp.minimum(speculative_B, remaining_B - pair_lens_B - 1), 0)
          drafts_BD, views = _draft(model, _row(mtp_logits_BTV, last_B),
                                    _row(mtp_hidden_BTD, last_B), views, lengths_B + pair_lens_B,
                                    wanted_B, num_drafts, self.draft_plan)
        mtp_pools = tuple(v.buffers.pools for v in views)
      # Log-probabilities of the model's distribution (before temperature and top_p), for
      # every row: a top-k over the vocabulary is small beside the step.
      logprobs_BJV = jax.nn.log_softmax(logits_BJV.astype(jnp.float32), axis=-1)
      chosen_BJ = jnp.take_along_axis(logprobs_BJV, tokens_BJ[..., None], axis=-1)[..., 0]
      top_logprobs_BJK, top_ids_BJK = jax.lax.top_k(logprobs_BJV,
                                                    min(MAX_LOGPROBS, logprobs_BJV.shape[-1]))
      main_pools = tuple(tuple(c.pools for c in unit) for unit in caches.groups)
      return ((tokens_BJ, accepted_B, chosen_BJ, top_ids_BJK, top_logprobs_BJK, drafts_BD),
              (main_pools, mtp_pools))

    return step


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


def _mtp_views(mtp_pools, table_BN, lengths_B, page_size):
  """The MTP layers' paged caches (one layer each) at ``lengths_B``."""
  return tuple(PagedLayerCache(latent, keys, table_BN, lengths_B[None], page_size).layer_view(0)
               for latent, keys in mtp_pools)


def _draft(model, logits_BV, hidden_BD, views, start_B, wanted_B, count: int, plan: StepPlan):
  """``(drafts_BD, views)``: ``count`` greedy drafts per row, d_1 from ``logits_BV``, then one
  MTP step each on (the previous output, the previous draft) at MTP row ``start_B + i``
  (written only for the ``wanted_B`` drafts a row asks for). The steps of the repeated last
  layer run as one ``lax.scan``, so the compile time does not grow with the drafts."""
  last = model.config.num_mtp_layers - 1
  table_BN, page_size = views[0].buffers.block_table_BN, views[0].buffers.page_size

  def step(carry, i, layer):
    d_B, hidden_B1D, pools = carry
    views = _mtp_views(pools, table_BN, start_B + i, page_size)
    logits_B1V, hidden_B1D, views = model.mtp_forward(
        layer, hidden_B1D, d_B[:, None], views,
        new_lens_B=(i + 1 < wanted_B).astype(jnp.int32), plan=plan)
    d_B = jnp.argmax(logits_B1V[:, 0], axis=-1).astype(jnp.int32)
    return (d_B, hidden_B1D, tuple(v.buffers.pools for v in views)), d_B

  carry = (jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), hidden_BD[:, None],
           tuple(v.buffers.pools for v in views))
  drafts = [carry[0][:, None]]
  distinct = min(max(last - 1, 0), count - 1)  # steps before the last layer: layers 1..last-1
  for i in range(distinct):
    carry, d_B = step(carry, i, i + 1)
    drafts.append(d_B[:, None])
  if distinct < count - 1:
    carry, scanned_DB = jax.lax.scan(lambda c, i: step(c, i, last), carry,
                                     jnp.arange(distinct, count - 1))
    drafts.append(scanned_DB.T)
  return (jnp.concatenate(drafts, axis=1),
          _mtp_views(carry[2], table_BN, start_B, page_size))
