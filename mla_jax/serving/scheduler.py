"""Which tokens of which requests the next step computes: plain Python over integers, no jax.

Every running sequence has uncomputed tokens ``tokens[num_cached:]``: exactly one when it
decodes (its last sampled token, with the draft tokens to verify after it when it decodes
speculatively), more while its prompt (or, after a preemption, its prompt and
output) is prefilled. A step takes, oldest admission first, one token of each decode and then
chunks of prefills, under ``max_step_tokens`` (a step runs them all as one flat batch of
tokens: every token counts once, nothing is padded per sequence); waiting requests are
admitted first come first served while seats, budget and pages allow. A chunk that computes a
sequence's last token samples its next one. When a step holds plain decodes only,
``reserve_decode_steps`` takes pages for several decode steps at once (a multi-step
dispatch).

When a sequence needs a page and none is free, the most recently admitted running sequence is
preempted: its pages are released (full ones stay in the prefix cache) and it waits again at
the head of the queue, to be recomputed from its tokens. No request is ever lost or corrupted.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from mla_jax.decoding.stops import stop_reason
from mla_jax.serving.pages import PageTable, page_keys, pages_for
from mla_jax.serving.sequence import Sequence, Status
from mla_jax.serving.snapshots import Snapshots


@dataclasses.dataclass(slots=True, eq=False)
class Chunk:
  """``num_tokens`` tokens of ``seq`` from position ``num_cached``; ``samples``: it reaches the
  last token (known or in flight), so the step samples the sequence's next token. A decode
  (one token) may carry ``drafts`` to verify after it (speculative decoding). ``token_ids``:
  the tokens, -1 for one still being computed by the step in flight (a placeholder the program
  fills on the device). ``emits``: tokens the step is expected to give it (set on dispatch: 1,
  or a multi-step dispatch's steps up to its last allowed token; fewer only if it stops)."""

  seq: Sequence
  num_cached: int
  num_tokens: int
  drafts: tuple[int, ...] = ()
  samples: bool = False
  token_ids: list[int] = dataclasses.field(default_factory=list)
  emits: int = 0
  num_computed: int = 0  # rows the step computes: the tokens and the drafts
  snapshot: tuple[int, int] | None = None  # (state slot, position): save its state there

  @classmethod
  def of(cls, seq: Sequence, num_tokens: int, drafts: tuple[int, ...] = ()) -> Chunk:
    start, known = seq.num_cached, len(seq.tokens)
    ids = seq.tokens[start:start + num_tokens]
    if len(ids) < num_tokens:  # in flight (only ever a decode's one token)
      ids += [-1] * (num_tokens - len(ids))
    return cls(seq, start, num_tokens, drafts, start + num_tokens == known + seq.num_pending, ids,
               0, num_tokens + len(drafts))

  @property
  def rows(self) -> int:
    """Rows from ``num_cached`` the step may write (its pages): the computed ones and, for a
    speculative request's chunk that samples, the MTP rows of the next step's drafts (from
    past the accepted tokens; never past the request's last token, where drafting stops)."""
    k = self.seq.params.speculative_tokens
    if not self.samples or k == 0:
      return self.num_computed
    last = self.seq.num_prompt + self.seq.params.max_tokens  # rows [0, last) at most
    return max(self.num_computed,
               min(self.num_tokens + len(self.drafts) + k - 1, last - self.num_cached))


@dataclasses.dataclass
class StepBatch:
  decodes: list[Chunk] = dataclasses.field(default_factory=list)   # one token each
  prefills: list[Chunk] = dataclasses.field(default_factory=list)  # several tokens each
  decode_steps: int = 1  # decode steps the decodes' pages are reserved for

  @property
  def chunks(self) -> list[Chunk]:
    """Every chunk, in the order the step lays out their tokens."""
    return [*self.decodes, *self.prefills]

  def add(self, chunk: Chunk) -> None:
    (self.decodes if chunk.num_tokens == 1 else self.prefills).append(chunk)

  @property
  def decode_tokens(self) -> int:
    return sum(c.num_computed for c in self.decodes)

  @property
  def num_tokens(self) -> int:
    return self.decode_tokens + sum(c.num_tokens for c in self.prefills)

  def __bool__(self) -> bool:
    return bool(self.decodes or self.prefills)


class Scheduler:
  """Decodes first, then prefill chunks, under ``max_step_tokens`` (every token computed,
  drafts included, counts once)."""

  def __init__(self, pages: PageTable, *, max_num_seqs: int, max_step_tokens: int,
               prefix_caching: bool = True, snapshots: Snapshots | None = None):
    self.pages = pages
    self.snapshots = snapshots  # per-sequence state at page ends (a model with such state)
    self.max_num_seqs, self.max_step_tokens = max_num_seqs, max_step_tokens
    self.prefix_caching = prefix_caching
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.running: list[Sequence] = []  # in admission order
    self.num_preemptions = 0
    self.rows_dispatched = 0  # rows a dispatched step computes, ever (progress: stall guard)
    self.num_finished = 0
    self._free_slots = list(range(max_num_seqs))[::-1]  # a running sequence's persistent slot

  def add(self, seq: Sequence) -> None:
    self.waiting.append(seq)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running)

  def abort(self, seq: Sequence) -> None:
    """Removes ``seq`` wherever it is and frees its pages (a step in flight may still write
    them: every later step runs after it)."""
    self._end(seq, "abort")

  def _end(self, seq: Sequence, reason: str) -> None:
    if seq.status is Status.RUNNING:
      self.running.remove(seq)
    elif seq.status is Status.WAITING:
      self.waiting.remove(seq)
    self._release(seq)
    self._finish(seq, reason)
    self.num_finished += 1

  # ---- scheduling -----------------------------------------------------------------------

  def schedule(self) -> StepBatch:
    """This step's chunks. Tokens still in flight count as computed (their rows are being
    written) and as the sequences' own (a decode of one in flight reads it on the device); a
    sequence whose last allowed token is in flight is left out."""
    batch, budget = StepBatch(), self.max_step_tokens
    for seq in list(self.running):
      if budget == 0:
        break
      if seq.status is not Status.RUNNING or 0 < seq.params.max_tokens <= seq.num_output:
        continue  # preempted by an older sequence of this step; or all its tokens in flight
      if seq.num_uncomputed == 1:  # a decode, with as many of its drafts as the budget takes
        chunk = Chunk.of(seq, 1, tuple(seq.drafts[:budget - 1]))
      else:
        chunk = Chunk.of(seq, min(seq.num_uncomputed, budget))
      if chunk.num_tokens == 0 or not self._reserve(seq, chunk.rows, batch):
        continue
      batch.add(chunk)
      budget -= chunk.num_computed
    while self.waiting and budget and len(self.running) < self.max_num_seqs:
      seq = self.waiting[0]
      if seq.num_pending or not self._admit(seq):  # (its token in flight decides it first)
        break
      self.waiting.popleft()
      self.running.append(seq)
      seq.status = Status.RUNNING
      seq.slot = self._free_slots.pop()
      seq.admissions += 1
      chunk = Chunk.of(seq, min(seq.num_uncomputed, budget))
      self._reserve(seq, chunk.rows, batch)  # admission checked that all its rows fit
      batch.add(chunk)
      budget -= chunk.num_tokens
    return batch

  def dispatched(self, batch: StepBatch) -> StepBatch:
    """Records that ``batch`` was sent to the device: its rows count as computed and its
    samples as in flight (``commit`` settles them once read); sets each chunk's ``emits``.
    Returns the batch."""
    steps = batch.decode_steps
    for chunk in batch.chunks:
      seq = chunk.seq
      emits = 0
      if chunk.samples and seq.params.max_tokens:
        emits = min(steps, _tokens_left(seq)) if steps > 1 else 1
      advance = emits if steps > 1 else chunk.num_tokens
      seq.num_cached += advance
      seq.num_pending += emits
      seq.state_src = None  # its state is in its own slot from this step on
      self.rows_dispatched += advance
      self._register_full_pages(seq)
      chunk.emits = emits
    return batch

  def reserve_decode_steps(self, batch: StepBatch, steps: int) -> bool:
    """For a step of plain decodes only: pages for ``steps`` decode steps of each (never past
    a request's last token), taken only if the free pages hold them all; preempts nothing.
    True when reserved (``batch.decode_steps`` is then ``steps``)."""
    # (A one-token chunk of a prompt that does not reach its end is no decode: a step budget of
    # one token prefills that way.)
    if batch.prefills or not batch.decodes or any(c.drafts or not c.samples
                                                  for c in batch.decodes):
      return False
    size = self.pages.page_size
    extra = [max(0, pages_for(c.num_cached + min(steps, _tokens_left(c.seq)), size)
                 - len(c.seq.pages)) for c in batch.decodes]
    if sum(extra) > self.pages.num_free:
      return False
    for c, count in zip(batch.decodes, extra):
      c.seq.pages.extend(self.pages.allocate(count))
    batch.decode_steps = steps
    return True

  def _admit(self, seq: Sequence) -> bool:
    """Takes the longest cached prefix (leaving one token to compute, whose logits sample the
    next token) if the rest of the sequence's tokens fit the free pages; else nothing. A
    request that asks for prompt log-probabilities takes no prefix past the rows it has scored:
    pages hold keys, not log-probabilities, so its prompt is computed."""
    size = self.pages.page_size
    hits = []
    if self.prefix_caching:
      reusable = len(seq.tokens) - 1
      if seq.params.prompt_logprobs is not None:
        reusable = min(reusable, seq.num_scored)
      keys = page_keys(seq.tokens[:reusable], size, self.pages.salt)
      hits = self._restorable(seq, keys, self.pages.match(keys))
      seq.page_keys = keys[:len(hits)]
    # The whole sequence must fit, with the MTP rows of its first drafts (``Chunk.rows``).
    last = seq.num_prompt + seq.params.max_tokens
    reach = min(len(seq.tokens) + max(seq.params.speculative_tokens - 1, 0), last)
    if pages_for(reach, size) - len(hits) > self.pages.num_free:
      self.pages.release(hits)
      seq.page_keys, seq.state_src = [], None
      return False
    seq.pages = hits
    seq.num_cached = len(hits) * size
    if seq.num_preemptions == 0:
      seq.num_cached_prompt = seq.num_cached
    return True

  def _restorable(self, seq: Sequence, keys: list, hits: list[int]) -> list[int]:
    """The hit pages a sequence takes: all of them, or with per-sequence state, up to the
    last one whose end has a snapshot (``snapshots``), which its next step reads its state
    from (``seq.state_src``); the pages past it are released."""
    if self.snapshots is None:
      return hits
    taken = len(hits)
    while taken and self.snapshots.slot_of(keys[taken - 1]) is None:
      taken -= 1
    self.pages.release(hits[taken:])
    seq.state_src = self.snapshots.slot_of(keys[taken - 1]) if taken else None
    return hits[:taken]

  def plan_snapshots(self, batch: StepBatch) -> None:
    """With per-sequence state: each prefill chunk of ``batch`` (a step, not a multi-step
    dispatch) that crosses a page boundary of known tokens saves its state as of the last one
    it crosses into a snapshot slot (``Chunk.snapshot``), keyed by that page's prefix key;
    unless that page has one already (``snapshots`` module docstring). Called once the step's
    chunks are final, before its inputs are built."""
    if self.snapshots is None or batch.decode_steps > 1:
      return
    size = self.pages.page_size
    for c in batch.chunks:
      seq, end = c.seq, c.num_cached + c.num_tokens
      boundary = min(end, len(seq.tokens)) // size * size
      if boundary <= c.num_cached:
        continue
      done = len(seq.page_keys)  # registered pages: all before num_cached
      key = page_keys(seq.tokens, size, self.pages.salt, start=done,
                      parent=seq.page_keys[-1] if done else None, stop=boundary // size)[-1]
      slot = self.snapshots.take(key)
      if slot is not None:
        c.snapshot = (slot, boundary)

  def _reserve(self, seq: Sequence, count: int, batch: StepBatch) -> bool:
    """Pages for ``count`` more tokens of ``seq``, preempting newer sequences if need be;
    False when ``seq`` itself had to be preempted."""
    need = pages_for(seq.num_cached + count, self.pages.page_size) - len(seq.pages)
    if need <= 0:
      return True
    while need > self.pages.num_free:
      victim = self.running[-1]
      self._preempt(victim, batch)
      if victim is seq:
        return False
    seq.pages.extend(self.pages.allocate(need))
    return True

  def _preempt(self, seq: Sequence, batch: StepBatch) -> None:
    self.running.remove(seq)
    for chunks in (batch.decodes, batch.prefills):
      chunks[:] = [c for c in chunks if c.seq is not seq]
    self._release(seq)
    seq.status = Status.WAITING
    seq.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(seq)

  def _release(self, seq: Sequence) -> None:
    self.pages.release(seq.pages)
    if seq.slot is not None:
      self._free_slots.append(seq.slot)
    seq.pages, seq.page_keys, seq.num_cached, seq.drafts, seq.slot = [], [], 0, [], None
    seq.state_src = None

  # ---- after the step -------------------------------------------------------------------

  def commit(self, batch: StepBatch, sampled: dict[int, list[int]], stops
             ) -> list[tuple[Sequence, int]]:
    """Settles a dispatched step (``dispatched``'s batch) once its outputs are read: the new
    tokens (``sampled[id(chunk)]``: the sampled one, after the accepted drafts of a
    speculative decode), newly full pages into the prefix cache; ``stops(seq)`` is the finish
    reason after a new token, or None, and a sequence takes no token past its finish (the
    rows a later step computed for it are wasted, its pages freed now). A sequence that
    finished (or was aborted) since is skipped. Returns each sequence that got tokens, with
    how many (a request of ``max_tokens`` 0 finishes with none once its prompt is
    computed)."""
    grown = []
    for chunk in batch.chunks:
      seq = chunk.seq
      if seq.status is Status.FINISHED:
        continue
      if chunk.samples and (reason := stop_reason(None, (), 0, seq.params.max_tokens)):
        seq.first_token_time = time.perf_counter()  # scored its prompt, generates nothing
        grown.append((seq, 0))
        self._end(seq, reason)
        continue
      if not chunk.emits:
        continue
      new = sampled[id(chunk)]
      seq.num_pending -= chunk.emits
      reason, count = None, 0
      for count, token in enumerate(new, 1):
        seq.tokens.append(token)
        reason = stops(seq)
        if reason is not None:
          break
      if batch.decode_steps == 1 and seq.status is Status.RUNNING:
        seq.num_cached += count - 1  # a speculative decode's accepted drafts
      self._register_full_pages(seq)
      if seq.first_token_time is None:
        seq.first_token_time = time.perf_counter()
      grown.append((seq, count))
      if reason is not None:
        self._end(seq, reason)
    return grown

  def _register_full_pages(self, seq: Sequence) -> None:
    """Full pages of known tokens go into the prefix cache (their rows written, or being
    written by a step every later one follows)."""
    if not self.prefix_caching:
      return
    size, done = self.pages.page_size, len(seq.page_keys)
    full = min(seq.num_cached, len(seq.tokens)) // size
    if full <= done:
      return
    keys = page_keys(seq.tokens, size, self.pages.salt, start=done,
                     parent=seq.page_keys[-1] if done else None, stop=full)
    for page, key in zip(seq.pages[done:full], keys):
      self.pages.register(page, key)
    seq.page_keys.extend(keys)

  @staticmethod
  def _finish(seq: Sequence, reason: str) -> None:
    seq.status, seq.finish_reason = Status.FINISHED, reason
    seq.finish_time = time.perf_counter()


def _tokens_left(seq: Sequence) -> int:
  """Tokens a running sequence may still emit (those in flight counted as emitted)."""
  return seq.params.max_tokens - seq.num_output
