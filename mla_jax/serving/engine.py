"""``Engine``: continuous batching over paged latent + indexer-key caches.

Each ``step`` asks the scheduler for this step's work (decodes and prefill chunks) and runs
it as one compiled program over one flat batch of tokens (``step_inputs``): every scheduled
token in a row of its own, nothing padded per sequence. A program is compiled once per shape
bucket (token rows; whether every sequence is fresh; decode steps) and resolves its
``StepPlan`` from that bucket alone (``plan_flat_step``): the engine adds no routing of its
own. A program may take the dense-MHA route only when the model class and backend both can
and every sequence of the step starts empty with all its keys within the top-k; a mixed step
never does, and an MQA-only model never compiles one. When a step holds plain decodes only
and nothing waits, one dispatch runs up to ``decode_steps`` of them. ``warmup`` compiles
every program the settings can run; ``programs`` records what each contains (its traced
scopes), so tests walk them all.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import time
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import checks, context_parallel, sharding
from mla_jax.cache import resolve_cache_dtype
from mla_jax.checks import functionalize
from mla_jax.decoding import DECODE_STEPS_PER_DISPATCH
from mla_jax.decoding.text import IncrementalText
from mla_jax.decoding.programs import ProgramCache, signature
from mla_jax.decoding.requests import check_fits, checked_prompt
from mla_jax.decoding.speculative import MAX_SPECULATIVE_TOKENS
from mla_jax.models.lm import CausalLM
from mla_jax.paged_cache import empty_pools
from mla_jax.routing import PrefillRoute
from mla_jax.serving import step_inputs
from mla_jax.serving.pages import PageTable, pages_for
from mla_jax.serving.requests import (MAX_SEED, RequestOutput, SamplingParams,
                                      Sequence, Status, TokenLogprobs)
from mla_jax.serving.scheduler import Chunk, Scheduler, StepBatch
from mla_jax.serving.stalls import StallGuard
from mla_jax.serving.step_inputs import Buckets, StepInputs, StepShape
from mla_jax.serving.step_program import StepProgram
from mla_jax.step_plan import StepPlan
from mla_jax.traces import ProgramSummary, summarize_jaxpr

logger = logging.getLogger("mla_jax")


# Compiled step programs of every engine in the process, keyed by shape, model and pools: the
# most recently used ones (an engine also holds its own while it lives).
_COMPILED = ProgramCache(max_size=256)


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  shape: StepShape
  plan: StepPlan
  summary: ProgramSummary  # what the traced program contains (scopes, primitives, kernels)
  compile_s: float


def engine_pools(model: CausalLM, rows: int, cache_dtype, *, mtp: bool):
  """An engine's page pools of ``rows`` token rows: ``(main pools per group and unit, MTP
  pools per MTP layer, or () without speculative decoding, each row's token id)`` (the ids:
  ``mla_jax.decoding.penalties``)."""
  config, cache_dtype = model.config, resolve_cache_dtype(cache_dtype, "cache_dtype")
  main = tuple(
      tuple(empty_pools(config.mla, group.reps, rows, cache_dtype,
                        index_keys=not config.shares_topk(group.layer(0, u)))
            for u in range(group.unit_len))
      for group in model.layer_groups)
  mtp_pools = tuple(empty_pools(config.mla, 1, rows, cache_dtype, index_keys=True)
                    for _ in range(config.num_mtp_layers if mtp else 0))
  return main, mtp_pools, jnp.zeros((rows,), jnp.int32)


def page_bytes(model: CausalLM, page_size: int, cache_dtype="fp32", *, mtp: bool = False) -> int:
  """The bytes one page of ``page_size`` tokens takes in every pool of an engine on one
  device (shapes only: nothing is allocated). The engine holds its pools whole on every
  device, or on a mesh with a ``context`` axis each device 1/context of the layers' pools
  (and the token ids whole): the bytes of a page, averaged over the ranks."""
  main, mtp_pools, token_ids = jax.eval_shape(
      lambda: engine_pools(model, page_size, cache_dtype, mtp=mtp))
  size = lambda tree: sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
  ranks = sharding.axis_size(model.mesh, sharding.CONTEXT)
  return -(-size((main, mtp_pools)) // ranks) + size(token_ids)


@dataclasses.dataclass
class EngineStats:
  steps: int = 0               # dispatches (a multi-step decode dispatch counts once)
  decode_dispatches: int = 0   # of which multi-step decode dispatches
  computed_tokens: int = 0     # rows written (prompts, recomputes and decodes)
  output_tokens: int = 0
  draft_tokens: int = 0        # speculative decoding: drafts verified
  accepted_tokens: int = 0     # and accepted
  compile_s: float = 0.0
  run_s: float = 0.0
  host_s: float = 0.0          # scheduling and step-input building (compiles excluded)


@dataclasses.dataclass(frozen=True)
class _Results:
  """What one dispatch gave the host, per chunk (slot) b: its new tokens, the accepted drafts,
  token j's log-probabilities, and the drafts its next step verifies."""

  outputs: tuple
  multi: bool

  def tokens(self, b: int, chunk: Chunk) -> list[int]:
    if self.multi:
      column = self.outputs[0][:, b]
      return [int(t) for t in column[column >= 0]]
    if not chunk.samples:
      return []
    return self.outputs[0][b, :int(self.outputs[1][b]) + 1].tolist()

  def accepted(self, b: int) -> int:
    return 0 if self.multi else int(self.outputs[1][b])

  def logprobs(self, b: int, j: int, n: int) -> TokenLogprobs:
    """(A step's: a multi-step dispatch runs only when no sequence asks for them.)"""
    tokens, chosen, top_ids, top = (a[b, j] for a in (self.outputs[0], *self.outputs[2:5]))
    return TokenLogprobs(int(tokens), float(chosen),
                         tuple(zip(top_ids[:n].tolist(), top[:n].tolist())))

  def drafts(self, b: int) -> list[int]:
    """The drafts the program made for slot b's next step (as many as it meant)."""
    return self.outputs[5][b, :int(self.outputs[6][b])].tolist()

  def row_score(self, t: int, token: int, n: int) -> TokenLogprobs:
    """(A scoring step's:) row t's log-probability of ``token``, the token after it."""
    chosen, rank, top_ids, top = (a[t] for a in self.outputs[7:11])
    return TokenLogprobs(token, float(chosen), tuple(zip(top_ids[:n].tolist(),
                                                         top[:n].tolist())), int(rank))


