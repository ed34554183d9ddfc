"""DeepSeek-V4's caches: per-sequence state in slots, compressed entries in pages.

Each layer keeps two kinds of rows (docs/models.md, Caches):

* **state**, per sequence, in slots ``[slots, R, width]``: the window ring (the last
  ``sliding_window`` tokens' K=V rows) and, in a compressed layer, its compressor's ring (the
  last m or 2m tokens' projections; CSA's indexer has one too). Position p sits in ring row
  ``p % R``; ``R`` may hold ``spare`` rows more, for steps that run ahead (speculative
  decoding's rejected drafts are never read).
* **pages** of compressed entries (and CSA's indexer keys), one row per entry: entry w of a
  sequence pools positions ``[w m, (w + 1) m)`` and lives in the page holding its window,
  its last page when the window spans several (``m`` a multiple of the page size), at slot
  ``w % (P / m)`` when a page holds several (the page size a multiple of ``m``). So an entry
  is written in the step that computes its window's last token, into a page that is full
  from then on, and a full page (a prefix cache's unit) holds every entry of its windows.

The same arrays serve both forms of the decode protocol:

* contiguous (``V4CausalLM.init_cache``): sequence b is slot b and one page, page b, as long
  as the capacity rounded up to a multiple of every ratio;
* paged (an engine's pools, ``V4CausalLM.init_pools``): ``num_pages`` pages of ``page_size``
  tokens and per-sequence state in slots: one per persistent slot, the rest a prefix
  cache's snapshots (``FlatRows``).

A step reads a sequence's state as it was before the step (from ``state_src_S``: its own
slot, or a snapshot's) and its own rows, and writes the state after its last row (and, when
asked, as of a page boundary into a snapshot slot); ``StepGeometry`` says where each row and
sequence lies.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from mla_jax import checks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class V4LayerCache:
  """One layer's arrays; a field the layer type has no use for is None.

  ``window`` [slots, R, head_dim]; ``pool_kv`` / ``pool_gate`` [slots, Rc, series x
  head_dim] (the compressor's ring); ``entries`` [entry rows, head_dim]; CSA's indexer:
  ``index_pool_kv`` / ``index_pool_gate`` and ``index_keys`` [entry rows, index_head_dim].
  """

  window: jax.Array
  pool_kv: jax.Array | None = None
  pool_gate: jax.Array | None = None
  entries: jax.Array | None = None
  index_pool_kv: jax.Array | None = None
  index_pool_gate: jax.Array | None = None
  index_keys: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class V4Cache:
  """Every layer's arrays and where the sequences of a step lie in them.

  ``num_cached_B``: each row-sequence's first new position. Contiguous (``segment_ids_B``
  None): row b is sequence b (slot ``slot_S[b]``, pages ``table_SN[b]``), its next position.
  A flat step (an engine's): row b is one token of sequence ``segment_ids_B[b]``, at
  position ``num_cached_B[b]``; the rows of a sequence are consecutive and in order.
  ``table_SN``: each sequence's pages; ``slot_S``: the slot its state is written to;
  ``state_src_S``: the slot it is read from at the step's start (None: ``slot_S``);
  ``snapshot_S`` / ``snapshot_at_S``: save the state as of that position into that slot
  (-1: none). ``page_size``: tokens a page (static).
  """

  layers: tuple[V4LayerCache, ...]
  num_cached_B: jax.Array
  table_SN: jax.Array
  slot_S: jax.Array
  page_size: int = dataclasses.field(metadata=dict(static=True))
  segment_ids_B: jax.Array | None = None
  state_src_S: jax.Array | None = None
  snapshot_S: jax.Array | None = None
  snapshot_at_S: jax.Array | None = None

  @property
  def capacity(self) -> int:
    """Positions a sequence can hold: its pages."""
    return self.table_SN.shape[1] * self.page_size

  @property
  def pools(self) -> tuple[V4LayerCache, ...]:
    """The arrays alone (what an engine keeps between steps)."""
    return self.layers

  def with_num_cached(self, num_cached_B) -> V4Cache:
    """The same arrays with each sequence's next position at ``num_cached_B``: a rollback
    (positions past it are rewritten before any query reads them) or a fill."""
    return dataclasses.replace(self, num_cached_B=jnp.broadcast_to(
        num_cached_B, self.num_cached_B.shape).astype(jnp.int32))

  def geometry(self, num_new: int, new_lens_B) -> StepGeometry:
    """Where a step of ``num_new`` tokens per row-sequence (``new_lens_B`` real) lies."""
    b = self.num_cached_B.shape[0]
    if self.segment_ids_B is None:  # row-major [B, T]: row b * T + t is token t of b
      t_T = jnp.arange(num_new, dtype=jnp.int32)
      seq_N = jnp.repeat(jnp.arange(b, dtype=jnp.int32), num_new)
      pos_N = (self.num_cached_B[:, None] + t_T).reshape(-1)
      real_N = (t_T < new_lens_B[:, None]).reshape(-1)
      first_S = jnp.arange(b, dtype=jnp.int32) * num_new
      start_S, count_S = self.num_cached_B, new_lens_B.astype(jnp.int32)
    else:
      if num_new != 1:
        raise ValueError(f"a flat step has one token per row, got {num_new}")
      s = self.table_SN.shape[0]
      seq_N, pos_N, real_N = self.segment_ids_B, self.num_cached_B, new_lens_B > 0
      rows_N = jnp.arange(b, dtype=jnp.int32)
      first_S = jnp.minimum(jax.ops.segment_min(jnp.where(real_N, rows_N, b), seq_N, s), b - 1)
      count_S = jax.ops.segment_sum(real_N.astype(jnp.int32), seq_N, s)
      start_S = pos_N[first_S]
    src_S = self.slot_S if self.state_src_S is None else self.state_src_S
    return StepGeometry(seq_N, pos_N.astype(jnp.int32), real_N, self.slot_S, src_S,
                        self.table_SN, first_S, start_S, count_S, self.snapshot_S,
                        self.snapshot_at_S, self.page_size)


@dataclasses.dataclass(frozen=True)
class StepGeometry:
  """A step's rows and sequences (``V4Cache.geometry``): per row n [N] its sequence, position
  and whether it is a token; per sequence s [S] its state slots (written, read), pages, first
  row, first position and row count, and its snapshot (slot, position; or None)."""

  seq_N: jax.Array
  pos_N: jax.Array
  real_N: jax.Array
  slot_S: jax.Array
  src_S: jax.Array
  table_SN: jax.Array
  first_S: jax.Array
  start_S: jax.Array
  count_S: jax.Array
  snapshot_S: jax.Array | None
  snapshot_at_S: jax.Array | None
  page_size: int

  @property
  def num_rows(self) -> int:
    return self.seq_N.shape[0]

  def sources(self, row_J, pos_JX, ring: int):
    """Where the sequences of rows ``row_J`` hold positions ``pos_JX`` [J, X], each at most
    the row's own: ``(step row [J, X]: this step's row, -1 if none; ring row [J, X]: the
    row of the state read, flattened over slots, -1 if none)``. A position before 0 (or any
    of a padding row) is in neither."""
    seq = self.seq_N[row_J][:, None]
    start, first = self.start_S[seq], self.first_S[seq]
    valid = (pos_JX >= 0) & self.real_N[row_J][:, None]
    in_step = pos_JX >= start
    step_JX = jnp.where(valid & in_step, first + pos_JX - start, -1)
    ring_JX = jnp.where(valid & ~in_step, self.src_S[seq] * ring + pos_JX % ring, -1)
    return step_JX, ring_JX

  def window(self, window: int, ring: int):
    """``sources`` of every row's window: positions ``p, p - 1, ..., p - window + 1``."""
    rows_N = jnp.arange(self.num_rows, dtype=jnp.int32)
    return self.sources(rows_N, self.pos_N[:, None] - jnp.arange(window, dtype=jnp.int32),
                        ring)

  def state_after(self, state_SRX, new_NX):
    """The state slots after the step: each sequence with rows gets the ring of its last
    ``R`` positions (this step's rows ``new_NX``, the state read before them); a snapshot
    slot the ring as of its position."""
    slots = state_SRX.shape[0]
    end_S = self.start_S + self.count_S
    state = state_SRX.at[jnp.where(self.count_S > 0, self.slot_S, slots)].set(
        self._state_at(state_SRX, new_NX, end_S), mode="drop")
    if self.snapshot_S is None:
      return state
    return state.at[jnp.where(self.snapshot_S >= 0, self.snapshot_S, slots)].set(
        self._state_at(state_SRX, new_NX, self.snapshot_at_S), mode="drop")

  def _state_at(self, state_SRX, new_NX, at_S):
    """[S, R, X]: ring row j holds the last position before ``at_S`` in j's class mod R."""
    r = state_SRX.shape[1]
    q_SR = at_S[:, None] - 1 - (at_S[:, None] - 1 - jnp.arange(r, dtype=jnp.int32)) % r
    from_step = q_SR >= self.start_S[:, None]
    row_SR = jnp.clip(self.first_S[:, None] + q_SR - self.start_S[:, None], 0,
                      new_NX.shape[0] - 1)
    old_SRX = state_SRX[jnp.clip(self.src_S, 0, state_SRX.shape[0] - 1)]
    return jnp.where(from_step[..., None], new_NX[row_SR].astype(state_SRX.dtype), old_SRX)

  def entry_rows(self, seq_X, entry_X, ratio: int):
    """Pool rows of entries ``entry_X`` of sequences ``seq_X`` (module docstring)."""
    per_page = entries_per_page(self.page_size, ratio)
    if ratio <= self.page_size:
      page_X, slot_X = entry_X * ratio // self.page_size, entry_X % per_page
    else:
      page_X, slot_X = ((entry_X + 1) * ratio - 1) // self.page_size, 0
    page_X = jnp.clip(page_X, 0, self.table_SN.shape[1] - 1)
    return self.table_SN[seq_X, page_X] * per_page + slot_X


def entries_per_page(page_size: int, ratio: int) -> int:
  return max(page_size // ratio, 1)


def check_page_size(page_size: int, ratios) -> None:
  """Each compression ratio divides the page size or is a multiple of it (an entry then
  lives in one page); ``ValueError`` naming ``page_size`` otherwise."""
  bad = [m for m in ratios if page_size % m and m % page_size]
  if bad:
    raise ValueError(f"page_size {page_size} must be a multiple or a divisor of every "
                     f"compression ratio of the model ({sorted(set(ratios))}); "
                     f"{sorted(set(bad))} is neither")


def page_multiple(ratios) -> int:
  """The smallest page size that every ratio divides (a contiguous cache's is a multiple)."""
  return math.lcm(1, *ratios)


def check_positions(cache: V4Cache, new_lens_B, num_new: int, max_positions: int) -> None:
  """A contiguous step must fit its caches: positions past them would drop entries."""
  checks.new_tokens(jnp.asarray(new_lens_B), cache.num_cached_B, num_tokens=num_new,
                    capacity=cache.capacity, max_positions=max_positions)
