"""A flat step's inputs: every scheduled token in one row each, padded to a few shape buckets,
and how they reach every process.

A step's tokens are laid end to end, each sequence's consecutive and in order (decode
tokens, drafts to verify, prefill chunks alike): per token its id, its sequence's slot and its
position; per sequence slot its block table and sampling settings and which of its tokens'
logits it samples from. The scheduling process (process 0) builds them from the scheduler's
chunks; with several processes it broadcasts them (a small header with the shape, then the
arrays), and every process runs the same compiled program on them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mla_jax.cache import power_of_two_bucket as bucket
from mla_jax.serving.requests import MAX_LOGIT_BIAS
from mla_jax.serving.scheduler import Chunk

MIN_TOKENS = 8  # the smallest token bucket of a step program


@dataclasses.dataclass(frozen=True)
class StepShape:
  """A step program's static shape: what it is compiled for.

  ``tokens``: token rows (a power of two, a multiple of the mesh's data axis); ``seqs``:
  sequence slots (as many, but at most the engine's seats' bucket). ``kv_pages``: block-table
  width (a sequence's longest table). ``fresh``: every sequence starts empty and holds at most
  the dense bound of tokens (the plan may then take the dense route; only an engine whose
  model can take it makes such shapes). ``decode_steps``: 1 for one step; more for a
  multi-step decode dispatch (row s is sequence s, one token per step), whose ``greedy``
  variant takes every sequence's argmax and draws nothing. ``scores``: a step that also
  returns every row's log-probability of the token after it (prompt log-probabilities).
  """

  tokens: int
  seqs: int
  kv_pages: int
  fresh: bool = False
  decode_steps: int = 1
  greedy: bool = False
  scores: bool = False

  def header(self, command: int = 1) -> np.ndarray:
    return np.array([command, self.tokens, self.seqs, self.kv_pages, int(self.fresh),
                     self.decode_steps, int(self.greedy), int(self.scores)], np.int32)

  @classmethod
  def from_header(cls, header) -> StepShape | None:
    """The shape a header announces; None for the stop command."""
    command, tokens, seqs, kv_pages, fresh, steps, greedy, scores = (int(v) for v in header)
    return None if command == 0 else cls(tokens, seqs, kv_pages, bool(fresh), steps,
                                          bool(greedy), bool(scores))


@dataclasses.dataclass(frozen=True)
class Buckets:
  """An engine's static choices of step shapes (docs/serving.md, "Step programs").

  Token rows are powers of two (multiples of ``batch_multiple``, the mesh's data axis): from
  ``MIN_TOKENS`` up to the step budget's for a step, from 1 up to the seats' for a multi-step
  decode dispatch (one row per sequence, so a lone request decodes on one row); sequence
  slots as many, at most the seats' bucket; the block table is always ``max_pages`` wide,
  since the indexer scores keys up to the live reach only (``StepPlan.key_chunk``).
  ``dense_bound``: the tokens a fresh sequence may hold in a step the dense route can take
  (None: the model takes none). ``scores``: the engine serves prompt log-probabilities, in
  scoring variants of the one-step shapes: never fresh, and at every other token bucket down
  from the largest (a scoring step pads to at most 4x its tokens; half the programs to
  compile).
  """

  max_step_tokens: int
  max_num_seqs: int
  max_pages: int
  dense_bound: int | None = None
  decode_steps: int = 1
  batch_multiple: int = 1
  scores: bool = False

  def tokens(self, num_tokens: int, minimum: int = MIN_TOKENS) -> int:
    return -(-bucket(num_tokens, minimum) // self.batch_multiple) * self.batch_multiple

  def shape(self, chunks: list[Chunk], decode_steps: int = 1) -> StepShape:
    """The bucket of a step over ``chunks`` (every token computed, drafts included): fresh when
    the dense route may apply (every chunk starts its sequence and holds at most
    ``dense_bound`` tokens); a multi-step dispatch's greedy when every sequence is; scoring
    when a chunk computes prompt rows whose next token's log-probability its request asks
    for."""
    scores = decode_steps == 1 and any(wants_scores(c) for c in chunks)
    fresh = self.dense_bound is not None and decode_steps == 1 and not scores and all(
        c.num_cached == 0 and c.num_tokens <= self.dense_bound for c in chunks)
    greedy = decode_steps > 1 and all(c.seq.params.temperature == 0 for c in chunks)
    rows = self.tokens(sum(c.num_computed for c in chunks), 1 if decode_steps > 1 else MIN_TOKENS)
    if scores:
      rows = min(n for n in self._scoring_sizes() if n >= rows)
    return self._shape(rows, fresh, decode_steps, greedy, scores)

  def _shape(self, tokens: int, fresh: bool, decode_steps: int, greedy: bool = False,
             scores: bool = False) -> StepShape:
    return StepShape(tokens, min(tokens, self.tokens(self.max_num_seqs)), self.max_pages, fresh,
                     decode_steps, greedy, scores)

  def _sizes(self, most: int, minimum: int) -> list[int]:
    """Every token bucket from ``minimum`` rows up to the bucket of ``most``."""
    sizes = [self.tokens(1, minimum)]
    while sizes[-1] < self.tokens(most, minimum):
      sizes.append(self.tokens(sizes[-1] + 1, minimum))
    return sizes

  def _scoring_sizes(self) -> list[int]:
    return self._sizes(self.max_step_tokens, MIN_TOKENS)[::-2]

  def all_shapes(self) -> list[StepShape]:
    """Every shape a step of this engine can take: what ``Engine.warmup`` compiles."""
    sizes = self._sizes(self.max_step_tokens, MIN_TOKENS)
    shapes = [self._shape(n, False, 1) for n in sizes]
    if self.dense_bound is not None:
      shapes += [self._shape(n, True, 1) for n in sizes]
    if self.scores:
      shapes += [self._shape(n, False, 1, scores=True) for n in self._scoring_sizes()]
    if self.decode_steps > 1:
      shapes += [self._shape(n, False, self.decode_steps, greedy)
                 for n in self._sizes(min(self.max_num_seqs, self.max_step_tokens), 1)
                 for greedy in (False, True)]
    return shapes


def wants_scores(chunk: Chunk) -> bool:
  """Whether ``chunk`` computes a prompt row whose next token's log-probability its request
  asks for (every prompt row but the last)."""
  return (chunk.seq.params.prompt_logprobs is not None
          and chunk.num_cached < chunk.seq.num_prompt - 1)


STOP_HEADER = np.zeros(8, np.int32)


@dataclasses.dataclass(frozen=True)
class StepInputs:
  """The arrays of one step (or multi-step dispatch).

  Per token row t [T]: ``ids_T``, its sequence slot ``seq_T``, its position ``pos_T``,
  ``real_T`` (1 for a token, 0 for padding), ``next_ids_T`` (the token after it when known on
  the host, for the MTP layers' pairs; -1: the token this step samples at that row),
  ``logit_row_T`` (which of its sequence's logit rows it is, -1 for none).
  Per sequence slot s [S]: ``table_SN``, ``seeds_S``, ``counters_S`` (tokens it has
  generated), ``temperature_S``, ``top_p_S``, ``top_k_S``, ``min_p_S``, ``logit_rows_SJ`` (the
  token rows whose logits it samples from: its last token, or a decode's token and drafts),
  ``num_logits_S`` (how many: 0 when it does not sample), ``speculative_S`` (drafts it asks
  for), ``remaining_S`` (tokens it may still emit), ``min_left_S`` (tokens before its stop ids
  may be drawn: ``min_tokens``), ``stop_ids_SM`` (ids that end it, -1 padded: a multi-step
  dispatch stops it on the device), ``bias_ids_SB`` and ``bias_SB`` (its ``logit_bias``: ids,
  -1 padded, and values), ``repetition_S``, ``frequency_S``, ``presence_S`` (its penalties)
  and ``num_prompt_S`` (where its output starts: the penalties count output tokens).
  """

  ids_T: np.ndarray
  seq_T: np.ndarray
  pos_T: np.ndarray
  real_T: np.ndarray
  next_ids_T: np.ndarray
  logit_row_T: np.ndarray
  table_SN: np.ndarray
  seeds_S: np.ndarray
  counters_S: np.ndarray
  temperature_S: np.ndarray
  top_p_S: np.ndarray
  top_k_S: np.ndarray
  min_p_S: np.ndarray
  logit_rows_SJ: np.ndarray
  num_logits_S: np.ndarray
  speculative_S: np.ndarray
  remaining_S: np.ndarray
  min_left_S: np.ndarray
  stop_ids_SM: np.ndarray
  bias_ids_SB: np.ndarray
  bias_SB: np.ndarray
  repetition_S: np.ndarray
  frequency_S: np.ndarray
  presence_S: np.ndarray
  num_prompt_S: np.ndarray

  @classmethod
  def zeros(cls, shape: StepShape, logit_rows: int, stop_ids: int) -> StepInputs:
    t, s = shape.tokens, shape.seqs
    ints = lambda *dims: np.zeros(dims, np.int32)
    return cls(ints(t), ints(t), ints(t), ints(t), np.full(t, -1, np.int32),
               np.full(t, -1, np.int32), ints(s, shape.kv_pages), ints(s), ints(s),
               np.zeros(s, np.float32), np.ones(s, np.float32), ints(s), np.zeros(s, np.float32),
               ints(s, logit_rows), ints(s), ints(s), ints(s), ints(s),
               np.full((s, stop_ids), -1, np.int32), np.full((s, MAX_LOGIT_BIAS), -1, np.int32),
               np.zeros((s, MAX_LOGIT_BIAS), np.float32), np.ones(s, np.float32),
               np.zeros(s, np.float32), np.zeros(s, np.float32), ints(s))

  def arrays(self) -> tuple[np.ndarray, ...]:
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

  NUM_TOKEN_ARRAYS = 6  # the first fields are per token row; the others per sequence slot


def build(chunks: list[Chunk], shape: StepShape, *, logit_rows: int) -> StepInputs:
  """The chunks' tokens laid end to end, chunk b in sequence slot b; padding rows and slots
  compute nothing and sample nothing used. A sequence's ``stop_ids`` go along (a multi-step
  dispatch checks them on the device, and ``min_tokens`` holds them back)."""
  inputs = StepInputs.zeros(shape, logit_rows, STOP_IDS)
  t = 0
  for s, c in enumerate(chunks):
    seq, n = c.seq, c.num_computed
    rows = slice(t, t + n)
    inputs.ids_T[rows] = c.token_ids + list(c.drafts)
    inputs.seq_T[rows] = s
    inputs.pos_T[rows] = np.arange(c.num_cached, c.num_cached + n)
    inputs.real_T[rows] = 1
    # The token after each one, where the host knows it: a prompt's next token (a chunk that
    # samples has none after its last one; a decode's are what its verification accepts).
    if not c.drafts:
      following = seq.tokens[c.num_cached + 1:c.num_cached + c.num_tokens + 1]
      inputs.next_ids_T[t:t + len(following)] = following
    if c.samples:
      first = t + c.num_tokens - 1  # the chunk's last token, then its drafts
      inputs.logit_rows_SJ[s, :n - c.num_tokens + 1] = np.arange(first, t + n)
      inputs.logit_row_T[first:t + n] = np.arange(t + n - first)
      inputs.num_logits_S[s] = t + n - first
    inputs.table_SN[s, :len(seq.pages)] = seq.pages
    inputs.seeds_S[s], inputs.counters_S[s] = seq.seed, len(seq.output)
    params = seq.params
    inputs.temperature_S[s], inputs.top_p_S[s] = params.temperature, params.top_p
    inputs.top_k_S[s], inputs.min_p_S[s] = params.top_k, params.min_p
    inputs.min_left_S[s] = max(params.min_tokens - len(seq.output), 0)
    inputs.speculative_S[s] = params.speculative_tokens
    inputs.remaining_S[s] = params.max_tokens - len(seq.output)
    ids = seq.stop_ids[:STOP_IDS]
    inputs.stop_ids_SM[s, :len(ids)] = ids
    inputs.repetition_S[s] = params.repetition_penalty
    inputs.frequency_S[s], inputs.presence_S[s] = params.frequency_penalty, params.presence_penalty
    inputs.num_prompt_S[s] = seq.num_prompt
    if params.logit_bias:
      bias_ids, bias = zip(*params.logit_bias)
      inputs.bias_ids_SB[s, :len(bias_ids)] = bias_ids
      inputs.bias_SB[s, :len(bias)] = bias
    t += n
  return inputs


STOP_IDS = 8  # stop ids per sequence a multi-step dispatch checks on the device


def broadcast(header: np.ndarray, inputs: StepInputs | None) -> None:
  """Process 0's side of a step (or of the stop command, ``inputs`` None)."""
  from jax.experimental import multihost_utils

  multihost_utils.broadcast_one_to_all(header)
  if inputs is not None:
    multihost_utils.broadcast_one_to_all(inputs.arrays())


def receive(logit_rows: int) -> tuple[StepShape, StepInputs] | None:
  """A follower's side: the next step's shape and inputs, or None when process 0 stops."""
  from jax.experimental import multihost_utils

  shape = StepShape.from_header(np.asarray(multihost_utils.broadcast_one_to_all(STOP_HEADER)))
  if shape is None:
    return None
  arrays = multihost_utils.broadcast_one_to_all(
      StepInputs.zeros(shape, logit_rows, STOP_IDS).arrays())
  return shape, StepInputs(*(np.asarray(a) for a in arrays))
