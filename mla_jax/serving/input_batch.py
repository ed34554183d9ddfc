"""The persistent input batch: each request's fixed settings and block table in host arrays by
its persistent slot, written when it takes the slot (and its table as pages are added), so a
step's inputs are a few vectorized gathers rather than a rebuild per field and request.
"""

from __future__ import annotations

import numpy as np

from mla_jax.serving.scheduler import Chunk
from mla_jax.serving.sequence import MAX_LOGIT_BIAS, Sequence
from mla_jax.serving.step_inputs import STOP_IDS, Layout, PackedInputs, Sampler, StepInputs

# Per-slot settings: (name, dtype, default) of what a request fixes once.
_SETTINGS = (("seeds", np.int32, 0), ("temperature", np.float32, 0.0), ("top_p", np.float32, 1.0),
             ("top_k", np.int32, 0), ("min_p", np.float32, 0.0), ("speculative", np.int32, 0),
             ("max_tokens", np.int32, 0), ("min_tokens", np.int32, 0),
             ("num_prompt", np.int32, 0), ("repetition", np.float32, 1.0),
             ("frequency", np.float32, 0.0), ("presence", np.float32, 0.0))


class InputBatch:
  """Builds each step's ``StepInputs`` from the scheduler's chunks over ``num_slots`` slots
  (``Sequence.slot``) and block tables ``max_pages`` wide."""

  def __init__(self, num_slots: int, max_pages: int):
    for name, dtype, default in _SETTINGS:
      setattr(self, name, np.full(num_slots, default, dtype))
    self.stop_ids = np.full((num_slots, STOP_IDS), -1, np.int32)
    self.bias_ids = np.full((num_slots, MAX_LOGIT_BIAS), -1, np.int32)
    self.bias = np.zeros((num_slots, MAX_LOGIT_BIAS), np.float32)
    self.table = np.zeros((num_slots, max_pages), np.int32)
    self._owner: list[tuple[Sequence, int] | None] = [None] * num_slots
    self._pages_written = np.zeros(num_slots, np.int64)

  def _claim(self, seq: Sequence) -> None:
    """Writes ``seq``'s settings into its slot the first time it is seen there (after each
    admission: a preempted request returns with new pages), and its block table's new
    pages."""
    slot = seq.slot
    if self._owner[slot] != (seq, seq.admissions):  # (compared by identity and admission)
      self._owner[slot] = (seq, seq.admissions)
      p = seq.params
      values = (seq.seed, p.temperature, p.top_p, p.top_k, p.min_p, p.speculative_tokens,
                p.max_tokens, p.min_tokens, seq.num_prompt, p.repetition_penalty,
                p.frequency_penalty, p.presence_penalty)
      for (name, _, _), value in zip(_SETTINGS, values):
        getattr(self, name)[slot] = value
      self.stop_ids[slot] = -1
      ids = seq.stop_ids[:STOP_IDS]
      self.stop_ids[slot, :len(ids)] = ids
      self.bias_ids[slot], self.bias[slot] = -1, 0.0
      if p.logit_bias:
        bias_ids, bias = zip(*p.logit_bias)
        self.bias_ids[slot, :len(bias_ids)], self.bias[slot, :len(bias)] = bias_ids, bias
      self._pages_written[slot] = 0
    written, pages = self._pages_written[slot], seq.pages
    if len(pages) != written:
      self.table[slot, written:len(pages)] = pages[written:]
      self._pages_written[slot] = len(pages)

  def build(self, chunks: list[Chunk], layout: Layout, decode_steps: int = 1) -> PackedInputs:
    """The chunks' tokens laid end to end, chunk b in step slot b; padding rows and slots
    compute nothing and sample nothing used. A multi-step dispatch's row s is chunk s's
    decode, its key blocks reaching the dispatch's last step. Written in place into the
    step's packed arrays."""
    packed = layout.zeros()
    x = packed.inputs
    n = len(chunks)
    if n == 0:
      return packed
    for c in chunks:
      self._claim(c.seq)
    slots = np.fromiter((c.seq.slot for c in chunks), np.int32, n)
    counts = np.fromiter((c.num_computed for c in chunks), np.int32, n)
    starts = np.fromiter((c.num_cached for c in chunks), np.int32, n)
    counters = np.fromiter((c.seq.num_output for c in chunks), np.int32, n)
    total = int(counts.sum())
    offsets = np.cumsum(counts, dtype=np.int32) - counts
    x.seq_T[:total] = np.repeat(np.arange(n, dtype=np.int32), counts)
    x.pos_T[:total] = np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int32)
    x.real_T[:total] = 1
    ids: list[int] = []
    for c in chunks:
      ids += c.token_ids
      ids += c.drafts
    x.ids_T[:total] = ids
    samples = np.fromiter((c.samples for c in chunks), bool, n)
    num_tokens = np.fromiter((c.num_tokens for c in chunks), np.int32, n)
    # A sampling chunk's logit rows: its last token, then its drafts.
    x.num_logits_S[:n] = samples * (counts - num_tokens + 1)
    x.logit_rows_SJ[:n, 0] = samples * (offsets + num_tokens - 1)
    for s, c in enumerate(chunks):
      if c.drafts and c.samples:
        first = offsets[s] + c.num_tokens - 1
        x.logit_rows_SJ[s, :len(c.drafts) + 1] = np.arange(first, first + len(c.drafts) + 1)
    x.slot_S[:n] = slots
    x.table_SN[:n] = self.table[slots]
    for name, source in (("seeds_S", self.seeds), ("temperature_S", self.temperature),
                         ("top_p_S", self.top_p), ("top_k_S", self.top_k),
                         ("min_p_S", self.min_p), ("speculative_S", self.speculative),
                         ("stop_ids_SM", self.stop_ids)):
      getattr(x, name)[:n] = source[slots]
    x.counters_S[:n] = counters
    x.remaining_S[:n] = self.max_tokens[slots] - counters
    if x.next_ids_T is not None:
      self._next_rows(chunks, offsets, x)
    if x.reach_T is not None:
      x.reach_T[:] = (x.pos_T + decode_steps) * x.real_T
    if x.state_src_S is not None:
      x.state_src_S[:n] = [slot if c.seq.state_src is None else c.seq.state_src
                           for c, slot in zip(chunks, slots.tolist())]
      for s, c in enumerate(chunks):
        if c.snapshot is not None:
          x.snapshot_S[s], x.snapshot_at_S[s] = c.snapshot
    if layout.shape.sampler is Sampler.FULL:
      x.min_left_S[:n] = np.maximum(self.min_tokens[slots] - counters, 0)
      x.bias_ids_SB[:n], x.bias_SB[:n] = self.bias_ids[slots], self.bias[slots]
      for name, source in (("repetition_S", self.repetition), ("frequency_S", self.frequency),
                           ("presence_S", self.presence), ("num_prompt_S", self.num_prompt)):
        getattr(x, name)[:n] = source[slots]
    return packed

  @staticmethod
  def _next_rows(chunks: list[Chunk], offsets, x: StepInputs) -> None:
    """The token after each row where the host knows it (a prompt's next token; a chunk that
    samples has none after its last one, a decode's are what its verification accepts): the
    MTP layers' pairs and the rows' scores; and each sampling row's logit row."""
    for c, t in zip(chunks, offsets.tolist()):
      if not c.drafts:
        following = c.seq.tokens[c.num_cached + 1:c.num_cached + c.num_tokens + 1]
        x.next_ids_T[t:t + len(following)] = following
      if c.samples and x.logit_row_T is not None:
        first = t + c.num_tokens - 1
        x.logit_row_T[first:t + c.num_computed] = np.arange(t + c.num_computed - first)
