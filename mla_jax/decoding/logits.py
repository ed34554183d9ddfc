"""``process_logits``: from a step's sampled rows' logits to its new tokens, the one sampler every
engine step form calls (one step, speculative verification, each step of a multi-step decode
dispatch), in vLLM's order: ``logit_bias``, then the penalties, then ``min_tokens``' hold-back
of stop ids and a constraint's token mask (structured outputs), then each sequence's temperature and cuts and its draw (or its drafts'
acceptance, ``speculative.accept``). A step program is compiled for one ``Sampler``, so it
holds only the work its batch asks for: no branch decides it on the device.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from mla_jax.decoding import penalties
from mla_jax.decoding.speculative import accept


class Sampler(enum.Enum):
  """What a step program does with its sampled rows' logits."""

  GREEDY = "greedy"  # every sequence greedy: the argmax, nothing else
  SAMPLE = "sample"  # temperature, top_k, min_p and top_p per sequence (greedy ones: argmax)
  FULL = "full"      # logit_bias, penalties, min_tokens (and masks) first; log-probabilities


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Per sequence [S]: its base key, tokens generated so far (its draws' index) and settings."""

  keys_S: jax.Array
  counters_S: jax.Array
  temperature_S: jax.Array
  top_p_S: jax.Array
  top_k_S: jax.Array
  min_p_S: jax.Array


@dataclasses.dataclass(frozen=True)
class Adjustments:
  """What a ``FULL`` program applies before sampling, per sequence: its ``logit_bias`` as a
  row [S, V]; its output token counts and whether each id was seen (prompt or output) [S, V]
  with its repetition, frequency and presence penalties [S] (``penalties``); its stop ids
  [S, V] and how many tokens they stay held back (``min_tokens``) [S]; in a masked program,
  the tokens its constraint allows [S, V] (``allowed_rows``; None: every token)."""

  bias_SV: jax.Array
  counts_SV: jax.Array
  seen_SV: jax.Array
  repetition_S: jax.Array
  frequency_S: jax.Array
  presence_S: jax.Array
  stop_SV: jax.Array
  min_left_S: jax.Array
  allowed_SV: jax.Array | None = None

  def apply(self, logits_SJV):
    """The logits each row samples from, before temperature: biased, penalized, and with a
    sequence's stop ids at -inf in its first ``min_left_S`` rows (vLLM's ``min_tokens``), and
    the tokens its constraint forbids at -inf in every row."""
    logits_SJV = logits_SJV + self.bias_SV[:, None, :]
    logits_SJV = penalties.penalized(logits_SJV, self.counts_SV, self.seen_SV,
                                     self.repetition_S, self.frequency_S, self.presence_S)
    early_SJ = jnp.arange(logits_SJV.shape[1])[None, :] < self.min_left_S[:, None]
    logits_SJV = jnp.where(early_SJ[..., None] & self.stop_SV[:, None, :], -jnp.inf, logits_SJV)
    if self.allowed_SV is None:
      return logits_SJV
    return jnp.where(self.allowed_SV[:, None, :], logits_SJV, -jnp.inf)


def process_logits(logits_SJV, ids_SJ, num_logits_S, sampling: Sampling, sampler: Sampler,
                   adjustments: Adjustments | None = None):
  """``(accepted_S, tokens_SJ)``: each sequence's new tokens from the logits of its J rows
  (``ids_SJ[:, 1:num_logits_S]``: drafts to verify; J = 1 without drafts). The first
  ``accepted + 1`` tokens of a sequence are its (``speculative.accept``); ``adjustments``
  (``FULL`` programs only) come first."""
  if (adjustments is not None) != (sampler is Sampler.FULL):
    raise ValueError(f"a {sampler.name} program takes adjustments only when FULL")
  if adjustments is not None:
    logits_SJV = adjustments.apply(logits_SJV)
  if sampler is Sampler.GREEDY:
    return accept_greedy(logits_SJV, ids_SJ, num_logits_S)
  return accept(logits_SJV, ids_SJ, num_logits_S, sampling.keys_S, sampling.counters_S,
                sampling.temperature_S, sampling.top_p_S, sampling.top_k_S, sampling.min_p_S)


def accept_greedy(logits_SJV, ids_SJ, num_logits_S):
  """``accept`` for greedy sequences only, without its distributions: the longest prefix of
  drafts equal to the argmax, then the argmax."""
  best_SJ = jnp.argmax(logits_SJV, axis=-1).astype(jnp.int32)
  j = ids_SJ.shape[1]
  if j == 1:
    return jnp.zeros(ids_SJ.shape[:1], jnp.int32), best_SJ
  offered_SK = jnp.arange(j - 1, dtype=jnp.int32) < (num_logits_S - 1)[:, None]
  keep_SK = (best_SJ[:, :-1] == ids_SJ[:, 1:]) & offered_SK
  accepted_S = jnp.cumprod(keep_SK, axis=1).sum(axis=1).astype(jnp.int32)
  return accepted_S, best_SJ  # the kept drafts equal the argmax, and the argmax follows them


def stop_mask(stop_ids_SM, vocab_size: int):
  """[S, V]: whether each id is one of sequence s's stop ids (-1 pads none)."""
  return jax.nn.one_hot(stop_ids_SM, vocab_size, dtype=jnp.bool_).any(axis=1)


def bias_rows(bias_ids_SB, bias_SB, vocab_size: int):
  """[S, V]: each sequence's ``logit_bias`` (ids -1 pad: dropped) as a row to add."""
  ids_SB = jnp.where(bias_ids_SB < 0, vocab_size, bias_ids_SB)  # out of range: dropped
  rows_SB = jnp.broadcast_to(jnp.arange(ids_SB.shape[0])[:, None], ids_SB.shape)
  return jnp.zeros((ids_SB.shape[0], vocab_size), jnp.float32).at[rows_SB, ids_SB].add(
      bias_SB, mode="drop")


def allowed_rows(allowed_SW, vocab_size: int):
  """[S, V]: whether sequence s may take token t: bit ``t % 32`` of word ``t // 32`` of its
  bitmask (llguidance's layout; int32 words)."""
  t_V = jnp.arange(vocab_size, dtype=jnp.int32)
  words_SV = allowed_SW[:, t_V // 32]
  return ((words_SV >> (t_V % 32)) & 1).astype(jnp.bool_)
