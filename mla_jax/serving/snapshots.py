"""Snapshots of per-sequence state for prefix hits: which state slot holds a sequence's state as
of the end of which cached page. Pure Python over integers, like the page table.

A family with per-sequence state (``DecodeModel.sequence_state``: DeepSeek-V4's window rings
and compressor state) keeps a running sequence's state in the state slot of its persistent
slot, beside its pages. A prefix hit restores the compressed entries from the pages, but the
state as of the hit's end is no running sequence's. So a step whose prefill chunk crosses a
page boundary also saves the state as of its last boundary into a snapshot slot, keyed by that
page's prefix key (``Scheduler.plan_snapshots``); a hit ends at the last matched page that has
one, and its first step reads its state from there (``Sequence.state_src``). Why snapshots and
not recomputing the last window of tokens: a layer's window rows at the hit's end depend on the
layer below's rows a window earlier, and so on down the layers, so no bounded recompute is
exact; a snapshot is, by construction.

Snapshots are fewer than pages (a V4-Flash one is a sequence's whole state, 11.2 MiB in bf16,
beside 6,880 B per cached token), kept least recently used: a taken or matched one moves to
the back, and taking one when none is free evicts the front. A page whose snapshot was evicted
stays a prefix page; hits end before it.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable


class Snapshots:
  """``count`` snapshot slots, the state slots from ``first_slot`` on."""

  def __init__(self, first_slot: int, count: int):
    self._free = collections.deque(range(first_slot, first_slot + count))
    self._slot_of: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._slot_of)

  def slot_of(self, key: Hashable) -> int | None:
    """The slot holding the state as of page ``key``'s end (now the most recently used), or
    None."""
    slot = self._slot_of.get(key)
    if slot is not None:
      self._slot_of.move_to_end(key)
    return slot

  def take(self, key: Hashable) -> int | None:
    """A slot to save the state as of page ``key``'s end into: None when one holds it
    already or there are no snapshot slots; else a free one, or the least recently used."""
    if key in self._slot_of or not (self._free or self._slot_of):
      return None
    if self._free:
      slot = self._free.popleft()
    else:
      _, slot = self._slot_of.popitem(last=False)
    self._slot_of[key] = slot
    return slot
