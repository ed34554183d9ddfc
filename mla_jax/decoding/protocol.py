"""The decode protocol: what a model family implements so that every driver runs it.

``mla_jax.generate`` (contiguous caches, static batches), the engine (``mla_jax.serving``:
paged caches, continuous batching) and the server (on the engine) call a model only through
``DecodeModel``; ``CausalLM`` (DeepSeek-V3.2, GLM-5) and ``V4CausalLM`` (DeepSeek-V4) both
implement it. docs/design.md §13 says what a new family writes.

A family brings:

* **caches** as registered-dataclass pytrees, in two forms with one step over them:
  - contiguous (``init_cache(batch, capacity, dtype, spare)``): a batch of sequences, each
    knowing its cached length (``num_cached_B``; ``with_num_cached`` rolls it back or on);
  - paged (``init_pools``: what an engine keeps between steps; ``paged_cache(pools, rows)``:
    one flat step's view of them, ``FlatRows`` saying where each row lies; ``cache.pools``
    the pools after the step). Its page layout: ``check_page_size`` and whether it keeps
    per-sequence state beside the pages (``sequence_state``: rings that a prefix hit restores
    from a snapshot, ``FlatRows.state_src_S``);
* **one step** over a flat batch of token rows under a static plan:
  ``forward_hidden(ids_BT, caches, new_lens_B=..., plan=...) -> (hidden, caches)``, then
  ``logits(hidden[rows])`` for the rows a driver samples from. Contiguous: ``[B, T]`` rows
  after each sequence's cached length, ``new_lens_B`` of them real; paged: ``[T, 1]``, one
  token per row, the view holding each row's position and sequence;
* **static plans** (frozen, hashable: a compile-cache key): ``step_plan`` (contiguous) and
  ``flat_step_plan`` (paged), each with ``num_new_tokens`` and ``kv_rows``. What a plan
  may decide is fixed by the layer classes' capabilities, class-level constants (routes for
  MLA: ``supports_dense_mha_prefill``; selections for V4's layer types: ``compressed``,
  ``scored``, ``skips_complete_scoring``); ``dense_fresh_bound`` tells an engine whether,
  and up to how many tokens, a step of fresh sequences may take a dense route;
* optionally **MTP drafting**: ``num_mtp_layers`` > 0, ``init_mtp_cache``, ``mtp_forward``,
  ``mtp_logits`` (and ``mtp_paged_caches`` / ``mtp_pools_of`` for an engine's drafts).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlatRows:
  """Where the token rows of one engine step lie: what a family's ``paged_cache`` needs to
  read and write its pools for them.

  Per row t [T]: its sequence (step slot) ``seq_T`` and position ``pos_T``; the rows of a
  sequence are consecutive and in order. Per step slot s [S]: its block table ``table_SN``
  and its persistent slot ``slot_S`` (where its per-sequence state lives). ``key_blocks``:
  the indexer's (row, key chunk) pairs (``indexer.KeyBlocks``; None without). A family with
  per-sequence state also reads ``state_src_S`` (the state slot each sequence's state is
  read from at the step's start: its own, or a prefix hit's snapshot) and saves the state as
  of position ``snapshot_at_S`` into slot ``snapshot_S`` (-1: none). ``page_size``: tokens a
  page; ``context``: the ranks of a mesh's ``context`` axis the pools are split over.
  """

  seq_T: jax.Array
  pos_T: jax.Array
  table_SN: jax.Array
  slot_S: jax.Array
  page_size: int = dataclasses.field(metadata=dict(static=True))
  key_blocks: Any = None
  state_src_S: jax.Array | None = None
  snapshot_S: jax.Array | None = None
  snapshot_at_S: jax.Array | None = None
  context: int = dataclasses.field(default=1, metadata=dict(static=True))


@runtime_checkable
class DecodeModel(Protocol):
  """A model family every driver runs (module docstring)."""

  backend: Any
  mesh: Any

  @property
  def vocab_size(self) -> int: ...

  @property
  def max_positions(self) -> int: ...

  @property
  def num_mtp_layers(self) -> int: ...

  @property
  def sequence_state(self) -> bool: ...

  @property
  def key_chunk(self) -> int | None: ...

  def init_cache(self, batch_size: int, capacity: int, dtype=..., spare: int = 0): ...

  def init_mtp_cache(self, batch_size: int, capacity: int, dtype=..., spare: int = 0): ...

  def init_pools(self, num_rows: int, cache_dtype, *, page_size: int | None,
                 num_state_slots: int, mtp: bool): ...

  def paged_cache(self, pools, rows: FlatRows): ...

  def check_page_size(self, page_size: int) -> None: ...

  def step_plan(self, num_new_tokens: int, num_cached_tokens: int | None, *, capacity: int,
                kv_rows: int | None = None): ...

  def flat_step_plan(self, fresh_tokens: int | None, *, kv_rows: int,
                     key_chunk: int | None = None, context_topk: str = "exact"): ...

  def dense_fresh_bound(self, max_step_tokens: int, max_model_len: int,
                        page_size: int) -> int | None: ...

  def plan_layers(self, plan) -> list: ...

  def forward_hidden(self, ids_BT, caches, *, new_lens_B, plan): ...

  def logits(self, hidden): ...

  def __call__(self, ids_BT, caches, *, new_lens_B=None, plan=None,
               return_hidden: bool = False): ...


def check_decode_model(model, what: str = "model") -> None:
  """A ``TypeError`` naming ``model``'s type unless it implements ``DecodeModel``."""
  if not isinstance(model, DecodeModel):
    raise TypeError(f"{what} must be a CausalLM, got {type(model).__name__} (or another "
                    "DecodeModel, such as a V4CausalLM: a whole language model, "
                    "mla_jax.decoding.protocol; call a single layer directly)")
