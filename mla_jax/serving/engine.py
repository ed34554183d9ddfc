"""``Engine``: continuous batching over paged latent + indexer-key caches, the engine's core:
requests, scheduling, stats and the step loop; the device side (pools, programs, dispatch) is
its ``ModelRunner``.

Each ``step`` asks the scheduler for the next step's work (decodes and prefill chunks), builds
its inputs from the persistent input batch and dispatches it as one compiled program over one
flat batch of tokens, *before* reading the outputs of the step in flight: the host schedules
and prepares step N + 1 while the device runs step N, and settles N (its tokens, stops and
finished requests) while N + 1 runs. A decode whose last token is still being computed carries
a placeholder the program fills on the device; a request that finished in step N may waste
one row of step N + 1, and its pages are freed once N is read (every later step runs after
N + 1 on the device). A step program is compiled per shape bucket (token rows; key blocks;
whether every sequence is fresh; decode steps; its sampler) and resolves its ``StepPlan`` from
that bucket alone (``plan_flat_step``): the engine adds no routing of its own. A program may
take the dense-MHA route only when the model class and backend both can and every sequence of
the step starts empty with all its keys within the top-k; a mixed step never does, and an
MQA-only model never compiles one. When a step holds plain decodes only and nothing waits,
one dispatch runs up to ``decode_steps`` of them. ``warmup`` compiles every kind of program
the settings can run; ``programs`` records what each contains (its traced scopes), so tests
walk them all.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import time
from collections.abc import Iterable, Iterator

import jax
import numpy as np

from mla_jax import checks, context_parallel, sharding
from mla_jax.cache import resolve_cache_dtype
from mla_jax.decoding import DECODE_STEPS_PER_DISPATCH
from mla_jax.decoding.driver import Pipeline
from mla_jax.decoding.prompt_checks import check_fits, checked_prompt
from mla_jax.decoding.protocol import check_decode_model
from mla_jax.decoding.speculative import MAX_SPECULATIVE_TOKENS
from mla_jax.decoding.stops import STOP, stop_reason
from mla_jax.decoding.text import IncrementalText
from mla_jax.serving import constraints, step_inputs
from mla_jax.serving.input_batch import InputBatch
from mla_jax.serving.pages import PageTable, pages_for
from mla_jax.serving.runner import (CompiledStep, InFlight, ModelRunner, engine_pools,
                                    page_bytes)
from mla_jax.serving.scheduler import Chunk, Scheduler, StepBatch
from mla_jax.serving.sequence import (MAX_SEED, RequestOutput, SamplingParams,
                                     Sequence, Status, TokenLogprobs)
from mla_jax.serving.snapshots import Snapshots
from mla_jax.serving.stalls import StallGuard
from mla_jax.serving.step_inputs import Buckets, StepShape
from mla_jax.step_plan import StepPlan

__all__ = ["Engine", "EngineStats", "CompiledStep", "engine_pools", "page_bytes"]

logger = logging.getLogger("mla_jax")


@dataclasses.dataclass
class EngineStats:
  steps: int = 0               # dispatches (a multi-step decode dispatch counts once)
  decode_dispatches: int = 0   # of which multi-step decode dispatches
  computed_tokens: int = 0     # rows written (prompts, recomputes and decodes)
  wasted_tokens: int = 0       # rows of requests that had finished in the step before
  output_tokens: int = 0
  draft_tokens: int = 0        # speculative decoding: drafts verified
  accepted_tokens: int = 0     # and accepted
  compile_s: float = 0.0       # compiles a step waited for (background ones excluded)
  run_s: float = 0.0           # dispatch to outputs on the host, summed over steps
  wait_s: float = 0.0          # the host blocked on a step's outputs
  host_s: float = 0.0          # the rest of ``step``: scheduling, inputs, dispatch, commit


@dataclasses.dataclass
class _Dispatched:
  """A step sent to the device and not read yet: its batch (``Scheduler.dispatched``'s) and
  outputs."""

  batch: StepBatch
  flight: InFlight
  multi: bool

  def tokens(self, outputs: dict) -> list[list[int]]:
    """Each step slot's new tokens (a multi-step dispatch's column stops at -1)."""
    chunks = self.batch.chunks
    if self.multi:
      columns = outputs["tokens"].T[:len(chunks)].tolist()
      return [[t for t in column if t >= 0] for column in columns]
    rows = outputs["tokens"][:len(chunks)].tolist()
    accepted = outputs["accepted"][:len(chunks)].tolist()
    return [row[:a + 1] if c.samples else [] for row, a, c in zip(rows, accepted, chunks)]


class CheckedPrompt(list):
  """A prompt's token ids as ``Engine.check_request`` accepted them, for these params on this
  engine (a list of ints like any prompt)."""

  def __init__(self, ids, checked_by: Engine, params: SamplingParams):
    super().__init__(ids)
    self.checked_by, self.params = checked_by, params


class Engine:
  """Continuous batching for any decode model (``mla_jax.decoding.protocol``: a ``CausalLM``,
  a ``V4CausalLM``) over ``num_pages`` pages of ``page_size`` tokens.

  Offline: ``engine.generate(prompts, max_tokens=..., temperature=...)`` (or one
  ``SamplingParams`` per prompt) returns a ``RequestOutput`` per prompt, in prompt order.
  Incremental: ``add_request`` / ``step`` / ``abort`` / ``has_unfinished``, and ``stream`` to
  iterate over new tokens as steps produce them. ``warmup()`` compiles every step program
  first (otherwise each compiles when a step first needs it).

  Args:
    model: the ``DecodeModel`` (its backend and layer classes fix what routes can exist).
    num_pages, page_size: the page pool (every layer has one, of the same page ids).
    max_num_seqs: sequences running at once (seats).
    max_step_tokens: tokens computed per step (decodes count one each, drafts one each;
      prefills fill the rest, so a long prompt is prefilled over several steps).
    max_model_len: longest prompt + output (default: the model's ``max_position_embeddings``).
    cache_dtype: ``"fp32" | "bf16" | "fp8"`` (or a float dtype), as ``generate``'s caches.
    tokenizer: for string prompts, ``text`` outputs and ``stop`` strings (an object with
      ``encode(str) -> ids`` and ``decode(ids) -> str``, as ``mla_jax.tokenizer``'s).
    eos_token_ids: ids that end every request (beside each request's ``stop_token_ids``).
    prefix_caching: reuse the cached pages of a shared prompt prefix.
    log_interval: seconds between stats lines on the ``mla_jax`` logger (None: never).
    seed: draws the seed of requests that give none (an int in [0, 2**63)).
    max_speculative_tokens: the most draft tokens a request may ask for
      (``SamplingParams.speculative_tokens``, up to ``MAX_SPECULATIVE_TOKENS``); above 0 the
      model needs MTP layers, whose paged caches the engine then keeps for every request (one
      more layer per step): see ``mla_jax.serving.step_program``.
    decode_steps: decode steps one dispatch runs when a step holds plain decodes only and
      nothing waits (1: one step per dispatch). Stop ids and ``max_tokens`` end a request on
      the device; stop strings after the dispatch, its tokens past the stop dropped.
    prompt_logprobs: requests may ask for their prompt tokens' log-probabilities
      (``SamplingParams.prompt_logprobs``: scoring); this compiles a scoring variant of each
      one-step program (``warmup`` too). Such a request reuses no cached prefix past what it
      has scored: pages keep keys, not log-probabilities.
    context_topk: on a mesh with a ``context`` axis (the pools' rows split over it,
      ``mla_jax.context_parallel``), how the indexer selects: ``"exact"`` (the global top-k:
      one device's tokens) or ``"union"`` (each rank's own top-k, no candidate exchange;
      approximate). ``num_pages`` must divide into the context ranks.
    structured_outputs: requests may carry a constraint (``SamplingParams.constraint``: a JSON
      schema, any JSON object, a regex, a choice, a grammar; ``mla_jax.serving.constraints``),
      which needs the ``tokenizer``; this compiles a masked variant of each ``FULL`` program
      (``warmup`` too). A step that samples a constrained request is read before the next is
      dispatched (its next mask needs its token), though the next is scheduled and built
      while it runs.
    num_snapshots: for a model with per-sequence state (DeepSeek-V4's rings), the slots of
      state saved at page ends that prefix hits restore (``serving.snapshots``; default
      ``max_num_seqs`` with prefix caching; 0: hits take no cached prefix).
  """

  def __init__(self, model, *, num_pages: int, page_size: int = 64,
               max_num_seqs: int = 32, max_step_tokens: int = 512,
               max_model_len: int | None = None, cache_dtype="fp32", tokenizer=None,
               eos_token_ids: Iterable[int] = (), prefix_caching: bool = True,
               log_interval: float | None = 10.0, seed: int = 0,
               max_speculative_tokens: int = 0,
               decode_steps: int = DECODE_STEPS_PER_DISPATCH, prompt_logprobs: bool = False,
               context_topk: str = "exact", structured_outputs: bool = False,
               num_snapshots: int | None = None):
    check_decode_model(model)
    self.page_size = checks.static_int(page_size, "page_size", minimum=1)
    model.check_page_size(self.page_size)
    self.num_pages = checks.static_int(num_pages, "num_pages", minimum=1)
    self.max_num_seqs = checks.static_int(max_num_seqs, "max_num_seqs", minimum=1)
    self.max_step_tokens = checks.static_int(max_step_tokens, "max_step_tokens", minimum=1)
    limit = model.max_positions
    self.max_model_len = checks.static_int(limit if max_model_len is None else max_model_len,
                                           "max_model_len", minimum=2, maximum=limit)
    self.cache_dtype = resolve_cache_dtype(cache_dtype, "cache_dtype")
    self.eos_token_ids = _token_ids(eos_token_ids, "eos_token_ids")
    self.max_speculative_tokens = checks.static_int(
        max_speculative_tokens, "max_speculative_tokens", minimum=0,
        maximum=MAX_SPECULATIVE_TOKENS)
    if self.max_speculative_tokens and not model.num_mtp_layers:
      raise ValueError("max_speculative_tokens > 0 needs a model with MTP layers (its config "
                       "counts num_mtp_layers = 0; load a checkpoint that stores them)")
    if self.max_speculative_tokens and model.sequence_state:
      # Rejected drafts would be written into the per-sequence rings, which have no rollback
      # in pages yet (mla_jax.generate's contiguous rings do: spare rows).
      raise ValueError(f"max_speculative_tokens > 0: the engine drafts for no model with "
                       f"per-sequence state yet ({type(model).__name__}); use "
                       "mla_jax.generate(..., speculative_tokens=) for it")
    self.decode_steps = checks.static_int(decode_steps, "decode_steps", minimum=1, maximum=256)
    for name, flag in (("prefix_caching", prefix_caching), ("prompt_logprobs", prompt_logprobs),
                       ("structured_outputs", structured_outputs)):
      if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    self.prompt_logprobs = prompt_logprobs
    self.tokenizer = _checked_tokenizer(tokenizer)
    if structured_outputs and self.tokenizer is None:
      raise ValueError("structured_outputs needs the engine's tokenizer (Engine(..., "
                       "tokenizer=)): constraints are matched on its tokens' bytes")
    # Compiles and checks requests' constraints over the tokenizer (None: refused).
    self.grammars = constraints.Grammars(self.tokenizer, model.vocab_size,
                                         self.eos_token_ids) if structured_outputs else None
    self.log_interval = _checked_interval(log_interval)
    seed = checks.static_int(seed, "seed", minimum=0, maximum=2**63 - 1)
    self.model = model
    self._multiprocess = jax.process_count() > 1
    data_shards = sharding.axis_size(model.mesh, sharding.DATA)
    self.context = sharding.axis_size(model.mesh, sharding.CONTEXT)
    self.context_topk = context_parallel.check_mode(context_topk)
    if self.num_pages % self.context:
      raise ValueError(f"num_pages {self.num_pages} cannot be split over mesh axis 'context' "
                       f"of size {self.context}: give a multiple of {self.context}")
    self.pages = PageTable(self.num_pages, self.page_size,
                           salt=("mla_jax", str(self.cache_dtype), self.page_size))
    # A model with per-sequence state keeps it in a slot per seat, and prefix hits restore it
    # from snapshots at page ends (``serving.snapshots``).
    if num_snapshots is None:
      num_snapshots = self.max_num_seqs if model.sequence_state and prefix_caching else 0
    self.num_snapshots = checks.static_int(num_snapshots, "num_snapshots", minimum=0)
    snapshots = (Snapshots(self.max_num_seqs, self.num_snapshots)
                 if model.sequence_state and prefix_caching else None)
    self.scheduler = Scheduler(
        self.pages, max_num_seqs=self.max_num_seqs, max_step_tokens=self.max_step_tokens,
        prefix_caching=prefix_caching, snapshots=snapshots)
    # The indexer scores a flat step's keys in blocks of this many positions, each row its own.
    self._key_chunk = model.key_chunk
    self._logit_rows = 1 + self.max_speculative_tokens
    max_pages = pages_for(self.max_model_len, self.page_size)
    self.buckets = Buckets(self.max_step_tokens, self.max_num_seqs, max_pages, self.page_size,
                           self._key_chunk, self._dense_bound(), self.decode_steps,
                           data_shards, scores=prompt_logprobs, masked=structured_outputs)
    self.runner = ModelRunner(
        model, num_rows=self.num_pages * self.page_size, page_size=self.page_size,
        cache_dtype=self.cache_dtype, num_slots=self.max_num_seqs, logit_rows=self._logit_rows,
        mtp=bool(self.max_speculative_tokens), context_topk=self.context_topk,
        buckets=self.buckets, plan_of=self._plans,
        num_state_slots=(self.max_num_seqs + self.num_snapshots if model.sequence_state
                         else 0))
    self._inputs = InputBatch(self.max_num_seqs, max_pages)
    # The host decode loop: step N + 1 is dispatched before step N is read.
    self._pipeline = Pipeline(
        lambda pipeline, updates: self._dispatch(self.scheduler.schedule(), updates),
        self._settle, lambda flight: self._drafts_needed(flight.batch))
    self._seqs: dict[str, Sequence] = {}
    self._ids = itertools.count()
    self._seed_rng = np.random.default_rng(seed)
    self.stats = EngineStats()
    self._stall = StallGuard()
    self._last_log = time.perf_counter()
    self._log_tokens = 0

  def _dense_bound(self) -> int | None:
    """The tokens a fresh sequence may hold in a step that takes the dense route (within the
    top-k, so dense attention is exact), or None when this model's plans take none."""
    return self.model.dense_fresh_bound(self.max_step_tokens, self.max_model_len,
                                        self.page_size)

  def _flat_plan(self, fresh_tokens: int | None, kv_pages: int, *,
                 segmented: bool = True) -> StepPlan:
    rows = kv_pages * self.page_size
    if not segmented:  # the one-token steps of further drafts, one row per sequence
      return self.model.step_plan(1, None, capacity=rows, kv_rows=rows)
    return self.model.flat_step_plan(fresh_tokens, kv_rows=rows, key_chunk=self._key_chunk,
                                     context_topk=self.context_topk)

  def step_plan(self, shape: StepShape) -> StepPlan:
    """The plan of the step program compiled for ``shape``, from the shape alone."""
    return self._flat_plan(self.buckets.dense_bound if shape.fresh else None, shape.kv_pages)

  def _plans(self, shape: StepShape) -> tuple[StepPlan, StepPlan | None]:
    """A shape's plan and, in a speculative engine's one-step programs, its drafts' plan."""
    drafts = self._logit_rows > 1 and shape.decode_steps == 1
    return self.step_plan(shape), (self._flat_plan(None, shape.kv_pages, segmented=False)
                                   if drafts else None)

  @property
  def _pools(self):
    """The page pools (the runner's)."""
    return self.runner.pools

  def add_request(self, prompt, params: SamplingParams | None = None, *,
                  request_id: str | None = None) -> str:
    """Queues a request (token ids, or a string with a tokenizer) and returns its id.

    Refused before anything is queued, naming the problem: an empty prompt, ids outside the
    vocabulary, a prompt plus ``max_tokens`` beyond ``max_model_len``, one needing more pages
    than the whole pool, ``stop`` strings without a tokenizer, ``stop_token_ids`` outside the
    vocabulary, ``min_tokens`` with more stop ids than a step holds back, or a duplicate id.
    """
    self._only_on_process_0("add_request")
    params = SamplingParams() if params is None else params
    checked = (isinstance(prompt, CheckedPrompt) and prompt.checked_by is self
               and prompt.params is params)
    tokens = list(prompt) if checked else self.check_request(prompt, params)
    if request_id is None:
      request_id = f"req-{next(self._ids)}"
    elif not isinstance(request_id, str) or not request_id:
      raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
    if request_id in self._seqs:
      raise ValueError(f"request id {request_id!r} is already in use")
    seed = params.seed if params.seed is not None else int(self._seed_rng.integers(MAX_SEED))
    seq = Sequence(request_id, tokens, len(tokens), params, seed, self._stop_ids(params))
    if params.prompt_logprobs is not None:
      seq.prompt_logprobs = [None] * len(tokens)
    if params.constraint is not None:
      seq.guide = self.grammars.guide(params.constraint)
    if self.tokenizer is not None:
      seq.detok = IncrementalText(self.tokenizer.decode, params.stop)
    self._seqs[request_id] = seq
    self.scheduler.add(seq)
    return request_id

  def check_request(self, prompt, params: SamplingParams, name: str = "prompt"
                    ) -> CheckedPrompt:
    """The prompt's token ids, once the request is known to fit; refused by name otherwise
    (see ``add_request``; ``name`` is what errors call the prompt). The one check of a
    request: ``add_request`` given these ids (a ``CheckedPrompt``) and the same params does
    not check again (the server and ``generate`` check before queueing). It reads only the
    engine's fixed settings, so any thread may call it."""
    if not isinstance(params, SamplingParams):
      raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise TypeError("a string prompt needs the engine's tokenizer (Engine(..., tokenizer=))")
      prompt = self.tokenizer.encode(prompt)
    ids = checked_prompt(prompt, self.model.vocab_size, name)
    check_fits(len(ids), params.max_tokens, self.max_model_len, name)
    pages = pages_for(len(ids) + params.max_tokens, self.page_size)
    if pages > self.num_pages:
      raise ValueError(f"the request needs {pages} pages of {self.page_size} tokens, the whole "
                       f"pool has {self.num_pages}")
    if params.min_tokens and len(self._stop_ids(params)) > step_inputs.STOP_IDS:
      raise ValueError(f"min_tokens holds back at most {step_inputs.STOP_IDS} stop ids (the "
                       "request's stop_token_ids and the engine's eos ids)")
    vocab = self.model.vocab_size
    for token in params.stop_token_ids:
      if token >= vocab:
        raise ValueError(f"stop_token_ids entry {token} is outside the vocabulary [0, {vocab})")
    for token, _ in params.logit_bias:
      if token >= vocab:
        raise ValueError(f"logit_bias token {token} is outside the vocabulary [0, {vocab})")
    if params.stop and self.tokenizer is None:
      raise ValueError("stop strings need the engine's tokenizer (Engine(..., tokenizer=))")
    if params.prompt_logprobs is not None and not self.prompt_logprobs:
      raise ValueError("prompt_logprobs: this engine does not score prompts (build it with "
                       "Engine(..., prompt_logprobs=True); mla-jax serve does by default)")
    if params.speculative_tokens and params.penalized:
      raise ValueError("repetition, frequency and presence penalties do not combine with "
                       "speculative_tokens (a draft's penalties would need its drafts counted)")
    if params.constraint is not None:
      if self.grammars is None:
        raise ValueError(f"{params.constraint.field}: this engine serves no structured outputs "
                         "(build it with Engine(..., structured_outputs=True) and a tokenizer)")
      self.grammars.check(params.constraint)  # once per constraint (cached)
    if params.speculative_tokens > self.max_speculative_tokens:
      raise ValueError(f"speculative_tokens {params.speculative_tokens} exceeds the engine's "
                       f"max_speculative_tokens {self.max_speculative_tokens}"
                       + ("" if self.max_speculative_tokens else
                          " (Engine(..., max_speculative_tokens=K) with a model that has MTP "
                          "layers)"))
    return CheckedPrompt(ids, self, params)

  def abort(self, request_id: str) -> None:
    """Stops a request (waiting or running) and frees its pages; ``KeyError`` if unknown."""
    seq = self._seqs.get(request_id)
    if seq is None:
      raise KeyError(f"no request with id {request_id!r}")
    if seq.status is not Status.FINISHED:
      self.scheduler.abort(seq)

  def has_unfinished(self) -> bool:
    """Whether a request is waiting or running, or a step is in flight."""
    return self.scheduler.has_unfinished() or self._pipeline.in_flight is not None

  def output(self, request_id: str) -> RequestOutput:
    """A request's output so far; ``KeyError`` naming an unknown id."""
    return RequestOutput.of(self._sequence(request_id))

  def release(self, request_id: str) -> RequestOutput:
    """A finished request's output, forgetting the request (its id may be used again)."""
    seq = self._sequence(request_id)
    if seq.status is not Status.FINISHED:
      raise ValueError(f"request {request_id!r} has not finished")
    return RequestOutput.of(self._seqs.pop(request_id))

  def _sequence(self, request_id: str) -> Sequence:
    seq = self._seqs.get(request_id)
    if seq is None:
      raise KeyError(f"no request with id {request_id!r}")
    return seq

  # ---- steps ----------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Dispatches the next step (or multi-step decode dispatch), then settles the one before
    it; returns the requests that got tokens (or finished) in the settled step. So a step's
    tokens come back from the next call (``has_unfinished`` is true while a step is in
    flight). A step whose next one needs its outputs on the host first (a speculative
    request's drafts) is settled before scheduling; one whose next step's token masks need
    its tokens (a constrained request's), once that step is built.
    ``stalls.EngineStalled`` (naming the
    requests) after ``MAX_STEPS_WITHOUT_PROGRESS`` calls in a row in which no request made
    progress: an engine bug, rather than a hang."""
    self._only_on_process_0("step")
    t0, compile_before, wait_before = (time.perf_counter(), self.runner.compile_s,
                                       self.stats.wait_s)
    updates = self._pipeline.advance()
    # Progress: rows sent to the device, rows and tokens settled, requests finished.
    self._stall.after_step((self.scheduler.rows_dispatched, self.stats.computed_tokens,
                            self.stats.output_tokens, self.scheduler.num_finished),
                           lambda: list(self._seqs.values()))
    compiled = self.runner.compile_s - compile_before
    self.stats.compile_s += compiled
    self.stats.host_s += (time.perf_counter() - t0 - compiled
                          - (self.stats.wait_s - wait_before))
    return updates

  @staticmethod
  def _drafts_needed(batch: StepBatch) -> bool:
    return any(c.samples and c.seq.params.speculative_tokens for c in batch.chunks)

  def _dispatch(self, batch: StepBatch, updates: list[RequestOutput]) -> _Dispatched | None:
    """Sends ``batch``'s step to the device. A masked step whose constrained requests' tokens
    are still in flight settles the step in flight first (its outputs go to ``updates``),
    once the step is built: only the masks wait for those tokens."""
    if not batch:
      return None
    multi = self._multi_step(batch)
    self.scheduler.plan_snapshots(batch)
    shape = self.buckets.shape(batch.chunks, batch.decode_steps)
    program = self.runner.program_shape(shape)
    inputs = self._inputs.build(batch.chunks, self.runner.layout(program), batch.decode_steps)
    allowed_SW = inputs.inputs.allowed_SW  # a view into the packed ints: filled in place
    if allowed_SW is not None:
      in_flight = self._pipeline.in_flight
      if in_flight is not None and any(map(step_inputs.wants_mask, in_flight.batch.chunks)):
        updates += self._pipeline.settle()
      constraints.fill_masks(batch.chunks, allowed_SW)
    flight = self.runner.dispatch(program, inputs)
    self.stats.steps += 1
    self.stats.decode_dispatches += multi
    return _Dispatched(self.scheduler.dispatched(batch), flight, multi)

  def _settle(self, dispatched: _Dispatched) -> list[RequestOutput]:
    """Reads a dispatched step's outputs and commits them: tokens, stops, finished requests,
    log-probabilities and drafts."""
    t0 = time.perf_counter()
    outputs = dispatched.flight.read()
    done = time.perf_counter()
    self.stats.wait_s += done - t0
    self.stats.run_s += done - dispatched.flight.dispatched_at
    batch = dispatched.batch
    chunks = batch.chunks
    sampled = {id(c): new for c, new in zip(chunks, dispatched.tokens(outputs))}
    # A multi-step dispatch wrote a row for every token it emitted; a step, its chunks' rows.
    # The rows of a request that had finished when the step ran (it ended in the step before,
    # still in flight when this one was scheduled) were wasted.
    for c in chunks:
      rows = min(len(sampled[id(c)]), c.emits) if dispatched.multi else c.num_computed
      if c.seq.status is Status.FINISHED:
        self.stats.wasted_tokens += rows
      else:
        self.stats.computed_tokens += rows
    if "row_logprob" in outputs:
      self._record_scores(chunks, outputs)
    grown = self.scheduler.commit(batch, sampled, self._stop_reason)
    slot = {id(c.seq): (b, c) for b, c in enumerate(chunks)}
    for seq, count in grown:
      self._record(seq, count, *slot[id(seq)], outputs)
    new_tokens = sum(count for _, count in grown)
    self.stats.output_tokens += new_tokens
    self._maybe_log(new_tokens)
    return [RequestOutput.of(seq, count) for seq, count in grown]

  def _multi_step(self, batch: StepBatch) -> bool:
    """Whether ``batch`` runs as a multi-step decode dispatch (pages reserved if so): plain
    decodes only (no drafts; no log-probabilities, bias, penalties or held-back stop ids
    asked: ``step_inputs.wants_full``), nothing waiting, and every stop id checkable on the
    device."""
    if self.decode_steps == 1 or self.scheduler.waiting or not batch.decodes or any(
        c.seq.params.speculative_tokens or step_inputs.wants_full(c)
        or len(c.seq.stop_ids) > step_inputs.STOP_IDS for c in batch.decodes):
      return False
    return self.scheduler.reserve_decode_steps(batch, self.decode_steps)

  @staticmethod
  def _record_scores(chunks: list[Chunk], outputs: dict) -> None:
    """The prompt log-probabilities a scoring step computed: the entry of prompt token p + 1
    from row p, for each chunk whose request asks (rows lie end to end, chunk by chunk)."""
    t = 0
    for c in chunks:
      seq = c.seq
      if step_inputs.wants_scores(c):
        n = seq.params.prompt_logprobs
        last = min(c.num_cached + c.num_tokens, seq.num_prompt - 1)  # rows [num_cached, last)
        for p in range(c.num_cached, last):
          r = t + p - c.num_cached
          top = zip(outputs["row_top_ids"][r, :n].tolist(), outputs["row_top"][r, :n].tolist())
          seq.prompt_logprobs[p + 1] = TokenLogprobs(
              seq.tokens[p + 1], float(outputs["row_logprob"][r]), tuple(top),
              int(outputs["row_rank"][r]))
        seq.num_scored = max(seq.num_scored, last)
      t += c.num_computed

  def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
    """The distinct ids that end a request: its own, and the engine's eos ids unless it
    ignores them."""
    ids = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
    return tuple(dict.fromkeys(ids))

  def _record(self, seq: Sequence, count: int, b: int, chunk: Chunk, outputs: dict) -> None:
    """After ``seq`` took ``count`` tokens of slot ``b``: their log-probabilities (if asked),
    its text when it finished, the drafts' tally and the drafts its next step verifies."""
    if seq.params.logprobs is not None:
      n = seq.params.logprobs
      for j in range(count):
        top = zip(outputs["top_ids"][b, j, :n].tolist(), outputs["top"][b, j, :n].tolist())
        seq.logprobs.append(TokenLogprobs(int(outputs["tokens"][b, j]),
                                          float(outputs["logprob"][b, j]), tuple(top)))
    if seq.status is Status.FINISHED and seq.detok is not None:
      seq.detok.flush()
      seq.text = seq.detok.text
    if not seq.params.speculative_tokens or "drafts" not in outputs:
      return
    accepted = int(outputs["accepted"][b])
    seq.num_drafted += len(chunk.drafts)
    seq.num_accepted += accepted
    self.stats.draft_tokens += len(chunk.drafts)
    self.stats.accepted_tokens += accepted
    seq.drafts = (outputs["drafts"][b, :int(outputs["wanted"][b])].tolist()
                  if seq.status is not Status.FINISHED else [])

  def _stop_reason(self, seq: Sequence) -> str | None:
    """After ``seq`` took a token: "stop" at a stop id or stop string or once its constraint
    is complete, ``constraints.DEAD_END`` when no token can continue its constraint, "length"
    at its last allowed token, else None. Its text grows by the new token only
    (``IncrementalText``)."""
    token = seq.tokens[-1]
    if seq.detok is not None:
      seq.detok.extend([token])
      seq.text = seq.detok.text
    if seq.guide is not None and (reason := seq.guide.advance(token)) is not None:
      if reason == constraints.DEAD_END:
        logger.warning("request %s stops at a dead end of its constraint: %s", seq.request_id,
                       seq.guide.error)
      return reason
    reason = stop_reason(token, seq.stop_ids, len(seq.tokens) - seq.num_prompt,
                         seq.params.max_tokens)  # committed tokens: none in flight
    if reason != STOP and seq.detok is not None and seq.detok.stop_at is not None:
      return STOP  # a stop string, before its last allowed token
    return reason

  # ---- several processes ------------------------------------------------------------------

  def follow(self) -> None:
    """On every process but 0: runs the steps process 0 schedules, until it calls
    ``shutdown``. Each process builds the same ``Engine`` (same model and settings)."""
    if not self._multiprocess or jax.process_index() == 0:
      raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
    self.runner.follow()

  def shutdown(self) -> None:
    """On process 0 of a multi-process run: releases the followers from ``follow``."""
    if self._multiprocess:
      self._only_on_process_0("shutdown")
      self.runner.shutdown()

  def _only_on_process_0(self, what: str) -> None:
    if jax.process_index() != 0:
      raise RuntimeError(f"{what}: process 0 schedules a multi-process engine; the others "
                         "call follow()")

  # ---- programs -------------------------------------------------------------------------

  @property
  def programs(self) -> list[CompiledStep]:
    """Every step program compiled so far, with its plan and what its trace contains."""
    return self.runner.programs

  def warmup(self, *, progress: bool = False, every_reach: bool = False) -> tuple[int, float]:
    """Compiles every kind of step program this engine's settings can run
    (``Buckets.all_shapes``: each at its covering key blocks), so that serving never waits
    for a compile; returns ``(programs compiled, seconds)``. Programs already compiled (by
    this engine or another over the same model and pools) are reused. ``every_reach``: each
    at every key-block bucket too, so that nothing compiles while serving (without it the
    smaller buckets compile in the background when first needed, their steps meanwhile
    running on the covering program); a warm-up about log2(context / key chunk) + 1 times
    longer. ``progress``: a progress bar on stderr."""
    from mla_jax.progress import progress_bar

    t0, before = time.perf_counter(), self.runner.compile_s
    shapes = self.buckets.all_shapes(every_reach)
    with progress_bar(len(shapes), "compiling step programs", unit="program",
                      enabled=progress) as bar:
      for shape in shapes:
        self.runner.program_shape(shape)
        bar.update(1)
    seconds = time.perf_counter() - t0
    self.stats.compile_s += self.runner.compile_s - before
    logger.info("engine warm-up: %d step programs ready in %.1f s (%.1f s compiling, the rest "
                "reused)", len(shapes), seconds, self.runner.compile_s - before)
    return len(shapes), seconds

  def trace_step(self, shape: StepShape):
    """``(plan, traced)``: the step program of ``shape`` traced, not compiled
    (``ModelRunner.trace_step``)."""
    return self.runner.trace_step(shape)

  # ---- offline and streaming ------------------------------------------------------------

  def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
               **sampling) -> list[RequestOutput]:
    """Runs ``prompts`` to completion; one output per prompt, in prompt order.

    ``params``: one ``SamplingParams`` for all, or one per prompt; or give its fields as
    keyword arguments (``max_tokens=``, ``temperature=``, ...). Every prompt is checked before
    any is queued.
    """
    prompts = list(prompts)
    if params is not None and sampling:
      raise ValueError("pass either params or sampling keyword arguments, not both")
    if params is None:
      params = SamplingParams(**sampling)
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
      raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
    # Refuse bad input before queueing any (strings are tokenized once, here).
    token_ids = [self.check_request(prompt, p) for prompt, p in zip(prompts, per_prompt)]
    ids = [self.add_request(tokens, p) for tokens, p in zip(token_ids, per_prompt)]
    # ... and a last step dispatched for requests now finished is settled too.
    for _ in self._steps_until(lambda: self._pipeline.in_flight is None and all(
        self._seqs[i].status is Status.FINISHED for i in ids)):
      pass
    return [self.release(i) for i in ids]

  def stream(self, request_id: str | None = None) -> Iterator[RequestOutput]:
    """Steps until no request is left (or, given ``request_id``, until that one finishes),
    yielding each update as it comes (only that request's, when given)."""
    if request_id is None:
      yield from self._steps_until(lambda: not self.has_unfinished())
      return
    seq = self._sequence(request_id)
    done = lambda: not self.has_unfinished() or seq.status is Status.FINISHED
    yield from (u for u in self._steps_until(done) if u.request_id == request_id)

  def _steps_until(self, done) -> Iterator[RequestOutput]:
    """``step`` until ``done()`` (``generate``'s and ``stream``'s), yielding every update:
    the host decode loop (``decoding.driver``)."""
    for updates in self.run(done):
      yield from updates

  def run(self, done, step=None) -> Iterator[list[RequestOutput]]:
    """The host decode loop over this engine: ``step`` (by default ``Engine.step``; the
    server's wraps it) until ``done()``, yielding each step's updates."""
    return self._pipeline.run(done, self.step if step is None else step)

  def _maybe_log(self, new_tokens: int) -> None:
    self._log_tokens += new_tokens
    now = time.perf_counter()
    if self.log_interval is None or now - self._last_log < self.log_interval:
      return
    drafts = self.stats.draft_tokens
    logger.info("engine: %d running, %d waiting, %d/%d pages in use (%d cached), "
                "%.1f tokens/s, %d programs%s", len(self.scheduler.running),
                len(self.scheduler.waiting), self.pages.num_in_use, self.num_pages,
                self.pages.num_cached, self._log_tokens / (now - self._last_log),
                len(self.programs),
                f", draft acceptance {self.stats.accepted_tokens / drafts:.2f}" if drafts else "")
    self._last_log, self._log_tokens = now, 0


def _token_ids(ids, name: str) -> tuple[int, ...]:
  """Token ids as a tuple of ints >= 0; a non-sequence (None, an int) is a ``TypeError``
  naming ``name``."""
  if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
    raise TypeError(f"{name} must be a sequence of token ids, got {type(ids).__name__} {ids!r}")
  return tuple(checks.static_int(t, f"{name} entry", minimum=0) for t in ids)


def _checked_tokenizer(tokenizer):
  """None, or an object with callable ``encode`` and ``decode``."""
  if tokenizer is not None and not all(callable(getattr(tokenizer, m, None))
                                       for m in ("encode", "decode")):
    raise TypeError(f"tokenizer must have encode(text) and decode(ids) methods (e.g. "
                    f"mla_jax.tokenizer.ByteTokenizer()), got {type(tokenizer).__name__}")
  return tokenizer


def _checked_interval(seconds) -> float | None:
  """None, or a finite number of seconds >= 0."""
  if seconds is None:
    return None
  if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
    raise TypeError(f"log_interval must be a number of seconds or None, got "
                    f"{type(seconds).__name__} {seconds!r}")
  if not (seconds >= 0 and np.isfinite(seconds)):
    raise ValueError(f"log_interval must be a finite number of seconds >= 0, got {seconds!r}")
  return float(seconds)
