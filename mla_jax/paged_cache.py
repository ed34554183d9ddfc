"""Paged caches: a layer group's latent rows and indexer keys in a shared pool of pages.

The engine (``mla_jax.serving``) keeps, per layer group and unit position, one pool over the
group's repetitions, their rows flattened into one axis: ``[reps * num_pages * page_size, ...]``
(layer r's rows from ``r * num_pages * page_size``) in any cache format (fp32 / bf16 arrays, or
the fp8 layouts of ``mla_jax.fp8_cache``). Each step hands the model a block table ``[B, N]``
(page ids, logical page n of sequence b at physical page ``block_table[b, n]``) and the cached
lengths; ``PagedLayerView`` is one layer of it, read and written through the same ``CacheView``
protocol as the contiguous caches.

Where logical positions become physical rows (docs/design.md §7):

* ``write`` scatters each new row to its physical slot: nothing else is touched.
* the indexer scores a sequence's keys in place: ``index_keys`` gives the whole key pool and
  the physical row of every position, and the op reads each sequence's rows straight from the
  pool (``Backend.indexer_logits(..., key_rows_BS=...)``);
* top-k indices stay logical until the sparse MQA gather: ``attention_rows`` translates them to
  physical rows of the pool, and the op reads those rows straight from the pool.

Neither the keys nor the latent context is copied into a contiguous buffer on the sparse
route; only ``rows`` gathers a sequence's rows, for the dense-MHA route (which decompresses
every row anyway) and the training loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mla_jax import fp8_cache
from mla_jax.cache import CacheView, _readable, _row_array, empty_layer_cache, scatter_part
from mla_jax.config import MLAConfig
from mla_jax.indexer import KeyBlocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayerCache:
  """One unit position of a layer group over a page pool, shared by the group's reps.

  The pools keep the layers' rows in one flat axis, the form the ops read (as XLA updates a
  pool in place only when it is written and read in one shape: a reshape between the write and
  an indexer loop's read costs a copy of the whole pool per step).

  Attributes:
    latent_RL: pool rows [reps * num_pages * page_size, A + R] (an array or fp8 parts).
    index_keys_RI: the indexer keys' pool, or None for a layer without a key cache.
    block_table_BN: int32 [B, N], shared by every layer: the physical page of each logical page.
    num_cached_B: int32 [reps, B] cached tokens per sequence (the same in every layer).
    page_size: tokens per page (static).
    reps: the group's layers sharing the pools (static), each ``rows / reps`` of them.
    segment_ids_B: int32 [B] or None. In an engine's flat step each row b is one token of
      sequence ``segment_ids_B[b]`` (rows of one sequence share its block table, and
      ``num_cached_B`` is then each token's position); the segmented dense route attends within
      segments (``StepPlan.segmented``). None: every row is a sequence of its own.
    context: the ranks of a mesh's ``context`` axis that the pools' rows are split over
      (static; 1: one block). Rows are laid out rank-major: block r holds, for each of the
      reps layers in turn, the pages p with ``p % context == r`` in order (page p is page
      ``p // context`` of its block), so each rank's block is one contiguous slice of rows
      (``sharding.POOL_SPEC``) and a sequence's consecutive pages lie on every rank in turn.
      The pages must divide into the ranks.
  """

  latent_RL: jax.Array
  index_keys_RI: jax.Array | None
  block_table_BN: jax.Array
  num_cached_B: jax.Array
  page_size: int = dataclasses.field(metadata=dict(static=True))
  segment_ids_B: jax.Array | None = None
  key_blocks: KeyBlocks | None = None
  reps: int = dataclasses.field(default=1, metadata=dict(static=True))
  context: int = dataclasses.field(default=1, metadata=dict(static=True))

  @property
  def rows_per_layer(self) -> int:
    return _row_array(self.latent_RL).shape[0] // self.reps

  def layer_view(self, index) -> PagedLayerView:
    return PagedLayerView(self, index)

  @property
  def pools(self):
    """The pool arrays alone (what the engine keeps between steps)."""
    return self.latent_RL, self.index_keys_RI

  @property
  def num_cached_shape(self) -> tuple[int, ...]:
    return (self.reps, self.block_table_BN.shape[0])


@dataclasses.dataclass(frozen=True)
class PagedLayerView(CacheView):
  """Layer ``index`` of a ``PagedLayerCache``: a ``CacheView`` of capacity ``N * page_size``."""

  stacked: PagedLayerCache
  index: jax.Array

  @property
  def num_cached_B(self):
    return self.stacked.num_cached_B[self.index]

  @property
  def batch_size(self) -> int:
    return self.stacked.block_table_BN.shape[0]

  @property
  def capacity(self) -> int:
    return self.stacked.block_table_BN.shape[1] * self.stacked.page_size

  @property
  def buffers(self) -> PagedLayerCache:
    return self.stacked

  @property
  def segment_ids_B(self):
    return self.stacked.segment_ids_B

  def physical_rows(self, positions, table=None):
    """Pool rows (within a layer) of logical ``positions`` [B, ...] (of the sequences of
    ``table``'s rows: the block table's by default); -1 stays -1."""
    page = self.stacked.page_size
    table = self.stacked.block_table_BN if table is None else table
    safe = jnp.clip(positions, 0, self.capacity - 1)
    pages = jnp.take_along_axis(table, (safe // page).reshape(table.shape[0], -1), axis=1)
    rows = pages.reshape(positions.shape) * page + safe % page
    return jnp.where(positions >= 0, rows, -1)

  def _gather(self, part, rows_BS):
    """Rows ``rows_BS`` of this layer of a pool part: [B, S, ...] (only those rows are read)."""
    return jax.tree.map(lambda a: a[self._flat_rows(rows_BS)], part)

  def _positions(self, num_rows: int):
    """Logical positions ``[0, num_rows)`` of every sequence: int32 [B, num_rows]."""
    return jnp.broadcast_to(jnp.arange(num_rows, dtype=jnp.int32), (self.batch_size, num_rows))

  def rows(self, num_rows: int):
    rows_BS = self.physical_rows(self._positions(num_rows))
    keys = self.stacked.index_keys_RI
    return _readable((self._gather(self.stacked.latent_RL, rows_BS),
                      None if keys is None else self._gather(keys, rows_BS)))

  def latent_rows_at(self, positions_BT):
    """The stored latent rows (readable, fp8 as ``Fp8LatentRows``) at logical
    ``positions_BT`` of each row's sequence: [B, T, L] (only those rows are read)."""
    return fp8_cache.readable(self._gather(self.stacked.latent_RL,
                                           self.physical_rows(positions_BT)))

  def _in_flat_pool(self, part, rows):
    """The whole pool ``part`` and this layer's ``rows`` as rows of it (-1 stays -1): what
    the ops read in place."""
    return fp8_cache.readable(part), self._flat_rows(rows)

  def _flat_rows(self, rows):
    """This layer's pool rows ``rows`` (-1 stays -1) as rows of the shared pool (its layout:
    ``PagedLayerCache.context``)."""
    stacked = self.stacked
    per_layer, ranks = stacked.rows_per_layer, stacked.context
    if ranks == 1:
      return jnp.where(rows >= 0, rows + self.index * per_layer, -1)
    page, slot = rows // stacked.page_size, rows % stacked.page_size
    rank_rows = per_layer // ranks  # one layer's rows in one block
    flat = ((page % ranks) * (stacked.reps * rank_rows) + self.index * rank_rows
            + (page // ranks) * stacked.page_size + slot)
    return jnp.where(rows >= 0, flat, -1)

  def attention_rows(self, topk_BTK, num_rows: int):
    """The latent pool and the physical rows of ``topk_BTK``: the op gathers the selected
    rows from the pool itself."""
    latent, rows_BTK = self._in_flat_pool(self.stacked.latent_RL, self.physical_rows(topk_BTK))
    return latent, rows_BTK, False

  def index_keys(self, num_rows: int):
    """The key pool and the physical rows of positions ``[0, num_rows)``: the indexer reads
    each sequence's keys from the pool itself."""
    keys = self.stacked.index_keys_RI
    if keys is None:
      return None, None
    return self._in_flat_pool(keys, self.physical_rows(self._positions(num_rows)))

  def index_key_pool(self):
    """The whole key pool (layers flattened into rows) and ``rows_of(rows_N, positions_NC)``:
    the rows in it of logical key positions of row ``rows_N``'s sequence; the indexer scores a
    flat step's key blocks through it (``Indexer.select_in_blocks``)."""
    keys, table = self.stacked.index_keys_RI, self.stacked.block_table_BN
    rows_of = lambda rows_N, positions_NC: self._flat_rows(
        self.physical_rows(positions_NC, table[rows_N]))
    return fp8_cache.readable(keys), rows_of

  def write(self, latent_BTL, keys_BTI, new_lens_B) -> PagedLayerView:
    num_cached_B = self.num_cached_B
    t_T = jnp.arange(latent_BTL.shape[1], dtype=jnp.int32)
    positions_BT = num_cached_B[:, None] + t_T[None, :]
    real_BT = (t_T[None, :] < new_lens_B[:, None]) & (positions_BT < self.capacity)
    past_pool = _row_array(self.stacked.latent_RL).shape[0]  # scattered there: dropped
    dest_BT = jnp.where(real_BT, self._flat_rows(self.physical_rows(positions_BT)), past_pool)
    write_part = lambda stored, new: scatter_part(stored, new, dest_BT)
    keys = self.stacked.index_keys_RI
    stacked = dataclasses.replace(
        self.stacked, latent_RL=write_part(self.stacked.latent_RL, latent_BTL),
        index_keys_RI=None if keys is None else write_part(keys, keys_BTI),
        num_cached_B=self.stacked.num_cached_B.at[self.index].set(num_cached_B + new_lens_B))
    return PagedLayerView(stacked, self.index)


def empty_pools(config: MLAConfig, reps: int, num_rows: int, dtype, *, index_keys: bool):
  """``(latent, keys or None)`` pools of ``num_rows`` zero rows per layer for ``reps`` layers,
  in the resolved cache format ``dtype`` (``cache.resolve_cache_dtype``): the contiguous
  cache's layouts, the group's layers flattened into the rows (``PagedLayerCache``)."""
  layer = empty_layer_cache(config, reps, num_rows, dtype, index_keys=index_keys)
  flat = lambda part: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), part)
  return flat(layer.latent_BSL), flat(layer.index_keys_BSI)
