"""``Engine``: continuous batching over paged latent + indexer-key caches.

Each ``step`` asks the scheduler for this step's work (decodes and prefill chunks), turns it
into arrays padded to a few shape buckets, and runs at most two compiled step programs over the
page pools: one for the decodes (one token each) and one for the prefill chunks. A program is
compiled once per (kind, batch bucket, token bucket, cached-token bound, kv pages bucket) and
resolves its ``StepPlan`` from those static values alone: the engine adds no routing of its
own. A prefill program may take the dense-MHA route only when the model class and backend both
can and the plan says so (every chunk fresh, all its keys within the top-k); an MQA-only model
never compiles one. ``programs`` records what every compiled program contains (its traced
scopes), so tests walk them all.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable, Iterator

import jax
import numpy as np
from flax import nnx

from mla_jax import checks, sharding
from mla_jax.cache import resolve_cache_dtype
from mla_jax.checks import functionalize
from mla_jax.generation.programs import signature
from mla_jax.generation.speculative import MAX_SPECULATIVE_TOKENS
from mla_jax.models.lm import CausalLM
from mla_jax.paged_cache import empty_pools
from mla_jax.serving.pages import PageTable
from mla_jax.serving.requests import (MAX_SEED, RequestOutput, SamplingParams,
                                      Sequence, Status, TokenLogprobs)
from mla_jax.serving import step_inputs
from mla_jax.serving.scheduler import Chunk, Scheduler, pages_for
from mla_jax.serving.step_inputs import StepInputs, StepShape
from mla_jax.serving.step_program import StepProgram
from mla_jax.step_plan import StepPlan
from mla_jax.traces import ProgramSummary, summarize_jaxpr

logger = logging.getLogger("mla_jax")


# Compiled step programs of every engine in the process, keyed by shape, model and pools: the
# most recently used ones (an engine also holds its own while it lives).
_COMPILED: collections.OrderedDict = collections.OrderedDict()
MAX_SHARED_PROGRAMS = 256


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  shape: StepShape
  plan: StepPlan
  summary: ProgramSummary  # what the traced program contains (scopes, primitives, kernels)
  compile_s: float


@dataclasses.dataclass
class EngineStats:
  steps: int = 0
  computed_tokens: int = 0     # rows written (prompts, recomputes and decodes)
  output_tokens: int = 0
  draft_tokens: int = 0        # speculative decoding: drafts verified
  accepted_tokens: int = 0     # and accepted
  compile_s: float = 0.0
  run_s: float = 0.0
  host_s: float = 0.0          # scheduling and step-input building (compiles excluded)


class Engine:
  """Continuous batching for a ``CausalLM`` over ``num_pages`` pages of ``page_size`` tokens.

  Offline: ``engine.generate(prompts, max_tokens=..., temperature=...)`` (or one
  ``SamplingParams`` per prompt) returns a ``RequestOutput`` per prompt, in prompt order.
  Incremental: ``add_request`` / ``step`` / ``abort`` / ``has_unfinished``, and ``stream`` to
  iterate over new tokens as steps produce them.

  Args:
    model: the ``CausalLM`` (its backend and layer classes fix what routes can exist).
    num_pages, page_size: the page pool (every layer has one, of the same page ids).
    max_num_seqs: sequences running at once (seats).
    max_step_tokens: tokens computed per step (decodes count one each; prefills fill the rest,
      so a long prompt is prefilled over several steps).
    max_model_len: longest prompt + output (default: the model's ``max_position_embeddings``).
    cache_dtype: ``"fp32" | "bf16" | "fp8"`` (or a float dtype), as ``generate``'s caches.
    tokenizer: for string prompts, ``text`` outputs and ``stop`` strings (``encode``/``decode``).
    eos_token_ids: ids that end every request (beside each request's ``stop_token_ids``).
    prefix_caching: reuse the cached pages of a shared prompt prefix.
    log_interval: seconds between stats lines on the ``mla_jax`` logger (None: never).
    seed: draws the seed of requests that give none.
    max_speculative_tokens: the most draft tokens a request may ask for
      (``SamplingParams.speculative_tokens``, up to ``MAX_SPECULATIVE_TOKENS``); above 0 the
      model needs MTP layers, whose paged caches the engine then keeps for every request (one
      more layer per step): see ``mla_jax.serving.step_program``.
  """

  def __init__(self, model: CausalLM, *, num_pages: int, page_size: int = 64,
               max_num_seqs: int = 32, max_step_tokens: int = 512,
               max_model_len: int | None = None, cache_dtype="fp32", tokenizer=None,
               eos_token_ids: Iterable[int] = (), prefix_caching: bool = True,
               log_interval: float | None = 10.0, seed: int = 0,
               max_speculative_tokens: int = 0):
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
    self.eos_token_ids = tuple(checks.static_int(t, "eos_token_ids entry", minimum=0)
                               for t in eos_token_ids)
    self.max_speculative_tokens = checks.static_int(
        max_speculative_tokens, "max_speculative_tokens", minimum=0,
        maximum=MAX_SPECULATIVE_TOKENS)
    if self.max_speculative_tokens and not model.config.num_mtp_layers:
      raise ValueError("max_speculative_tokens > 0 needs a model with MTP layers (its config "
                       "counts num_mtp_layers = 0; load a checkpoint that stores them)")
    self.tokenizer = tokenizer
    self.log_interval = log_interval
    self.model = model
    self._graphdef, state = nnx.split(model)
    self._state_leaves, self._state_def = jax.tree.flatten(state)
    self._multiprocess = jax.process_count() > 1
    mesh = model.mesh
    self._data_shards = 1 if mesh is None else sharding.axis_size(mesh, sharding.DATA)
    self._pools = self._empty_pools() if mesh is None else jax.jit(
        self._empty_pools, out_shardings=jax.sharding.NamedSharding(mesh, sharding.REPLICATED))()
    self.pages = PageTable(self.num_pages, self.page_size,
                           salt=("mla_jax", str(self.cache_dtype), self.page_size))
    self.scheduler = Scheduler(
        self.pages, max_num_seqs=self.max_num_seqs, max_step_tokens=self.max_step_tokens,
        prefix_caching=prefix_caching,
        prefill_slots=lambda n, t: step_inputs.prefill_slots(n, t, self._data_shards))
    self._seqs: dict[str, Sequence] = {}
    self._ids = itertools.count()
    self._seed_rng = np.random.default_rng(seed)
    self._programs: dict[StepShape, tuple[jax.stages.Compiled, CompiledStep]] = {}
    self.stats = EngineStats()
    self._last_log = time.perf_counter()
    self._log_tokens = 0

  def _empty_pools(self):
    """``(main pools per group and unit, MTP pools per MTP layer or () without)``."""
    config, rows = self.model.config, self.num_pages * self.page_size
    main = tuple(
        tuple(empty_pools(config.mla, group.reps, rows, self.cache_dtype,
                          index_keys=not config.shares_topk(group.layer(0, u)))
              for u in range(group.unit_len))
        for group in self.model.layer_groups)
    mtp = tuple(empty_pools(config.mla, 1, rows, self.cache_dtype, index_keys=True)
                for _ in range(config.num_mtp_layers if self.max_speculative_tokens else 0))
    return main, mtp

  # ---- requests -------------------------------------------------------------------------

  def add_request(self, prompt, params: SamplingParams | None = None, *,
                  request_id: str | None = None) -> str:
    """Queues a request (token ids, or a string with a tokenizer) and returns its id.

    Refused before anything is queued, naming the problem: an empty prompt, ids outside the
    vocabulary, a prompt plus ``max_tokens`` beyond ``max_model_len``, one needing more pages
    than the whole pool, ``stop`` strings without a tokenizer, or a duplicate id.
    """
    self._only_on_process_0("add_request")
    params = SamplingParams() if params is None else params
    tokens = self._checked_prompt(prompt, params)
    if request_id is None:
      request_id = f"req-{next(self._ids)}"
    elif not isinstance(request_id, str) or not request_id:
      raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
    if request_id in self._seqs:
      raise ValueError(f"request id {request_id!r} is already in use")
    seed = params.seed if params.seed is not None else int(self._seed_rng.integers(MAX_SEED))
    seq = Sequence(request_id, tokens, len(tokens), params, seed)
    self._seqs[request_id] = seq
    self.scheduler.add(seq)
    return request_id

  def _checked_prompt(self, prompt, params) -> list[int]:
    """The prompt's token ids, once the request is known to fit (see ``add_request``)."""
    if not isinstance(params, SamplingParams):
      raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise TypeError("a string prompt needs the engine's tokenizer (Engine(..., tokenizer=))")
      prompt = self.tokenizer.encode(prompt)
    if isinstance(prompt, np.ndarray):
      prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(checks.is_int(t) for t in prompt):
      raise TypeError(f"a prompt must be a list of token ids or a string, got "
                      f"{type(prompt).__name__}")
    if not prompt:
      raise ValueError("the prompt is empty: give at least one token")
    vocab = self.model.config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    total = len(prompt) + params.max_tokens
    if total > self.max_model_len:
      raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = "
                       f"{total} exceeds max_model_len {self.max_model_len}")
    if pages_for(total, self.page_size) > self.num_pages:
      raise ValueError(f"the request needs {pages_for(total, self.page_size)} pages of "
                       f"{self.page_size} tokens, the whole pool has {self.num_pages}")
    if params.stop and self.tokenizer is None:
      raise ValueError("stop strings need the engine's tokenizer (Engine(..., tokenizer=))")
    if params.speculative_tokens > self.max_speculative_tokens:
      raise ValueError(f"speculative_tokens {params.speculative_tokens} exceeds the engine's "
                       f"max_speculative_tokens {self.max_speculative_tokens}"
                       + ("" if self.max_speculative_tokens else
                          " (Engine(..., max_speculative_tokens=K) with a model that has MTP "
                          "layers)"))
    return [int(t) for t in prompt]

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
    return RequestOutput.of(self._seqs[request_id])

  def release(self, request_id: str) -> RequestOutput:
    """A finished request's output, forgetting the request (its id may be used again)."""
    seq = self._seqs[request_id]
    if seq.status is not Status.FINISHED:
      raise ValueError(f"request {request_id!r} has not finished")
    return RequestOutput.of(self._seqs.pop(request_id))

  # ---- steps ----------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Runs one step; returns the requests that got tokens in it."""
    self._only_on_process_0("step")
    t0, compile_before = time.perf_counter(), self.stats.compile_s
    batch = self.scheduler.schedule()
    sampled, rows, run_s = {}, {}, 0.0
    for chunks, kind in ((batch.prefills, "prefill"), (batch.decodes, "decode")):
      if chunks:
        outputs, seconds = self._run(chunks, kind)
        tokens, accepted = outputs[0].tolist(), outputs[1].tolist()  # one conversion a step
        for b, chunk in enumerate(chunks):
          sampled[id(chunk)] = tokens[b][:accepted[b] + 1]
          rows[id(chunk.seq)] = (chunk, outputs, b, accepted[b])
        run_s += seconds
    grown = self.scheduler.commit(batch, sampled, self._stop_reason)
    for seq, count in grown:
      self._record(seq, count, *rows[id(seq)])
    self.stats.steps += 1
    self.stats.run_s += run_s
    self.stats.computed_tokens += batch.num_tokens
    self.stats.output_tokens += sum(count for _, count in grown)
    compiled = self.stats.compile_s - compile_before
    self.stats.host_s += time.perf_counter() - t0 - run_s - compiled
    self._maybe_log(sum(count for _, count in grown))
    return [RequestOutput.of(seq, seq.tokens[-count:]) for seq, count in grown]

  def _record(self, seq: Sequence, count: int, chunk: Chunk, outputs, b: int,
              accepted: int) -> None:
    """After ``seq`` took ``count`` tokens of row ``b`` (``accepted`` of its drafts): their
    log-probabilities (if asked), the drafts' tally and the drafts its next step verifies."""
    if seq.params.logprobs is not None:
      seq.logprobs.extend(_token_logprobs(outputs, b, j, seq.params.logprobs)
                          for j in range(count))
    if not seq.params.speculative_tokens:
      return
    seq.num_drafted += len(chunk.drafts)
    seq.num_accepted += accepted
    self.stats.draft_tokens += len(chunk.drafts)
    self.stats.accepted_tokens += accepted
    # What the program drafted for this row (its rule: no more than the tokens left - 1).
    wanted = min(seq.params.speculative_tokens, seq.params.max_tokens - len(seq.output) - 1)
    drafting = seq.status is not Status.FINISHED and chunk.num_tokens == 1 and wanted > 0
    seq.drafts = outputs[5][b, :wanted].tolist() if drafting else []

  def _stop_reason(self, seq: Sequence) -> str | None:
    token = seq.tokens[-1]
    if token in seq.params.stop_token_ids or token in self.eos_token_ids:
      return "stop"
    if seq.params.stop:
      seq.text = self.tokenizer.decode(seq.output)
      if any(s in seq.text for s in seq.params.stop):
        return "stop"
    if len(seq.output) >= seq.params.max_tokens:
      return "length"
    return None

  def _run(self, chunks: list[Chunk], kind: str):
    """Runs one compiled step program over ``chunks`` (on every process): its outputs (row b
    for chunk b; meaningless for chunks that do not sample) and the seconds it ran. The
    outputs are host arrays (``StepProgram.build``): new tokens [B, J] (the first
    ``accepted + 1`` of a row are its), accepted drafts [B], the tokens' log-probabilities
    [B, J], the most likely tokens' ids and log-probabilities [B, J, K], next drafts [B, D]."""
    shape = step_inputs.step_shape(chunks, kind, self.page_size, self._data_shards)
    inputs = step_inputs.build(chunks, shape)
    if self._multiprocess:
      step_inputs.broadcast(shape.header(), inputs)
    return self._execute(shape, inputs)

  def _execute(self, shape: StepShape, inputs: StepInputs):
    program = self._program(shape)
    mesh = self.model.mesh
    arrays = inputs.arrays() if mesh is None else \
        [sharding.put(a, mesh, sharding.BATCH_SPEC) for a in inputs.arrays()]
    t0 = time.perf_counter()
    sampled, self._pools = program(self._state_leaves, self._pools, *arrays)
    sampled = [sharding.fetch(a) for a in sampled]  # collectives with several processes
    return sampled, time.perf_counter() - t0

  # ---- several processes ------------------------------------------------------------------

  def follow(self) -> None:
    """On every process but 0: runs the steps process 0 schedules, until it calls
    ``shutdown``. Each process builds the same ``Engine`` (same model and settings)."""
    if not self._multiprocess or jax.process_index() == 0:
      raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
    while (received := step_inputs.receive()) is not None:
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

  def _plan(self, shape: StepShape, tokens: int | None = None) -> StepPlan:
    rows = shape.kv_pages * self.page_size
    return self.model.step_plan(shape.tokens if tokens is None else tokens, shape.cached_bound,
                                capacity=rows, kv_rows=rows)

  def _program(self, shape: StepShape):
    if shape in self._programs:
      return self._programs[shape][0]
    key = (shape, self.page_size, self._graphdef, self._state_def,
           signature((self._state_leaves, self._pools)))
    if key in _COMPILED:  # engines over the same model and pool shapes share programs
      _COMPILED.move_to_end(key)
    else:
      _COMPILED[key] = self._compile(shape)
      self.stats.compile_s += _COMPILED[key][1].compile_s
      if len(_COMPILED) > MAX_SHARED_PROGRAMS:
        _COMPILED.popitem(last=False)
    self._programs[shape] = _COMPILED[key]
    return _COMPILED[key][0]

  def _compile(self, shape: StepShape):
    t0 = time.perf_counter()
    plan = self._plan(shape)
    drafts = shape.kind == "decode" and shape.tokens > 1
    program = StepProgram(shape.kind, plan, self._plan(shape, 1) if drafts else None,
                          mtp=bool(self.max_speculative_tokens), page_size=self.page_size)
    step = program.build(self._graphdef, self._state_def, self.model.layer_groups)
    jitted = jax.jit(functionalize(step, False), donate_argnums=1)
    mesh = self.model.mesh
    placed = None if mesh is None else jax.sharding.NamedSharding(mesh, sharding.BATCH_SPEC)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed)
            for a in StepInputs.zeros(shape).arrays()]
    traced = jitted.trace(self._state_leaves, self._pools, *args)
    compiled = traced.lower().compile()
    seconds = time.perf_counter() - t0
    logger.debug("compiled %s step %s (route %s) in %.1f s", shape.kind, shape,
                 plan.route.name, seconds)
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
    token_ids = [self._checked_prompt(prompt, p) for prompt, p in zip(prompts, per_prompt)]
    ids = [self.add_request(tokens, p) for tokens, p in zip(token_ids, per_prompt)]
    while any(self._seqs[i].status is not Status.FINISHED for i in ids):
      self.step()
    return [self.release(i) for i in ids]

  def stream(self, request_id: str | None = None) -> Iterator[RequestOutput]:
    """Steps until no request is left (or, given ``request_id``, until that one finishes),
    yielding each update as it comes (only that request's, when given)."""
    if request_id is not None and request_id not in self._seqs:
      raise KeyError(f"no request with id {request_id!r}")
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


def _token_logprobs(outputs, b: int, j: int, n: int) -> TokenLogprobs:
  """Token ``j`` of row ``b`` of a step program's outputs as a ``TokenLogprobs`` with the
  ``n`` most likely."""
  tokens_BJ, _, logprob_BJ, top_ids_BJK, top_logprobs_BJK, _ = outputs
  return TokenLogprobs(int(tokens_BJ[b, j]), float(logprob_BJ[b, j]),
                       tuple(zip(top_ids_BJK[b, j, :n].tolist(),
                                 top_logprobs_BJK[b, j, :n].tolist())))
