"""A step's inputs as arrays padded to its shape bucket, and how they reach every process.

The scheduling process (process 0) builds them from the scheduler's chunks; with several
processes it broadcasts them (a small header with the shape, then the arrays), and every process
runs the same compiled program on them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mla_jax.cache import MIN_BUCKET, power_of_two_bucket as bucket
from mla_jax.serving.scheduler import Chunk, pages_for

KINDS = ("decode", "prefill")


@dataclasses.dataclass(frozen=True)
class StepShape:
  """A step program's static shape: what it is compiled for."""

  kind: str                  # "decode" or "prefill"
  batch: int                 # sequence rows
  tokens: int                # tokens per row (a decode's: 1 + the most draft tokens of a row)
  cached_bound: int | None   # None in decode (unknown until run time)
  kv_pages: int              # block-table width

  def header(self, command: int = 1) -> np.ndarray:
    cached = -1 if self.cached_bound is None else self.cached_bound
    return np.array([command, KINDS.index(self.kind), self.batch, self.tokens, cached,
                     self.kv_pages], np.int32)

  @classmethod
  def from_header(cls, header) -> StepShape | None:
    """The shape a header announces; None for the stop command."""
    command, kind, batch, tokens, cached, kv_pages = (int(v) for v in header)
    if command == 0:
      return None
    return cls(KINDS[kind], batch, tokens, None if cached < 0 else cached, kv_pages)


STOP_HEADER = np.zeros(6, np.int32)


@dataclasses.dataclass(frozen=True)
class StepInputs:
  """Per row: token ids [B, T], new and cached lengths, block table [B, N], sampling state;
  for the MTP layers (speculative engines): the token after each id [B, T] (-1: the one this
  step samples), the draft tokens the row asks for and the tokens it may still emit."""

  ids_BT: np.ndarray
  new_lens_B: np.ndarray
  lengths_B: np.ndarray
  table_BN: np.ndarray
  seeds_B: np.ndarray
  counters_B: np.ndarray
  temperature_B: np.ndarray
  top_p_B: np.ndarray
  next_ids_BT: np.ndarray
  speculative_B: np.ndarray
  remaining_B: np.ndarray

  @classmethod
  def zeros(cls, shape: StepShape) -> StepInputs:
    b = shape.batch
    ints = lambda *dims: np.zeros(dims, np.int32)
    return cls(ints(b, shape.tokens), ints(b), ints(b), ints(b, shape.kv_pages), ints(b),
               ints(b), np.zeros(b, np.float32), np.ones(b, np.float32),
               ints(b, shape.tokens), ints(b), ints(b))

  def arrays(self) -> tuple[np.ndarray, ...]:
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def batch_bucket(num_rows: int, batch_multiple: int = 1) -> int:
  """Rows of a step program: a power of two, a multiple of the mesh's data axis."""
  return -(-bucket(num_rows, batch_multiple) // batch_multiple) * batch_multiple


def token_bucket(num_tokens: int) -> int:
  """Tokens per row of a prefill program: a power of two, at least 16."""
  return bucket(num_tokens, 16)


def prefill_slots(num_chunks: int, longest: int, batch_multiple: int = 1) -> int:
  """The padded size (rows x tokens) of the prefill program ``num_chunks`` chunks run in."""
  return batch_bucket(num_chunks, batch_multiple) * token_bucket(longest)


def step_shape(chunks: list[Chunk], kind: str, page_size: int, batch_multiple: int = 1
               ) -> StepShape:
  """The bucket of a step over ``chunks``: rows a power of two (a multiple of the mesh's data
  axis), tokens a power of two (at least 16) or 1 in decode, kv pages covering the longest reach
  in buckets of at least ``MIN_BUCKET`` rows. A prefill's cached bound is 0 when every chunk is
  fresh (the dense route may then apply), else every row before the step's tokens: a true
  bound that adds no programs of its own. A decode's tokens are 1 + the most draft tokens
  its rows ask for (speculative decoding), and its pages cover every row it may write."""
  starts = [c.start for c in chunks]
  if kind == "decode":
    tokens = 1 + max(c.seq.params.speculative_tokens for c in chunks)
    reach = max(c.start + c.rows for c in chunks)
  else:
    tokens = token_bucket(max(c.num_tokens for c in chunks))
    reach = max(starts) + tokens
  kv_pages = bucket(pages_for(reach, page_size), pages_for(MIN_BUCKET, page_size))
  cached = None if kind == "decode" else 0 if max(starts) == 0 else kv_pages * page_size - tokens
  return StepShape(kind, batch_bucket(len(chunks), batch_multiple), tokens, cached, kv_pages)


def build(chunks: list[Chunk], shape: StepShape) -> StepInputs:
  """The chunks' rows; padding rows compute nothing (no new tokens) and sample nothing used."""
  inputs = StepInputs.zeros(shape)
  for b, c in enumerate(chunks):
    seq = c.seq
    inputs.ids_BT[b, :c.num_computed] = c.token_ids + list(c.drafts)
    inputs.new_lens_B[b], inputs.lengths_B[b] = c.num_computed, c.start
    inputs.table_BN[b, :len(seq.pages)] = seq.pages
    inputs.seeds_B[b], inputs.counters_B[b] = seq.seed, len(seq.output)
    inputs.temperature_B[b], inputs.top_p_B[b] = seq.params.temperature, seq.params.top_p
    following = seq.tokens[c.start + 1:c.start + c.num_tokens + 1]
    inputs.next_ids_BT[b, :c.num_tokens] = following + [-1] * (c.num_tokens - len(following))
    inputs.speculative_B[b] = seq.params.speculative_tokens
    inputs.remaining_B[b] = seq.params.max_tokens - len(seq.output)
  return inputs


def broadcast(header: np.ndarray, inputs: StepInputs | None) -> None:
  """Process 0's side of a step (or of the stop command, ``inputs`` None)."""
  from jax.experimental import multihost_utils

  multihost_utils.broadcast_one_to_all(header)
  if inputs is not None:
    multihost_utils.broadcast_one_to_all(inputs.arrays())


def receive() -> tuple[StepShape, StepInputs] | None:
  """A follower's side: the next step's shape and inputs, or None when process 0 stops."""
  from jax.experimental import multihost_utils

  shape = StepShape.from_header(np.asarray(multihost_utils.broadcast_one_to_all(STOP_HEADER)))
  if shape is None:
    return None
  arrays = multihost_utils.broadcast_one_to_all(StepInputs.zeros(shape).arrays())
  return shape, StepInputs(*(np.asarray(a) for a in arrays))
