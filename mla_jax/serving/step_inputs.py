"""A flat step's shape, inputs and outputs, and how they travel: every scheduled token in a row
of its own, padded to a few shape buckets, packed into two host-to-device transfers and one
device-to-host transfer.

A step's tokens are laid end to end, each sequence's consecutive and in order (decode
tokens, drafts to verify, prefill chunks alike): per token its id, its sequence's step slot
and its position; per step slot its request's persistent slot, block table and sampling
settings and which of its tokens' logits it samples from; per (row, key chunk) pair the keys
the indexer scores (``indexer.KeyBlocks``). A decode token still being computed by the step in
flight is a placeholder (-1), which the program fills from the device's last token of the
request's persistent slot, so the host never waits for a token to schedule the next step.
The scheduling process (process 0) builds the inputs from the scheduler's chunks; with several
processes it broadcasts them (a small header with the shape, then the two packed arrays), and
every process runs the same compiled program on them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.cache import power_of_two_bucket as bucket
from mla_jax.decoding.logits import Sampler
from mla_jax.serving.scheduler import Chunk
from mla_jax.serving.sequence import MAX_LOGIT_BIAS, MAX_LOGPROBS

MIN_TOKENS = 8  # the smallest token bucket of a step program
STOP_IDS = 8  # stop ids per sequence the device checks (multi-step dispatches, min_tokens)


@dataclasses.dataclass(frozen=True)
class StepShape:
  """A step program's static shape: what it is compiled for.

  ``tokens``: token rows (a power of two, a multiple of the mesh's data axis); ``seqs``:
  sequence slots (as many, but at most the engine's seats' bucket). ``kv_pages``: block-table
  width (a sequence's longest table). ``key_blocks``: the (row, key chunk) pairs its indexer
  scores (a multiple of ``tokens``; 0 where it scores none: no indexer, or the dense route).
  ``fresh``: every sequence starts empty and holds at most the dense bound of tokens (the
  plan may then take the dense route; only an engine whose model can take it makes such
  shapes). ``decode_steps``: 1 for one step; more for a multi-step decode dispatch (row s is
  sequence s, one token per step). ``sampler``: see ``Sampler``. ``scores``: a step that also
  returns every row's log-probability of the token after it (prompt log-probabilities).
  ``masked``: a ``FULL`` step that also takes each sequence's token bitmask (structured
  outputs: a sequence whose constraint allows a token has its bit set; ``constraints``).
  """

  tokens: int
  seqs: int
  kv_pages: int
  key_blocks: int = 0
  fresh: bool = False
  decode_steps: int = 1
  sampler: Sampler = Sampler.SAMPLE
  scores: bool = False
  masked: bool = False

  _SAMPLERS = tuple(Sampler)

  def header(self, command: int = 1) -> np.ndarray:
    return np.array([command, self.tokens, self.seqs, self.kv_pages, self.key_blocks,
                     int(self.fresh), self.decode_steps, self._SAMPLERS.index(self.sampler),
                     int(self.scores), int(self.masked)], np.int32)

  @classmethod
  def from_header(cls, header) -> StepShape | None:
    """The shape a header announces; None for the stop command."""
    command, tokens, seqs, kv_pages, blocks, fresh, steps, sampler, scores, masked = map(
        int, header)
    return None if command == 0 else cls(tokens, seqs, kv_pages, blocks, bool(fresh), steps,
                                          cls._SAMPLERS[sampler], bool(scores), bool(masked))

  def covers(self, other: StepShape) -> bool:
    """Whether this program can run ``other``'s step: the same kind, at least as many rows
    and key blocks (padding computes nothing used)."""
    same = dataclasses.replace(other, tokens=self.tokens, seqs=self.seqs,
                               key_blocks=self.key_blocks)
    return (same == self and self.tokens >= other.tokens
            and self.key_blocks >= other.key_blocks)


HEADER_SIZE = 10
STOP_HEADER = np.zeros(HEADER_SIZE, np.int32)


@dataclasses.dataclass(frozen=True)
class Buckets:
  """An engine's static choices of step shapes (docs/serving.md, "Step programs").

  Token rows are powers of two (multiples of ``batch_multiple``, the mesh's data axis): from
  ``MIN_TOKENS`` up to the step budget's for a step, from 1 up to the seats' for a multi-step
  decode dispatch (one row per sequence, so a lone request decodes on one row); sequence
  slots as many, at most the seats' bucket. The block table is always ``max_pages`` wide.
  ``key_chunk``: the indexer's key positions a block (None: the model has no indexer); a
  step's key blocks are its rows x a power of two, from 1 up to the longest reach's chunks
  (``covering``), so the indexer's work follows the rows' own reaches.
  ``dense_bound``: the tokens a fresh sequence may hold in a step the dense route can take
  (None: the model takes none). Variants: greedy one-step programs for steps of at most
  ``max_num_seqs`` rows (larger steps sample greedy sequences by their argmax in the
  ``SAMPLE`` program); ``FULL`` programs at every other token bucket down from the largest
  (such a step pads to at most 4x its tokens; half the programs to compile), which in an
  engine that serves prompt log-probabilities (``scores``) are its scoring programs. With
  ``masked`` (the engine serves structured outputs) a step that samples a constrained
  sequence runs a masked ``FULL`` program: the scoring programs take the masks (no more
  programs), or, in an engine that scores none, masked ``FULL`` programs at the same sizes.
  """

  max_step_tokens: int
  max_num_seqs: int
  max_pages: int
  page_size: int
  key_chunk: int | None = None
  dense_bound: int | None = None
  decode_steps: int = 1
  batch_multiple: int = 1
  scores: bool = False
  masked: bool = False

  def tokens(self, num_tokens: int, minimum: int = MIN_TOKENS) -> int:
    return -(-bucket(num_tokens, minimum) // self.batch_multiple) * self.batch_multiple

  @property
  def max_chunks(self) -> int:
    """Key blocks a row may need: its reach is at most the block table's."""
    return bucket(-(-self.max_pages * self.page_size // self.key_chunk))

  def shape(self, chunks: list[Chunk], decode_steps: int = 1) -> StepShape:
    """The bucket of a step over ``chunks`` (every token computed, drafts included): fresh when
    the dense route may apply (every chunk starts its sequence and holds at most
    ``dense_bound`` tokens); scoring when a chunk computes prompt rows whose next token's
    log-probability its request asks for; its sampler from what its sequences ask."""
    multi = decode_steps > 1
    scores = full = masked = False
    greedy = True
    fresh = self.dense_bound is not None and not multi
    computed = needed = 0
    key_chunk = self.key_chunk
    for c in chunks:  # one pass: the host's share of a step grows with its sequences
      computed += c.num_computed
      scores = scores or (not multi and wants_scores(c))
      full = full or wants_full(c)
      masked = masked or wants_mask(c)
      greedy = greedy and c.seq.params.temperature == 0
      fresh = fresh and c.num_cached == 0 and c.num_tokens <= self.dense_bound
      if key_chunk is not None:
        needed += (-(-(c.num_cached + decode_steps) // key_chunk) if multi else
                   chunk_blocks(c.num_cached, c.num_computed, key_chunk))
    # An engine that scores prompts runs every FULL step on its scoring programs (one set of
    # programs fewer to warm up; the scores of rows nobody asked for are dropped).
    scores = scores or (full and self.scores)
    fresh = fresh and not scores
    masked = masked or (scores and self.masked)  # scoring programs take masks too (warm-up)
    sampler = (Sampler.FULL if scores or full else Sampler.GREEDY if greedy else Sampler.SAMPLE)
    rows = self.tokens(computed, 1 if multi else MIN_TOKENS)
    if not multi and sampler is Sampler.FULL:
      rows = min(n for n in self._every_other_size() if n >= rows)
    elif not multi and sampler is Sampler.GREEDY and rows > self._greedy_rows():
      sampler = Sampler.SAMPLE
    blocks = 0
    if key_chunk is not None and not fresh:
      blocks = rows * min(bucket(-(-needed // rows)), self.max_chunks)
    return self._shape(rows, blocks, fresh, decode_steps, sampler, scores, masked)

  def covering(self, shape: StepShape) -> StepShape:
    """The shape of the same kind and rows whose key blocks hold any step's: what warm-up
    compiles (a step whose own program is not compiled yet runs on it)."""
    if not shape.key_blocks:
      return shape
    return dataclasses.replace(shape, key_blocks=shape.tokens * self.max_chunks)

  def _shape(self, tokens: int, key_blocks: int, fresh: bool, decode_steps: int,
             sampler: Sampler, scores: bool = False, masked: bool = False) -> StepShape:
    return StepShape(tokens, min(tokens, self.tokens(self.max_num_seqs)), self.max_pages,
                     key_blocks, fresh, decode_steps, sampler, scores, masked)

  def _greedy_rows(self) -> int:
    return self.tokens(self.max_num_seqs)

  def _sizes(self, most: int, minimum: int) -> list[int]:
    """Every token bucket from ``minimum`` rows up to the bucket of ``most``."""
    sizes = [self.tokens(1, minimum)]
    while sizes[-1] < self.tokens(most, minimum):
      sizes.append(self.tokens(sizes[-1] + 1, minimum))
    return sizes

  def _every_other_size(self) -> list[int]:
    return self._sizes(self.max_step_tokens, MIN_TOKENS)[::-2]

  def all_shapes(self, every_reach: bool = False) -> list[StepShape]:
    """Every kind of step this engine can take, each at its covering key blocks: what
    ``Engine.warmup`` compiles (smaller key-block buckets compile when a step first needs
    them, meanwhile running on these). ``every_reach``: each also at every smaller key-block
    bucket (every shape ``shape`` can give)."""
    shapes = self._covering_shapes()
    if not every_reach or self.key_chunk is None:
      return shapes
    return [dataclasses.replace(s, key_blocks=s.tokens * chunks) for s in shapes
            for chunks in (self._chunk_buckets() if s.key_blocks else (0,))]

  def _chunk_buckets(self) -> list[int]:
    """Key blocks a row, on average, of every bucket: powers of two up to ``max_chunks``."""
    return [1 << i for i in range(self.max_chunks.bit_length())]

  def _covering_shapes(self) -> list[StepShape]:
    blocks = lambda n: 0 if self.key_chunk is None else n * self.max_chunks
    sizes = self._sizes(self.max_step_tokens, MIN_TOKENS)
    shapes = [self._shape(n, blocks(n), False, 1, Sampler.SAMPLE) for n in sizes]
    shapes += [self._shape(n, blocks(n), False, 1, Sampler.GREEDY)
               for n in sizes if n <= self._greedy_rows()]
    shapes += [self._shape(n, blocks(n), False, 1, Sampler.FULL, scores=self.scores,
                           masked=self.masked and self.scores)
               for n in self._every_other_size()]
    if self.dense_bound is not None:
      shapes += [self._shape(n, 0, True, 1, Sampler.SAMPLE) for n in sizes]
    if self.masked and not self.scores:
      shapes += [self._shape(n, blocks(n), False, 1, Sampler.FULL, masked=True)
                 for n in self._every_other_size()]
    if self.decode_steps > 1:
      shapes += [self._shape(n, blocks(n), False, self.decode_steps, sampler)
                 for n in self._sizes(min(self.max_num_seqs, self.max_step_tokens), 1)
                 for sampler in (Sampler.SAMPLE, Sampler.GREEDY)]
    return shapes


def chunk_blocks(start: int, rows: int, key_chunk: int) -> int:
  """Key blocks of ``rows`` consecutive rows whose reaches are ``start + 1 .. start + rows``
  (a chunk's)."""
  def upto(m):  # sum of ceil(r / key_chunk) for r in 1..m
    q, rest = divmod(m, key_chunk)
    return key_chunk * q * (q + 1) // 2 + rest * (q + 1)
  return upto(start + rows) - upto(start)


def wants_scores(chunk: Chunk) -> bool:
  """Whether ``chunk`` computes a prompt row whose next token's log-probability its request
  asks for (every prompt row but the last)."""
  return (chunk.seq.params.prompt_logprobs is not None
          and chunk.num_cached < chunk.seq.num_prompt - 1)


def wants_full(chunk: Chunk) -> bool:
  """Whether ``chunk``'s sampling needs the ``FULL`` program: log-probabilities, a logit
  bias, a penalty, stop ids still held back by ``min_tokens``, or a constraint."""
  params = chunk.seq.params
  return chunk.samples and (params.logprobs is not None or bool(params.logit_bias)
                            or params.penalized or chunk.seq.num_output < params.min_tokens
                            or params.constraint is not None)


def wants_mask(chunk: Chunk) -> bool:
  """Whether ``chunk`` samples under a constraint: its step takes the token bitmasks."""
  return chunk.samples and chunk.seq.params.constraint is not None


# ---- inputs ------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
  """The arrays of one step (or multi-step dispatch); a field a shape does not use is None.

  Per token row t [T]: ``ids_T`` (-1: the placeholder of a token the step in flight
  computes, taken from the device's last token of its request's slot), its sequence's step
  slot ``seq_T``, its position ``pos_T``, ``real_T`` (1 for a token, 0 for padding); with MTP
  layers or scores ``next_ids_T`` (the token after it when known on the host, for the MTP
  layers' pairs and the prompt log-probabilities; -1: the token this step samples at that
  row), with MTP layers ``logit_row_T`` (which of its sequence's logit rows it is, -1 for
  none). ``reach_T``: the keys its indexer scores (its position + 1, at a multi-step
  dispatch's last step; the program lays out the key blocks, ``indexer.KeyBlocks``).
  Per step slot s [S]: ``slot_S`` (its request's persistent slot), ``table_SN``, ``seeds_S``,
  ``counters_S`` (tokens it has generated, those in flight included), ``temperature_S``,
  ``top_p_S``, ``top_k_S``, ``min_p_S``, ``logit_rows_SJ`` (the token rows whose logits it
  samples from: its last token, or a decode's token and drafts), ``num_logits_S`` (how many:
  0 when it does not sample), ``speculative_S`` (drafts it asks for), ``remaining_S`` (tokens
  it may still emit), ``stop_ids_SM`` (ids that end it, -1 padded: a multi-step dispatch stops
  it on the device, and ``min_tokens`` holds them back). ``FULL`` programs also take
  ``min_left_S`` (tokens before its stop ids may be drawn), ``bias_ids_SB`` and ``bias_SB``
  (its ``logit_bias``: ids, -1 padded, and values), ``repetition_S``, ``frequency_S``,
  ``presence_S`` (its penalties) and ``num_prompt_S`` (where its output starts); masked ones
  ``allowed_SW`` (the tokens its constraint allows: bit t % 32 of word t // 32, every bit set
  for an unconstrained sequence). A model with per-sequence state takes ``state_src_S`` (the
  state slot a sequence reads at the step's start: its persistent slot, or a prefix hit's
  snapshot) and ``snapshot_S`` / ``snapshot_at_S`` (save its state as of that position into
  that slot; -1: none).
  """

  ids_T: np.ndarray
  seq_T: np.ndarray
  pos_T: np.ndarray
  real_T: np.ndarray
  slot_S: np.ndarray
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
  stop_ids_SM: np.ndarray
  next_ids_T: np.ndarray | None = None
  logit_row_T: np.ndarray | None = None
  reach_T: np.ndarray | None = None
  min_left_S: np.ndarray | None = None
  bias_ids_SB: np.ndarray | None = None
  bias_SB: np.ndarray | None = None
  repetition_S: np.ndarray | None = None
  frequency_S: np.ndarray | None = None
  presence_S: np.ndarray | None = None
  num_prompt_S: np.ndarray | None = None
  allowed_SW: np.ndarray | None = None
  state_src_S: np.ndarray | None = None
  snapshot_S: np.ndarray | None = None
  snapshot_at_S: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each input lives in a step's two packed arrays (int32 and float32), and each
  output in its one packed int32 array (float32 outputs bitcast): fixed by the shape (and
  whether the model drafts with MTP layers, ``mtp``, or keeps per-sequence state,
  ``state``)."""

  shape: StepShape
  logit_rows: int
  mtp: bool
  vocab_size: int = 0  # the bitmask's bits (masked shapes)
  state: bool = False  # per-sequence state (``DecodeModel.sequence_state``)

  def input_fields(self) -> list[tuple[str, tuple[int, ...], type]]:
    t, s, j = self.shape.tokens, self.shape.seqs, self.logit_rows
    i32, f32 = np.int32, np.float32
    fields = [("ids_T", (t,), i32), ("seq_T", (t,), i32), ("pos_T", (t,), i32),
              ("real_T", (t,), i32), ("slot_S", (s,), i32),
              ("table_SN", (s, self.shape.kv_pages), i32), ("seeds_S", (s,), i32),
              ("counters_S", (s,), i32), ("temperature_S", (s,), f32), ("top_p_S", (s,), f32),
              ("top_k_S", (s,), i32), ("min_p_S", (s,), f32), ("logit_rows_SJ", (s, j), i32),
              ("num_logits_S", (s,), i32), ("speculative_S", (s,), i32),
              ("remaining_S", (s,), i32), ("stop_ids_SM", (s, STOP_IDS), i32)]
    if self.mtp or self.shape.scores:
      fields += [("next_ids_T", (t,), i32)]
    if self.mtp:
      fields += [("logit_row_T", (t,), i32)]
    if self.shape.key_blocks:
      fields += [("reach_T", (t,), i32)]
    if self.state:
      fields += [("state_src_S", (s,), i32), ("snapshot_S", (s,), i32),
                 ("snapshot_at_S", (s,), i32)]
    if self.shape.sampler is Sampler.FULL:
      fields += [("min_left_S", (s,), i32), ("bias_ids_SB", (s, MAX_LOGIT_BIAS), i32),
                 ("bias_SB", (s, MAX_LOGIT_BIAS), f32), ("repetition_S", (s,), f32),
                 ("frequency_S", (s,), f32), ("presence_S", (s,), f32),
                 ("num_prompt_S", (s,), i32)]
    if self.shape.masked:
      fields += [("allowed_SW", (s, -(-self.vocab_size // 32)), i32)]
    return fields

  def output_fields(self) -> list[tuple[str, tuple[int, ...], type]]:
    s, j, t = self.shape.seqs, self.logit_rows, self.shape.tokens
    i32, f32 = np.int32, np.float32
    if self.shape.decode_steps > 1:
      return [("tokens", (self.shape.decode_steps, s), i32)]
    k = MAX_LOGPROBS
    fields = [("tokens", (s, j), i32), ("accepted", (s,), i32)]
    if self.shape.sampler is Sampler.FULL:
      fields += [("logprob", (s, j), f32), ("top_ids", (s, j, k), i32), ("top", (s, j, k), f32)]
    if self.mtp and j > 1:
      fields += [("drafts", (s, j - 1), i32), ("wanted", (s,), i32)]
    if self.shape.scores:
      fields += [("row_logprob", (t,), f32), ("row_rank", (t,), i32),
                 ("row_top_ids", (t, k), i32), ("row_top", (t, k), f32)]
    return fields

  def zeros(self) -> PackedInputs:
    """Inputs of nothing to compute, padding everywhere: each field a view into the step's two
    packed arrays (``build`` fills them in place; they are sent as they are)."""
    ints, floats = (a.copy() for a in _padding(self))
    inputs = StepInputs(**_split(self.input_fields(), {np.int32: ints, np.float32: floats}))
    return PackedInputs(inputs, ints, floats)

  def pack(self, inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
    """The int32 and float32 arrays the program takes (two transfers)."""
    ints, floats = [], []
    for name, _, dtype in self.input_fields():
      (ints if dtype is np.int32 else floats).append(np.ravel(getattr(inputs, name)))
    return (np.concatenate(ints).astype(np.int32, copy=False),
            np.concatenate(floats).astype(np.float32, copy=False))

  def unpack(self, ints, floats) -> StepInputs:
    """(In the program) the inputs from the two packed arrays: static slices."""
    return StepInputs(**_split(self.input_fields(), {np.int32: ints, np.float32: floats}))

  def pack_outputs(self, outputs: dict):
    """(In the program) every output in one int32 array (one transfer to the host)."""
    parts = []
    for name, dims, dtype in self.output_fields():
      value = outputs[name].reshape(-1)
      parts.append(jax.lax.bitcast_convert_type(value.astype(jnp.float32), jnp.int32)
                   if dtype is np.float32 else value.astype(jnp.int32))
    return jnp.concatenate(parts)

  def unpack_outputs(self, packed: np.ndarray) -> dict[str, np.ndarray]:
    """(On the host) the outputs, as views of the one packed array."""
    return _split(self.output_fields(), {np.int32: packed, np.float32: packed.view(np.float32)},
                  one=True)


class PackedInputs(NamedTuple):
  """A step's inputs (``StepInputs``, views) and the two packed arrays they live in."""

  inputs: StepInputs
  ints: np.ndarray
  floats: np.ndarray


@functools.lru_cache(maxsize=128)
def _padding(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
  """The packed arrays of a step of nothing (ids -1 where -1 pads, top_p and repetition 1),
  made once per layout."""
  arrays = {}
  for name, dims, dtype in layout.input_fields():
    fill = -1 if name in ("next_ids_T", "logit_row_T", "stop_ids_SM", "bias_ids_SB",
                          "allowed_SW", "snapshot_S") else 0
    fill = 1 if name in ("top_p_S", "repetition_S") else fill
    arrays[name] = np.full(dims, fill, dtype)
  return layout.pack(StepInputs(**arrays))


def _split(fields, sources: dict, *, one: bool = False) -> dict:
  """Each field's slice of its dtype's packed array (``one``: every dtype in one array, in
  field order)."""
  offsets = dict.fromkeys(sources, 0)
  out = {}
  for name, dims, dtype in fields:
    key = np.int32 if one else dtype
    size = math.prod(dims)
    out[name] = sources[dtype][offsets[key]:offsets[key] + size].reshape(dims)
    offsets[key] += size
  return out


# ---- several processes ---------------------------------------------------------------------

def broadcast(header: np.ndarray, packed: tuple[np.ndarray, np.ndarray] | None) -> None:
  """Process 0's side of a step (or of the stop command, ``packed`` None)."""
  from jax.experimental import multihost_utils

  multihost_utils.broadcast_one_to_all(header)
  if packed is not None:
    multihost_utils.broadcast_one_to_all(packed)


def receive(layout_of) -> tuple[StepShape, tuple[np.ndarray, np.ndarray]] | None:
  """A follower's side: the next step's shape and packed inputs, or None when process 0
  stops. ``layout_of(shape)``: the step's ``Layout``."""
  from jax.experimental import multihost_utils

  shape = StepShape.from_header(np.asarray(multihost_utils.broadcast_one_to_all(STOP_HEADER)))
  if shape is None:
    return None
  layout = layout_of(shape)
  blank = layout.zeros()
  packed = multihost_utils.broadcast_one_to_all((blank.ints, blank.floats))
  return shape, tuple(np.asarray(a) for a in packed)
