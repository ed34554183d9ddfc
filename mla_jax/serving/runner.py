"""``ModelRunner``: an engine's device side. It holds the page pools and each slot's last token,
compiles a step program per ``StepShape`` (a process-wide cache shares them between engines),
dispatches steps without waiting for them, and, with several processes, broadcasts each step
to the followers, which run the same program on it.

A step whose key-block bucket has no program yet runs on the covering program of its kind
(``Buckets.covering``: what warm-up compiles) while its own compiles on a background thread,
so serving never waits for a compile once warm-up is done; the tokens are the same either way
(the indexer's selection does not depend on the blocks' padding).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import sharding
from mla_jax.checks import functionalize
from mla_jax.decoding.programs import ProgramCache, signature
from mla_jax.serving import step_inputs
from mla_jax.serving.step_inputs import Buckets, Layout, PackedInputs, StepShape
from mla_jax.serving.step_program import StepProgram
from mla_jax.step_plan import StepPlan
from mla_jax.traces import ProgramSummary, summarize_jaxpr

logger = logging.getLogger("mla_jax")

# Compiled step programs of every engine in the process, keyed by shape, model and pools: the
# most recently used ones (an engine also holds its own while it lives).
_COMPILED = ProgramCache(max_size=256)
_COMPILED_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  shape: StepShape
  plan: StepPlan
  summary: ProgramSummary  # what the traced program contains (scopes, primitives, kernels)
  compile_s: float


def engine_pools(model, rows: int, cache_dtype, *, mtp: bool, page_size: int | None = None,
                 num_state_slots: int = 0):
  """An engine's page pools of ``rows`` token rows (the decode protocol's ``init_pools``:
  the model's own, its MTP layers', () without speculative decoding) and each row's token
  id (``mla_jax.decoding.penalties``): ``(main, mtp, token_ids)``."""
  main, mtp_pools = model.init_pools(rows, cache_dtype, page_size=page_size,
                                     num_state_slots=num_state_slots, mtp=mtp)
  return main, mtp_pools, jnp.zeros((rows,), jnp.int32)


def page_bytes(model, page_size: int, cache_dtype="fp32", *, mtp: bool = False) -> int:
  """The bytes one page of ``page_size`` tokens takes in every pool of an engine on one
  device (shapes only: nothing is allocated). The engine holds its pools whole on every
  device, or on a mesh with a ``context`` axis each device 1/context of the layers' pools
  (and the token ids whole): the bytes of a page, averaged over the ranks. A family's
  per-sequence state (``init_pools``' state slots) is not a page's: it is left out."""
  main, mtp_pools, token_ids = jax.eval_shape(
      lambda: engine_pools(model, page_size, cache_dtype, mtp=mtp, page_size=page_size))
  ranks = sharding.axis_size(model.mesh, sharding.CONTEXT)
  return -(-sharding.tree_bytes((main, mtp_pools)) // ranks) + sharding.tree_bytes(token_ids)


@dataclasses.dataclass
class InFlight:
  """A dispatched step: its packed outputs on their way to the host."""

  layout: Layout
  packed: jax.Array
  dispatched_at: float

  def read(self) -> dict[str, np.ndarray]:
    """The outputs on the host (blocks until the step has run)."""
    array = self.packed
    if not array.is_fully_addressable:  # replicated: this process's copy is the whole
      array = array.addressable_shards[0].data
    return self.layout.unpack_outputs(np.asarray(array))


class ModelRunner:
  """The pools, programs and dispatch of an engine over ``model`` (see the module docstring).

  ``plan_of(shape)``: a shape's ``StepPlan`` and its further drafts' (or None);
  ``num_slots``: persistent slots (each running request's last token lives in one).
  """

  def __init__(self, model, *, num_rows: int, page_size: int, cache_dtype, num_slots: int,
               logit_rows: int, mtp: bool, context_topk: str, buckets: Buckets, plan_of,
               num_state_slots: int = 0):
    self.model, self.page_size, self.cache_dtype = model, page_size, cache_dtype
    self.logit_rows, self.mtp, self.context_topk = logit_rows, mtp, context_topk
    self.buckets, self._plan_of = buckets, plan_of
    self._graphdef, state = nnx.split(model)
    self._state_leaves, self._state_def = jax.tree.flatten(state)
    self.context = sharding.axis_size(model.mesh, sharding.CONTEXT)
    self._multiprocess = jax.process_count() > 1
    make_pools = lambda: engine_pools(model, num_rows, cache_dtype, mtp=mtp,
                                      page_size=page_size, num_state_slots=num_state_slots)
    mesh = model.mesh
    self._replicated = None if mesh is None else jax.sharding.NamedSharding(
        mesh, sharding.REPLICATED)
    # Where the pools live on the mesh, which every compiled step keeps (None: no mesh).
    self._pool_placement = None if mesh is None else self._pool_shardings(make_pools)
    self.pools = make_pools() if mesh is None else jax.jit(
        make_pools, out_shardings=self._pool_placement)()
    self.last_tokens = jnp.zeros((num_slots,), jnp.int32)
    if mesh is not None:
      self.last_tokens = jax.device_put(self.last_tokens, self._replicated)
    self._programs: dict[StepShape, tuple] = {}
    self._lock = threading.Lock()
    self._background = None  # a one-thread pool, made on first need
    self._compiling: dict[StepShape, concurrent.futures.Future] = {}
    self.compile_s = 0.0  # compiles a step waited for (warm-up included)
    self.background_compile_s = 0.0

  def _pool_shardings(self, make_pools):
    """Where the pools live on the model's mesh: the layers' rows split over ``context``
    (``sharding.POOL_SPEC``), the token ids whole on every device."""
    main, mtp, _ = jax.eval_shape(make_pools)
    placed = lambda spec: jax.sharding.NamedSharding(self.model.mesh, spec)
    rows = lambda tree: jax.tree.map(lambda _: placed(sharding.POOL_SPEC), tree)
    return rows(main), rows(mtp), placed(sharding.REPLICATED)

  def layout(self, shape: StepShape) -> Layout:
    return Layout(shape, self.logit_rows, self.mtp, self.model.vocab_size,
                  self.model.sequence_state)

  # ---- programs -------------------------------------------------------------------------

  @property
  def programs(self) -> list[CompiledStep]:
    """Every step program compiled so far, with its plan and what its trace contains."""
    with self._lock:
      return [entry for _, entry in self._programs.values()]

  def program_shape(self, shape: StepShape) -> StepShape:
    """The shape whose program runs a step of ``shape``: its own when compiled; else, while
    its own compiles in the background, the covering program when that one is compiled;
    else its own, compiled now."""
    with self._lock:
      if shape in self._programs:
        return shape
      cover = self.buckets.covering(shape)
      covered = cover in self._programs
    with _COMPILED_LOCK:  # compiled already, by another engine over the same model and pools
      entry = _COMPILED.get(self._key(shape))
    if entry is not None:
      with self._lock:
        self._programs[shape] = entry
      return shape
    if not covered:
      self._program(shape)
      return shape
    self._compile_in_background(shape)
    return cover

  def _compile_in_background(self, shape: StepShape) -> None:
    with self._lock:
      if shape in self._compiling:
        return
      if self._background is None:
        self._background = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="mla-jax-compile")
      self._compiling[shape] = self._background.submit(self._program, shape, background=True)

  def wait_for_compiles(self) -> None:
    """Blocks until every background compile has finished (benchmarks, tests)."""
    with self._lock:
      futures = list(self._compiling.values())
    for future in futures:
      future.result()

  def _program(self, shape: StepShape, *, background: bool = False):
    with self._lock:
      if shape in self._programs:
        return self._programs[shape][0]
    # Engines over the same model, pool shapes and selection share programs (one compile at
    # a time: a background compile and a step's own never trace together).
    with _COMPILED_LOCK:
      entry, seconds = _COMPILED.lookup(self._key(shape), lambda: self._compile(shape))
    with self._lock:
      self._programs[shape] = entry
      self._compiling.pop(shape, None)
      if background:
        self.background_compile_s += seconds
      else:
        self.compile_s += seconds
    return entry[0]

  def _key(self, shape: StepShape):
    """What a compiled program is specialised to, beyond its shape."""
    return (shape, self.page_size, self.logit_rows, self.context_topk, self._graphdef,
            self._state_def, signature((self._state_leaves, self.pools, self.last_tokens)))

  def step_program(self, shape: StepShape) -> StepProgram:
    plan, draft_plan = self._plan_of(shape)
    return StepProgram(self.layout(shape), plan, draft_plan, self.page_size, self.context)

  def trace_step(self, shape: StepShape):
    """``(plan, traced)``: the step program of ``shape`` traced (``jax.stages.Traced``), not
    compiled; ``summarize_jaxpr(traced.jaxpr)`` says what it contains (the routing contract
    is asserted on it without compiling, e.g. for a backend whose kernels only run on a
    GPU)."""
    program = self.step_program(shape)
    step = program.build(self._graphdef, self._state_def, self._pool_placement)
    out_shardings = None
    if self._replicated is not None:
      out_shardings = (None, (self._replicated, self._pool_placement, self._replicated))
    jitted = jax.jit(functionalize(step, False), donate_argnums=(1, 2),
                     out_shardings=out_shardings)
    blank = program.layout.zeros()
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._replicated)
            for a in (blank.ints, blank.floats)]
    # Shapes only: the pools may be donated by a step running meanwhile (background compiles).
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
    pools, last_tokens = jax.tree.map(spec, (self.pools, self.last_tokens))
    return program.plan, jitted.trace(self._state_leaves, pools, last_tokens, *args)

  def _compile(self, shape: StepShape):
    t0 = time.perf_counter()
    plan, traced = self.trace_step(shape)
    compiled = traced.lower().compile()
    seconds = time.perf_counter() - t0
    logger.debug("compiled step program %s (%s) in %.1f s", shape,
                 ", ".join(sorted({str(p) for p in self.model.plan_layers(plan)})), seconds)
    run = lambda *args: compiled(*args)[1]  # (check error: always None unchecked, outputs)
    return run, CompiledStep(shape, plan, summarize_jaxpr(traced.jaxpr), seconds)

  # ---- steps ----------------------------------------------------------------------------

  def dispatch(self, shape: StepShape, inputs: PackedInputs) -> InFlight:
    """Runs ``shape``'s program on ``inputs`` (on every process) without waiting for it; the
    outputs start their copy to the host at once."""
    packed = (inputs.ints, inputs.floats)
    if self._multiprocess:
      step_inputs.broadcast(shape.header(), packed)
    return self._run(shape, packed)

  def _run(self, shape: StepShape, packed) -> InFlight:
    program = self._program(shape)
    if self._replicated is not None:
      packed = [sharding.put(a, self.model.mesh, sharding.REPLICATED) for a in packed]
    t0 = time.perf_counter()
    outputs, self.pools, self.last_tokens = program(self._state_leaves, self.pools,
                                                    self.last_tokens, *packed)
    outputs.copy_to_host_async()
    return InFlight(self.layout(shape), outputs, t0)

  # ---- several processes ------------------------------------------------------------------

  def follow(self) -> None:
    """On every process but 0: runs the steps process 0 dispatches, until it stops."""
    while (received := step_inputs.receive(self.layout)) is not None:
      self._run(*received)

  def shutdown(self) -> None:
    """On process 0 of a multi-process run: releases the followers from ``follow``."""
    if self._multiprocess:
      step_inputs.broadcast(step_inputs.STOP_HEADER, None)