class Engine:
  """Continuous batching for a ``CausalLM`` over ``num_pages`` pages of ``page_size`` tokens.

  Offline: ``engine.generate(prompts, max_tokens=..., temperature=...)`` (or one
  ``SamplingParams`` per prompt) returns a ``RequestOutput`` per prompt, in prompt order.
  Incremental: ``add_request`` / ``step`` / ``abort`` / ``has_unfinished``, and ``stream`` to
  iterate over new tokens as steps produce them. ``warmup()`` compiles every step program
  first (otherwise each compiles when a step first needs it).

  Args:
    model: the ``CausalLM`` (its backend and layer classes fix what routes can exist).
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
  """

  def __init__(self, model: CausalLM, *, num_pages: int, page_size: int = 64,
               max_num_seqs: int = 32, max_step_tokens: int = 512,
               max_model_len: int | None = None, cache_dtype="fp32", tokenizer=None,
               eos_token_ids: Iterable[int] = (), prefix_caching: bool = True,
               log_interval: float | None = 10.0, seed: int = 0,
               max_speculative_tokens: int = 0,
               decode_steps: int = DECODE_STEPS_PER_DISPATCH, prompt_logprobs: bool = False,
               context_topk: str = "exact"):
    if not isinstance(model, CausalLM):
      raise TypeError(f"model must be a CausalLM, got {type(model).__name__}")
    mla = model.config.mla
    self.page_size = checks.static_int(page_size, "page_size", minimum=1)
    self.num_pages = checks.static_int(num_pages, "num_pages", minimum=1)
    self.max_num_seqs = checks.static_int(max_num_seqs, "max_num_seqs", minimum=1)
    self.max_step_tokens = checks.static_int(max_step_tokens, "max_step_tokens", minimum=1)
    limit = mla.max_position_embeddings
    self.max_model_len = checks.static_int(limit if max_model_len is None else max_model_len,
                                           "max_model_len", minimum=2, maximum=limit)
    self.cache_dtype = resolve_cache_dtype(cache_dtype, "cache_dtype")
    self.eos_token_ids = _token_ids(eos_token_ids, "eos_token_ids")
    self.max_speculative_tokens = checks.static_int(
        max_speculative_tokens, "max_speculative_tokens", minimum=0,
        maximum=MAX_SPECULATIVE_TOKENS)
    if self.max_speculative_tokens and not model.config.num_mtp_layers:
      raise ValueError("max_speculative_tokens > 0 needs a model with MTP layers (its config "
                       "counts num_mtp_layers = 0; load a checkpoint that stores them)")
    self.decode_steps = checks.static_int(decode_steps, "decode_steps", minimum=1, maximum=256)
    for name, flag in (("prefix_caching", prefix_caching), ("prompt_logprobs", prompt_logprobs)):
      if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    self.prompt_logprobs = prompt_logprobs
    self.tokenizer = _checked_tokenizer(tokenizer)
    self.log_interval = _checked_interval(log_interval)
    seed = checks.static_int(seed, "seed", minimum=0, maximum=2**63 - 1)
    self.model = model
    self._graphdef, state = nnx.split(model)
    self._state_leaves, self._state_def = jax.tree.flatten(state)
    self._multiprocess = jax.process_count() > 1
    mesh = model.mesh
    data_shards = sharding.axis_size(mesh, sharding.DATA)
    self.context = sharding.axis_size(mesh, sharding.CONTEXT)
    self.context_topk = context_parallel.check_mode(context_topk)
    if self.num_pages % self.context:
      raise ValueError(f"num_pages {self.num_pages} cannot be split over mesh axis 'context' "
                       f"of size {self.context}: give a multiple of {self.context}")
    # Where the pools live on the mesh, which every compiled step keeps (None: no mesh).
    self._pool_placement = None if mesh is None else self._pool_shardings()
    self._pools = self._empty_pools() if mesh is None else jax.jit(
        self._empty_pools, out_shardings=self._pool_placement)()
    self.pages = PageTable(self.num_pages, self.page_size,
                           salt=("mla_jax", str(self.cache_dtype), self.page_size))
    self.scheduler = Scheduler(
        self.pages, max_num_seqs=self.max_num_seqs, max_step_tokens=self.max_step_tokens,
        prefix_caching=prefix_caching)
    indexer = mla.indexer
    # The indexer scores keys this many positions at a time, up to the live reach only.
    self._key_chunk = None if indexer is None else model.backend.key_chunk
    self._logit_rows = 1 + self.max_speculative_tokens
    self.buckets = Buckets(self.max_step_tokens, self.max_num_seqs,
                           pages_for(self.max_model_len, self.page_size),
                           self._dense_bound(), self.decode_steps, data_shards,
                           scores=prompt_logprobs)
    self._seqs: dict[str, Sequence] = {}
    self._ids = itertools.count()
    self._seed_rng = np.random.default_rng(seed)
    self._programs: dict[StepShape, tuple[jax.stages.Compiled, CompiledStep]] = {}
    self.stats = EngineStats()
    self._stall = StallGuard()
    self._last_log = time.perf_counter()
    self._log_tokens = 0

  def _dense_bound(self) -> int | None:
    """The tokens a fresh sequence may hold in a step that takes the dense route (within the
    top-k, so dense attention is exact), or None when this model's plans take none."""
    indexer = self.model.config.mla.indexer
    bound = min(self.max_step_tokens, indexer.topk if indexer else self.max_model_len)
    route = self._flat_plan(bound, pages_for(bound, self.page_size)).route
    return bound if route is PrefillRoute.DENSE_MHA else None

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

  def _empty_pools(self):
    return engine_pools(self.model, self.num_pages * self.page_size, self.cache_dtype,
                        mtp=bool(self.max_speculative_tokens))

  def _pool_shardings(self):
    """Where the pools live on the model's mesh: the layers' rows split over ``context``
    (``sharding.POOL_SPEC``), the token ids whole on every device."""
    main, mtp, _ = jax.eval_shape(self._empty_pools)
    placed = lambda spec: jax.sharding.NamedSharding(self.model.mesh, spec)
    rows = lambda tree: jax.tree.map(lambda _: placed(sharding.POOL_SPEC), tree)
    return rows(main), rows(mtp), placed(sharding.REPLICATED)

  # ---- requests -------------------------------------------------------------------------

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
    tokens = self.check_request(prompt, params)
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
    if self.tokenizer is not None:
      seq.detok = IncrementalText(self.tokenizer.decode, params.stop)
    self._seqs[request_id] = seq
    self.scheduler.add(seq)
    return request_id

  def check_request(self, prompt, params: SamplingParams, name: str = "prompt") -> list[int]:
    """The prompt's token ids, once the request is known to fit; refused by name otherwise
    (see ``add_request``; ``name`` is what errors call the prompt). The one check of a
    request (the server calls it before queueing); it reads only the engine's fixed
    settings, so any thread may call it."""
    if not isinstance(params, SamplingParams):
      raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise TypeError("a string prompt needs the engine's tokenizer (Engine(..., tokenizer=))")
      prompt = self.tokenizer.encode(prompt)
    ids = checked_prompt(prompt, self.model.config.vocab_size, name)
    check_fits(len(ids), params.max_tokens, self.max_model_len, name)
    pages = pages_for(len(ids) + params.max_tokens, self.page_size)
    if pages > self.num_pages:
      raise ValueError(f"the request needs {pages} pages of {self.page_size} tokens, the whole "
                       f"pool has {self.num_pages}")
    if params.min_tokens and len(self._stop_ids(params)) > step_inputs.STOP_IDS:
      raise ValueError(f"min_tokens holds back at most {step_inputs.STOP_IDS} stop ids (the "
                       "request's stop_token_ids and the engine's eos ids)")
    vocab = self.model.config.vocab_size
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
    if params.speculative_tokens > self.max_speculative_tokens:
      raise ValueError(f"speculative_tokens {params.speculative_tokens} exceeds the engine's "
                       f"max_speculative_tokens {self.max_speculative_tokens}"
                       + ("" if self.max_speculative_tokens else
                          " (Engine(..., max_speculative_tokens=K) with a model that has MTP "
                          "layers)"))
    return ids

  def abort(self, request_id: str) -> None:
    """Stops a request (waiting or running) and frees its pages; ``KeyError`` if unknown."""
    seq = self._seqs.get(request_id)
    if seq is None:
      raise KeyError(f"no request with id {request_id!r}")
    if seq.status is not Status.FINISHED:
      self.scheduler.abort(seq)

  def has_unfinished(self) -> bool:
    return self.scheduler.has_unfinished()

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
    """Runs one step (or one multi-step decode dispatch); returns the requests that got tokens
    in it. ``stalls.EngineStalled`` (naming the requests) after ``MAX_STEPS_WITHOUT_PROGRESS``
    steps in a row in which no request made progress: an engine bug, rather than a hang."""
    self._only_on_process_0("step")
    t0, compile_before = time.perf_counter(), self.stats.compile_s
    batch = self.scheduler.schedule()
    if self._multi_step(batch):
      self.stats.decode_dispatches += 1
    results, run_s = (self._run(batch) if batch else (None, 0.0))
    chunks = batch.chunks
    sampled = {id(c): results.tokens(b, c) for b, c in enumerate(chunks)}
    # A multi-step dispatch wrote a row for every token it emitted; a step, its chunks' rows.
    computed = (sum(map(len, sampled.values())) if batch.decode_steps > 1 else
                sum(c.num_computed for c in chunks))
    if results is not None and not results.multi:
      self._record_scores(chunks, results)
    grown = self.scheduler.commit(batch, sampled, self._stop_reason)
    slot = {id(c.seq): (b, c) for b, c in enumerate(chunks)}
    for seq, count in grown:
      self._record(seq, count, *slot[id(seq)], results)
    self.stats.steps += 1
    self.stats.run_s += run_s
    self.stats.computed_tokens += computed
    self.stats.output_tokens += sum(count for _, count in grown)
    compiled = self.stats.compile_s - compile_before
    self.stats.host_s += time.perf_counter() - t0 - run_s - compiled
    self._maybe_log(sum(count for _, count in grown))
    self._stall.after_step(self._seqs.values())
    return [RequestOutput.of(seq, seq.tokens[len(seq.tokens) - count:]) for seq, count in grown]

  def _multi_step(self, batch: StepBatch) -> bool:
    """Whether ``batch`` runs as a multi-step decode dispatch (pages reserved if so): plain
    decodes only (no drafts, no log-probabilities or penalties asked), nothing waiting, and
    every stop id checkable on the device."""
    if self.decode_steps == 1 or self.scheduler.waiting or not batch.decodes or any(
        c.seq.params.speculative_tokens or c.seq.params.logprobs is not None
        or c.seq.params.penalized or len(c.seq.stop_ids) > step_inputs.STOP_IDS
        for c in batch.decodes):
      return False
    return self.scheduler.reserve_decode_steps(batch, self.decode_steps)

  @staticmethod
  def _record_scores(chunks: list[Chunk], results: _Results) -> None:
    """The prompt log-probabilities a scoring step computed: the entry of prompt token p + 1
    from row p, for each chunk whose request asks (rows lie end to end, chunk by chunk)."""
    t = 0
    for c in chunks:
      seq = c.seq
      if step_inputs.wants_scores(c):
        last = min(c.num_cached + c.num_tokens, seq.num_prompt - 1)  # rows [num_cached, last)
        for p in range(c.num_cached, last):
          seq.prompt_logprobs[p + 1] = results.row_score(t + p - c.num_cached,
                                                         seq.tokens[p + 1],
                                                         seq.params.prompt_logprobs)
        seq.num_scored = max(seq.num_scored, last)
      t += c.num_computed

  def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
    """The distinct ids that end a request: its own, and the engine's eos ids unless it
    ignores them."""
    ids = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
    return tuple(dict.fromkeys(ids))

  def _record(self, seq: Sequence, count: int, b: int, chunk: Chunk, results: _Results) -> None:
    """After ``seq`` took ``count`` tokens of slot ``b``: their log-probabilities (if asked),
    its text when it finished, the drafts' tally and the drafts its next step verifies."""
    if seq.params.logprobs is not None:
      seq.logprobs.extend(results.logprobs(b, j, seq.params.logprobs) for j in range(count))
    if seq.status is Status.FINISHED and seq.detok is not None:
      seq.detok.flush()
      seq.text = seq.detok.text
    if not seq.params.speculative_tokens:
      return
    accepted = results.accepted(b)
    seq.num_drafted += len(chunk.drafts)
    seq.num_accepted += accepted
    self.stats.draft_tokens += len(chunk.drafts)
    self.stats.accepted_tokens += accepted
    seq.drafts = results.drafts(b) if seq.status is not Status.FINISHED else []

  def _stop_reason(self, seq: Sequence) -> str | None:
    """After ``seq`` took a token: "stop" at a stop id or stop string, "length" at its last
    allowed token, else None. Its text grows by the new token only (``IncrementalText``)."""
    token = seq.tokens[-1]
    if seq.detok is not None:
      seq.detok.extend([token])
      seq.text = seq.detok.text
    if token in seq.stop_ids:
      return "stop"
    if seq.detok is not None and seq.detok.stop_at is not None:
      return "stop"
    if len(seq.output) >= seq.params.max_tokens:
      return "length"
    return None

  def _run(self, batch: StepBatch) -> tuple[_Results, float]:
    """Runs one compiled step program over ``batch`` (on every process): what it gave the
    host, and the seconds it ran."""
    shape = self.buckets.shape(batch.chunks, batch.decode_steps)
    inputs = step_inputs.build(batch.chunks, shape, logit_rows=self._logit_rows)
    if self._multiprocess:
      step_inputs.broadcast(shape.header(), inputs)
    outputs, seconds = self._execute(shape, inputs)
    return _Results(outputs, shape.decode_steps > 1), seconds

  def _execute(self, shape: StepShape, inputs: StepInputs):
    program = self._program(shape)
    mesh = self.model.mesh
    arrays = inputs.arrays()
    if mesh is not None:  # token rows split over ``data``; the sequences' few values whole
      n = StepInputs.NUM_TOKEN_ARRAYS
      arrays = ([sharding.put(a, mesh, sharding.BATCH_SPEC) for a in arrays[:n]]
                + [sharding.put(a, mesh, sharding.REPLICATED) for a in arrays[n:]])
    t0 = time.perf_counter()
    outputs, self._pools = program(self._state_leaves, self._pools, *arrays)
    outputs = [sharding.fetch(a) for a in outputs]  # collectives with several processes
    return outputs, time.perf_counter() - t0

  # ---- several processes ------------------------------------------------------------------

  def follow(self) -> None:
    """On every process but 0: runs the steps process 0 schedules, until it calls
    ``shutdown``. Each process builds the same ``Engine`` (same model and settings)."""
    if not self._multiprocess or jax.process_index() == 0:
      raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
    while (received := step_inputs.receive(self._logit_rows)) is not None:
      self._execute(*received)

  def shutdown(self) -> None:
    """On process 0 of a multi-process run: releases the followers from ``follow``."""
    if self._multiprocess:
      self._only_on_process_0("shutdown")
      step_inputs.broadcast(step_inputs.STOP_HEADER, None)

  def _only_on_process_0(self, what: str) -> None:
    if jax.process_index() != 0:
      raise RuntimeError(f"{what}: process 0 schedules a multi-process engine; the others "
                         "call follow()")

  # ---- programs -------------------------------------------------------------------------

  @property
  def programs(self) -> list[CompiledStep]:
    """Every step program compiled so far, with its plan and what its trace contains."""
    return [entry for _, entry in self._programs.values()]

  def warmup(self, *, progress: bool = False) -> tuple[int, float]:
    """Compiles every step program this engine's settings can run (``Buckets.all_shapes``),
    so that serving never compiles; returns ``(programs compiled, seconds)``. Programs
    already compiled (by this engine or another over the same model and pools) are reused.
    ``progress``: a progress bar on stderr."""
    from mla_jax.progress import progress_bar

    t0, before = time.perf_counter(), self.stats.compile_s
    shapes = self.buckets.all_shapes()
    with progress_bar(len(shapes), "compiling step programs", unit="program",
                      enabled=progress) as bar:
      for shape in shapes:
        self._program(shape)
        bar.update(1)
    seconds = time.perf_counter() - t0
    logger.info("engine warm-up: %d step programs ready in %.1f s (%.1f s compiling, the rest "
                "reused)", len(shapes), seconds, self.stats.compile_s - before)
    return len(shapes), seconds

  def _program(self, shape: StepShape):
    if shape in self._programs:
      return self._programs[shape][0]
    key = (shape, self.page_size, self._logit_rows, self.context_topk, self._graphdef,
           self._state_def, signature((self._state_leaves, self._pools)))
    # Engines over the same model, pool shapes and selection share programs.
    self._programs[shape], seconds = _COMPILED.lookup(key, lambda: self._compile(shape))
    self.stats.compile_s += seconds
    return self._programs[shape][0]

  def trace_step(self, shape: StepShape):
    """``(plan, traced)``: the step program of ``shape`` traced (``jax.stages.Traced``), not
    compiled; ``summarize_jaxpr(traced.jaxpr)`` says what it contains (the routing contract
    is asserted on it without compiling, e.g. for a backend whose kernels only run on a
    GPU)."""
    mesh = self.model.mesh
    plan = self.step_plan(shape)
    drafts = self._logit_rows > 1 and shape.decode_steps == 1
    program = StepProgram(plan, self._flat_plan(None, shape.kv_pages, segmented=False)
                          if drafts else None, mtp=bool(self.max_speculative_tokens),
                          page_size=self.page_size, logit_rows=self._logit_rows,
                          decode_steps=shape.decode_steps, greedy=shape.greedy,
                          scores=shape.scores, context=self.context)
    step = program.build(self._graphdef, self._state_def, self.model.layer_groups,
                         self._pool_placement)
    jitted = jax.jit(functionalize(step, False), donate_argnums=1)
    arrays = StepInputs.zeros(shape, self._logit_rows, step_inputs.STOP_IDS).arrays()
    n = StepInputs.NUM_TOKEN_ARRAYS
    placed = lambda spec: None if mesh is None else jax.sharding.NamedSharding(mesh, spec)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed(
        sharding.BATCH_SPEC if i < n else sharding.REPLICATED)) for i, a in enumerate(arrays)]
    return plan, jitted.trace(self._state_leaves, self._pools, *args)

  def _compile(self, shape: StepShape):
    t0 = time.perf_counter()
    plan, traced = self.trace_step(shape)
    compiled = traced.lower().compile()
    seconds = time.perf_counter() - t0
    logger.debug("compiled step program %s (route %s) in %.1f s", shape, plan.route.name,
                 seconds)
    run = lambda *args: compiled(*args)[1]  # (check error: always None unchecked, outputs)
    return run, CompiledStep(shape, plan, summarize_jaxpr(traced.jaxpr), seconds)

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
    while any(self._seqs[i].status is not Status.FINISHED for i in ids):
      self.step()
    return [self.release(i) for i in ids]

  def stream(self, request_id: str | None = None) -> Iterator[RequestOutput]:
    """Steps until no request is left (or, given ``request_id``, until that one finishes),
    yielding each update as it comes (only that request's, when given)."""
    if request_id is not None:
      self._sequence(request_id)
    while self.has_unfinished():
      if request_id is not None and self._seqs[request_id].status is Status.FINISHED:
        return
      for update in self.step():
        if request_id is None or update.request_id == request_id:
          yield update

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
                len(self._programs),
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
