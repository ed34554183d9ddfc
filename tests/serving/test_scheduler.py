"""The scheduler, driven by a fake engine: every step's chunks are checked against a model of the
page pool (which rows each physical page holds), so a step that reads a wrong cached row, writes
into a shared page, loses or repeats a token, or overruns the budget fails the test."""

import random

import pytest

from mla_jax.serving.pages import PageTable, pages_for
from mla_jax.serving.scheduler import Scheduler
from mla_jax.serving.sequence import SamplingParams, Sequence, Status

SIZE = 4


def _token(seq):
  """The fake model's next token: a function of the request and the position only, so the
  expected output is known and a recompute after preemption must give the same tokens."""
  return _token_at(seq.request_id, len(seq.tokens))


def _token_at(request_id, position):
  return (position * 31 + int(request_id)) % 97


def _expected(seq):
  return [_token_at(seq.request_id, seq.num_prompt + i) for i in range(seq.params.max_tokens)]


def _stops(seq):
  return "length" if len(seq.output) >= seq.params.max_tokens else None


class Loop:
  """The engine loop without a model: schedule, check the chunks against the pool, write their
  rows (a row is the token prefix it depends on), dispatch, sample ``_token`` and commit.
  ``lag``: the engine's asynchronous order, each step committed only after the next one is
  scheduled and dispatched (its tokens in flight meanwhile: a decode of one reads it as a
  placeholder, and the fake model knows what it will be)."""

  def __init__(self, num_pages, *, max_num_seqs=8, max_step_tokens=16, prefix_caching=True,
               lag=False, **scheduler_options):
    self.pages = PageTable(num_pages, SIZE, salt="test")
    self.scheduler = Scheduler(self.pages, max_num_seqs=max_num_seqs,
                               max_step_tokens=max_step_tokens, prefix_caching=prefix_caching,
                               **scheduler_options)
    self.lag, self.in_flight = lag, None
    self.rows = {}  # (page, offset) -> tuple of the tokens that row depends on
    self.seqs = []
    self.streamed = {}  # request id -> the tokens commit reported, in order
    self.cached_at_admission = {}  # request id -> the first chunk's num_cached

  def add(self, prompt, max_tokens=4):
    seq = Sequence(str(len(self.seqs)), list(prompt), len(prompt),
                   SamplingParams(max_tokens=max_tokens), seed=0)
    self.seqs.append(seq)
    self.scheduler.add(seq)
    return seq

  def step(self):
    scheduler = self.scheduler
    batch = scheduler.schedule()
    chunks = [*batch.decodes, *batch.prefills]
    assert batch.num_tokens <= scheduler.max_step_tokens
    assert all(c.num_tokens == 1 for c in batch.decodes)
    assert all(c.num_tokens > 1 for c in batch.prefills)
    assert len({id(c.seq) for c in chunks}) == len(chunks) <= scheduler.max_num_seqs
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert len({c.seq.slot for c in chunks}) == len(chunks)  # persistent slots of their own
    for chunk in chunks:
      self.cached_at_admission.setdefault(chunk.seq.request_id, chunk.num_cached)
      self._compute(chunk)
    dispatched = scheduler.dispatched(batch) if batch else None
    if self.lag:
      dispatched, self.in_flight = self.in_flight, dispatched
    if dispatched is not None:
      self._commit(dispatched)
    self.pages.check()
    return batch

  def _commit(self, batch):
    live = [c for c in batch.chunks if c.emits and c.seq.status is not Status.FINISHED]
    grown = self.scheduler.commit(
        batch, {id(c): [_token_at(c.seq.request_id, c.num_cached + c.num_tokens)]
                for c in live}, _stops)
    assert grown == [(c.seq, 1) for c in live]
    for seq, _ in grown:
      self.streamed.setdefault(seq.request_id, []).append(seq.tokens[-1])

  def _compute(self, chunk):
    seq, num_cached, end = chunk.seq, chunk.num_cached, chunk.num_cached + chunk.num_tokens
    assert seq.status is Status.RUNNING and seq in self.scheduler.running
    assert num_cached == seq.num_cached and 0 < chunk.num_tokens
    assert end <= len(seq.tokens) + seq.num_pending
    # Never the row of a last allowed token: no step after it reads it.
    assert end <= seq.num_prompt + max(seq.params.max_tokens - 1, 0)
    assert len(seq.pages) >= pages_for(end, SIZE)
    # A token in flight is a placeholder; the fake model's output there is known.
    tokens = seq.tokens + [_token_at(seq.request_id, p) for p in range(len(seq.tokens), end)]
    assert chunk.token_ids == [t if p < len(seq.tokens) else -1
                               for p, t in enumerate(tokens[num_cached:end], num_cached)]
    for pos in range(num_cached):  # the rows the chunk attends to, cached or computed before
      assert self.rows[self._row(seq, pos)] == tuple(tokens[:pos + 1])
    for pos in range(num_cached, end):  # written only into pages no other sequence reads
      assert self.pages.refcount(seq.pages[pos // SIZE]) == 1
      self.rows[self._row(seq, pos)] = tuple(tokens[:pos + 1])

  @staticmethod
  def _row(seq, pos):
    return seq.pages[pos // SIZE], pos % SIZE

  def run(self, max_steps=500):
    steps, idle = 0, 0
    while self.scheduler.has_unfinished() or self.in_flight is not None:
      batch = self.step()
      assert batch or self.lag, "a step with unfinished requests scheduled nothing"
      # One step late, a sequence waits for its token in flight (a preempted one), or all its
      # tokens are in flight: it is scheduled again once that step is committed.
      idle = 0 if batch or self.in_flight is not None else idle + 1
      assert idle < 2, "nothing in flight and nothing scheduled"
      steps += 1
      assert steps < max_steps
    return steps

  def assert_all_done(self):
    for seq in self.seqs:
      assert seq.status is Status.FINISHED and not seq.pages
      assert seq.output == self.streamed.get(seq.request_id, [])  # nothing lost or repeated
      assert seq.num_cached_prompt == self.cached_at_admission.get(seq.request_id, 0)
      if seq.finish_reason == "length":
        assert seq.output == _expected(seq)
      else:
        assert seq.finish_reason == "abort" and seq.output == _expected(seq)[:len(seq.output)]
    assert self.pages.num_free == self.pages.num_pages
    self.pages.check()


def _prompt(n, first=0):
  return list(range(first, first + n))


# ---- budget, chunks, seats, pages ----------------------------------------------------------------


def test_a_long_prompt_is_chunked_under_the_budget_then_decodes():
  loop = Loop(16, max_step_tokens=8)
  seq = loop.add(_prompt(20), max_tokens=3)
  for num_cached, count, num_output in [(0, 8, 0), (8, 8, 0), (16, 4, 1)]:
    chunk, = loop.step().prefills
    assert (chunk.num_cached, chunk.num_tokens, len(seq.output)) == (num_cached, count, num_output)
  for num_cached in (20, 21):
    chunk, = loop.step().decodes
    assert chunk.num_cached == num_cached
  loop.run()
  loop.assert_all_done()


def test_decodes_come_first_and_prefills_fill_the_budget():
  loop = Loop(16, max_step_tokens=6)
  a = loop.add(_prompt(3), max_tokens=5)
  loop.step()
  b = loop.add(_prompt(10, first=50))
  batch = loop.step()
  assert [(c.seq, c.num_cached) for c in batch.decodes] == [(a, 3)]
  assert [(c.seq, c.num_cached, c.num_tokens) for c in batch.prefills] == [(b, 0, 5)]
  loop.run()
  loop.assert_all_done()


def test_prefill_chunks_fill_the_budget_token_for_token():
  """A step is one flat batch of tokens: chunks of 40 and 3 tokens and the first 21 of 30 make
  64 tokens, nothing padded per sequence; the rest of the 30 follows beside the decodes."""
  loop = Loop(64, max_num_seqs=8, max_step_tokens=64)
  loop.add(_prompt(40), max_tokens=2)
  loop.add(_prompt(3, first=60), max_tokens=2)
  loop.add(_prompt(30, first=70), max_tokens=2)
  first = loop.step()
  assert [c.num_tokens for c in first.prefills] == [40, 3, 21] and first.num_tokens == 64
  second = loop.step()  # 2 decodes, then the last 9 tokens of the 30
  assert len(second.decodes) == 2 and [c.num_tokens for c in second.prefills] == [9]
  loop.run()
  loop.assert_all_done()


def test_decode_steps_are_reserved_only_when_every_decode_fits():
  """A multi-step decode dispatch takes pages for every decode's next steps (never past its
  last token) up front, or none at all; a step with a prefill chunk never reserves."""
  loop = Loop(7, max_num_seqs=2, max_step_tokens=16)
  a, b = loop.add(_prompt(3), max_tokens=9), loop.add(_prompt(4, first=20), max_tokens=2)
  batch = loop.step()  # the prefills
  assert not loop.scheduler.reserve_decode_steps(batch, 8)
  batch = loop.scheduler.schedule()  # two decodes, at positions 3 and 4
  assert loop.scheduler.reserve_decode_steps(batch, 8) and batch.decode_steps == 8
  # a: rows 3..10 (three pages); b: rows 4..4, its last token (two pages).
  assert (len(a.pages), len(b.pages)) == (pages_for(3 + 8, SIZE), pages_for(4 + 1, SIZE))
  assert loop.pages.num_free == 7 - 5
  tight = Loop(4, max_num_seqs=2, max_step_tokens=16)
  c = tight.add(_prompt(3), max_tokens=20)
  tight.step()
  batch = tight.scheduler.schedule()
  assert not tight.scheduler.reserve_decode_steps(batch, 16)  # 19 rows: 5 pages of 4
  assert batch.decode_steps == 1 and len(c.pages) == 1


def test_max_num_seqs_bounds_the_running_set():
  loop = Loop(64, max_num_seqs=2, max_step_tokens=32)
  seqs = [loop.add(_prompt(5, first=10 * i), max_tokens=3) for i in range(5)]
  loop.step()
  assert loop.scheduler.running == seqs[:2] and list(loop.scheduler.waiting) == seqs[2:]
  loop.run()  # Loop.step checks the bound at every step
  loop.assert_all_done()


def test_admission_waits_for_pages():
  loop = Loop(4, max_step_tokens=32)
  a = loop.add(_prompt(12), max_tokens=2)  # 3 of the 4 pages
  b = loop.add(_prompt(8, first=50), max_tokens=2)  # 2 pages: does not fit beside a
  loop.step()
  assert loop.scheduler.running == [a] and b.status is Status.WAITING and not b.pages
  while a.status is not Status.FINISHED:
    assert b.status is Status.WAITING
    loop.step()
  loop.run()
  assert loop.scheduler.num_preemptions == 0
  loop.assert_all_done()


def test_preemption_when_the_pool_is_too_small_for_all():
  loop = Loop(6, max_step_tokens=16)
  for i in range(4):
    loop.add(_prompt(6, first=20 * i), max_tokens=10)  # 4 pages each at the end
  loop.run()
  assert loop.scheduler.num_preemptions > 0
  assert sum(seq.num_preemptions for seq in loop.seqs) == loop.scheduler.num_preemptions
  loop.assert_all_done()


def test_the_newest_sequence_is_preempted_and_waits_at_the_head_of_the_queue():
  loop = Loop(4, max_num_seqs=2)
  a, b, c = (loop.add(_prompt(4, first=10 * i), max_tokens=8) for i in range(3))
  while not loop.scheduler.num_preemptions:
    loop.step()
  assert loop.scheduler.running == [a] and list(loop.scheduler.waiting) == [b, c]
  assert (b.status, b.pages, b.num_cached, b.num_preemptions) == (Status.WAITING, [], 0, 1)
  loop.run()
  loop.assert_all_done()


# ---- the prefix cache ---------------------------------------------------------------------


@pytest.mark.parametrize("shared, extra, hits", [
    (8, 3, 2),   # two full pages shared, then different tokens
    (9, 0, 2),   # the same 9 tokens: both full pages hit, the last token is computed
    (8, 0, 1),   # the same 8 tokens: one page hits so that one token is left to compute
    (3, 6, 0),   # less than a page shared: nothing
])
def test_a_shared_full_page_prefix_is_not_recomputed(shared, extra, hits):
  loop = Loop(16, max_step_tokens=32)
  loop.add(_prompt(shared), max_tokens=1)
  loop.run()
  seq = loop.add(_prompt(shared) + _prompt(extra, first=60), max_tokens=2)
  batch = loop.step()
  chunk, = batch.decodes + batch.prefills
  assert chunk.num_cached == seq.num_cached_prompt == hits * SIZE
  assert chunk.num_tokens == seq.num_prompt - hits * SIZE >= 1
  loop.run()
  loop.assert_all_done()


def test_a_running_sequence_shares_its_registered_pages():
  loop = Loop(16, max_step_tokens=32)
  a = loop.add(_prompt(10), max_tokens=6)
  loop.step()
  b = loop.add(_prompt(10), max_tokens=6)
  loop.step()
  assert b.pages[:2] == a.pages[:2] and b.num_cached_prompt == 8
  assert [loop.pages.refcount(p) for p in a.pages[:2]] == [2, 2]
  loop.run()
  loop.assert_all_done()


def test_without_prefix_caching_nothing_is_shared():
  loop = Loop(16, max_step_tokens=32, prefix_caching=False)
  loop.add(_prompt(10), max_tokens=1)
  loop.run()
  seq = loop.add(_prompt(10), max_tokens=1)
  assert loop.step().prefills[0].num_cached == 0 and seq.num_cached_prompt == 0
  assert loop.pages.num_cached == 0
  loop.assert_all_done()


# ---- aborts -------------------------------------------------------------------------------


def test_abort_of_a_waiting_sequence():
  loop = Loop(4, max_num_seqs=1)
  a, b = loop.add(_prompt(5)), loop.add(_prompt(5, first=30))
  loop.step()
  loop.scheduler.abort(b)
  assert b.finish_reason == "abort" and b not in loop.scheduler.waiting
  loop.run()
  loop.assert_all_done()
  assert a.finish_reason == "length" and b.output == []


def test_abort_of_a_running_sequence_frees_its_pages():
  loop = Loop(8, max_step_tokens=4)
  seq = loop.add(_prompt(14), max_tokens=4)
  loop.step()
  assert seq.pages and loop.pages.num_in_use == 1
  loop.step()
  loop.scheduler.abort(seq)
  assert not loop.scheduler.has_unfinished() and seq.status is Status.FINISHED
  assert loop.pages.num_in_use == 0 and loop.pages.num_cached == 2  # its full pages stay cached
  loop.assert_all_done()


@pytest.mark.parametrize("lag", [False, True], ids=["in-step", "one-step-late"])
@pytest.mark.parametrize("seed", range(8))
def test_random_requests_and_aborts_leave_every_page_free(seed, lag):
  """Random arrivals, prefixes, budgets, preemptions and aborts; committed in the step or one
  step late (the engine's asynchronous order: aborts and preemptions land on sequences whose
  token is in flight)."""
  rng = random.Random(seed)
  loop = Loop(rng.randint(6, 9), max_num_seqs=rng.randint(2, 6),
              max_step_tokens=rng.randint(1, 16), lag=lag)
  prefixes = [_prompt(rng.randint(0, 9), first=10 * i) for i in range(3)]
  for _ in range(60):
    if rng.random() < 0.5:
      prompt = rng.choice(prefixes) + _prompt(rng.randint(1, 6), first=rng.randrange(90))
      loop.add(prompt, max_tokens=rng.randint(1, 8))  # fits the pool alone: 6 pages or less
    live = [s for s in loop.seqs if s.status is not Status.FINISHED]
    if live and rng.random() < 0.05:
      loop.scheduler.abort(rng.choice(live))
    if loop.scheduler.has_unfinished():
      assert loop.step() or lag
  loop.run()
  loop.assert_all_done()


# ---- SamplingParams -----------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -1), ("max_tokens", 2.0), ("max_tokens", True),
    ("temperature", -0.5), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("seed", -1), ("seed", 2**31), ("seed", 1.5),
    ("stop_token_ids", (3, -1)), ("stop_token_ids", ("a",)), ("stop_token_ids", 7),
    ("stop", ("",)), ("stop", ("ok", 5)), ("stop", ""), ("stop", None),
])
def test_sampling_params_name_the_bad_field(field, value):
  with pytest.raises((TypeError, ValueError), match=field):
    SamplingParams(**{field: value})


def test_sampling_params_normalize_their_values():
  params = SamplingParams(temperature=1, top_p=1, stop_token_ids=[2, 3], stop="end", seed=0)
  assert (params.temperature, params.top_p) == (1.0, 1.0)
  assert params.stop_token_ids == (2, 3) and params.stop == ("end",)


def test_a_speculative_decode_reserves_its_draft_rows_and_commits_the_accepted_tokens():
  """A decode with 2 drafts (k = 3) computes 3 rows and may write 2 + 3 (the next drafts' MTP
  rows, never past its last token): its pages cover them. Committing 2 accepted drafts and the
  next token computes 3 rows; a stop token inside a step drops the tokens after it."""
  pages = PageTable(16, SIZE, salt="test")
  scheduler = Scheduler(pages, max_num_seqs=2, max_step_tokens=16)
  seq = Sequence("0", [1, 2, 3], 3, SamplingParams(max_tokens=8, speculative_tokens=3), seed=0)
  scheduler.add(seq)
  batch = scheduler.dispatched(scheduler.schedule())
  scheduler.commit(batch, {id(batch.prefills[0]): [7]}, _stops)
  seq.drafts = [8, 9]
  batch = scheduler.schedule()
  (chunk,) = batch.decodes
  assert (chunk.num_cached, chunk.num_computed, chunk.rows, chunk.drafts) == (3, 3, 5, (8, 9))
  assert batch.num_tokens == 3 and len(seq.pages) == pages_for(3 + 5, SIZE)
  batch = scheduler.dispatched(batch)
  (chunk,) = batch.decodes
  assert scheduler.commit(batch, {id(chunk): [8, 9, 5]}, _stops) == [(seq, 3)]
  assert seq.tokens == [1, 2, 3, 7, 8, 9, 5] and seq.num_cached == 6
  seq.drafts = [6, 6, 6]  # as many as the 4 tokens left allow; their MTP rows stop at the last
  batch = scheduler.schedule()
  (chunk,) = batch.decodes
  assert chunk.rows == seq.num_prompt + 8 - chunk.num_cached
  batch = scheduler.dispatched(batch)
  (chunk,) = batch.decodes
  stop = lambda s: "stop" if s.tokens[-1] == 4 else _stops(s)
  assert scheduler.commit(batch, {id(chunk): [6, 4, 6]}, stop) == [(seq, 2)]
  assert seq.output == [7, 8, 9, 5, 6, 4] and seq.finish_reason == "stop" and not seq.pages
  pages.check()
  assert pages.num_free == 16 and pages.num_cached == 2  # its two full pages stay cached


def test_draft_rows_count_against_the_step_budget():
  """Two speculative decodes (3 drafts each) under a budget of 6 rows: the first takes its
  token and 3 drafts, the second its token and the one draft left room for; nothing else runs
  and the step computes exactly 6 rows."""
  pages = PageTable(32, SIZE, salt="test")
  scheduler = Scheduler(pages, max_num_seqs=3, max_step_tokens=6)
  seqs = [Sequence(str(i), [1, 2, 3], 3, SamplingParams(max_tokens=8, speculative_tokens=3),
                   seed=0) for i in range(3)]
  for seq in seqs:
    scheduler.add(seq)
  batch = scheduler.schedule()  # two prompts of 3 fill the budget
  assert [c.seq for c in batch.prefills] == seqs[:2] and batch.num_tokens == 6
  batch = scheduler.dispatched(batch)
  scheduler.commit(batch, {id(c): [7] for c in batch.prefills}, _stops)
  for seq in seqs[:2]:
    seq.drafts = [8, 9, 10]
  batch = scheduler.schedule()
  assert [(c.seq, c.drafts) for c in batch.decodes] == [(seqs[0], (8, 9, 10)), (seqs[1], (8,))]
  assert not batch.prefills and batch.num_tokens == 6
  pages.check()
