"""``generate``: a checked request, its compiled programs, then the decode loop.

The loop runs one prefill, then decode dispatches of ``steps_per_dispatch`` steps until
every sequence has its tokens or has emitted an end-of-sequence id. Per dispatch the host
only calls the compiled program on arrays it already holds (the state's leaves, split once
per call; the caches, tokens and step counter the last dispatch returned) and reads back the
emitted tokens. With ``speculative_tokens`` the prefill also runs the MTP layer and each
dispatch runs speculative iterations (``generation.speculative``) instead of decode steps.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from mla_jax import sharding
from mla_jax.cache import bucket_rows
from mla_jax.checks import throw
from mla_jax.decoding import DECODE_STEPS_PER_DISPATCH
from mla_jax.decoding.stops import stop_reason
from mla_jax.generation import programs
from mla_jax.generation.arguments import Request, check_request
from mla_jax.generation.programs import (DecodeSettings, PrefillSettings,
                                         SpeculativePrefillSettings, SpeculativeSettings)
from mla_jax.generation.speculative import DraftState
from mla_jax.progress import progress_bar
from mla_jax.routing import PrefillRoute

DEFAULT_STEPS_PER_DISPATCH = DECODE_STEPS_PER_DISPATCH


class TokenRates:
  """Throughput of a generation result with ``prefill_tokens`` / ``prefill_s`` and
  ``decode_tokens`` / ``decode_s``."""

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prefill_tokens / max(self.prefill_s, 1e-9)

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / max(self.decode_s, 1e-9)


@dataclasses.dataclass
class GenerationResult(TokenRates):
  """Generated ids per sequence (ending at eos when it was produced) and measurements."""

  tokens: list[list[int]]
  prefill_routes: list[PrefillRoute]
  compile_s: float  # 0 when every program was compiled by an earlier call
  prefill_s: float
  decode_s: float
  prefill_tokens: int
  decode_tokens: int
  step_logits: np.ndarray | None = None  # [B, steps, vocab] when ``return_logits``
  decode_buckets: tuple[int, ...] = ()  # the cache rows read by each decode program used
  drafted: int = 0  # speculative decoding: draft tokens proposed (k per verify step)
  accepted: int = 0  # ... and accepted

  @property
  def acceptance_rate(self) -> float | None:
    """Accepted draft tokens / proposed ones over the whole call, each unfinished sequence's
    every verify step counted; None when no draft was proposed (``speculative_tokens=0``, or
    a single new token, which the prefill samples)."""
    return self.accepted / self.drafted if self.drafted else None



def _place(array, mesh, spec=sharding.BATCH_SPEC):
  """A host array on the model's mesh (batch over ``data``), or on the default device."""
  return jnp.asarray(array) if mesh is None else sharding.put(array, mesh, spec)


class _Programs:
  """One generation's compiled programs: a model structure's entries of ``programs.cache``,
  with the seconds spent compiling them."""

  def __init__(self, model, request: Request, steps: int, return_logits: bool):
    self.model, self.capacity = model, request.capacity
    self.prefill_plan = model.step_plan(request.longest, 0, capacity=request.capacity)
    graphdef, state = nnx.split(model)
    self.state_leaves, state_def = jax.tree.flatten(state)  # split once per generate
    self._get = lambda *args, settings: programs.cache.get(
        graphdef, state_def, self.state_leaves, *args, settings=settings)
    self.speculative_tokens = request.speculative_tokens
    prefill_settings = (SpeculativePrefillSettings if self.speculative_tokens else
                        PrefillSettings)
    self.prefill_settings = prefill_settings(self.prefill_plan, request.sampling,
                                             request.checked)
    self._decode_settings = dict(sampling=request.sampling, eos_id=request.eos_id, steps=steps,
                                 checked=request.checked)
    if not self.speculative_tokens:
      self._decode_settings["keep_logits"] = return_logits
    self.decoders: dict = {}  # kv_rows -> compiled decode program
    self.compile_s = 0.0

  def prefill(self, *args):
    program, seconds = self._get(*args, settings=self.prefill_settings)
    self.compile_s += seconds
    return program

  def decoder(self, kv_rows: int, *args):
    """The decode program reading ``kv_rows`` cache rows, compiled on its first use (a
    speculative one with ``speculative_tokens``)."""
    if kv_rows not in self.decoders:
      plan = lambda width: self.model.step_plan(width, None, capacity=self.capacity,
                                                kv_rows=kv_rows)
      if self.speculative_tokens:
        settings = SpeculativeSettings(plan(self.speculative_tokens + 1), plan(1),
                                       **self._decode_settings)
      else:
        settings = DecodeSettings(plan(1), **self._decode_settings)
      self.decoders[kv_rows], seconds = self._get(*args, settings=settings)
      self.compile_s += seconds
    return self.decoders[kv_rows]


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | list[int] | None = None,
             cache_capacity: int | None = None, cache_dtype=jnp.float32,
             steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH, progress: bool = False,
             return_logits: bool = False, checks: bool = False,
             speculative_tokens: int = 0) -> GenerationResult:
  """Generates up to ``max_new_tokens`` after each prompt (a batch of ragged prompts).

  Args:
    model: a decode model (``mla_jax.decoding.protocol``): a ``CausalLM``, a ``V4CausalLM``.
    prompt_ids: a list of id lists (any lengths) or an int array [B, T] / [T].
    max_new_tokens: tokens to generate per sequence (fewer when it emits ``eos_id``).
    temperature, top_p: 0 is greedy; otherwise nucleus sampling.
    seed: sampling seed (one key per step, folded from it).
    eos_id: a sequence stops after emitting it (or any id of a list); the others go on.
    cache_capacity: defaults to the longest prompt plus ``max_new_tokens``.
    cache_dtype: the latent and indexer-key caches: ``"fp32" | "bf16"`` (or a float dtype),
      or ``"fp8"``: e4m3 with float32 scales (656 + 132 bytes per token per layer at
      DeepSeek-V3.2 sizes), quantized on write and dequantized where attention reads them.
    steps_per_dispatch: decode steps run by one compiled program (one host round trip);
      tokens and logits do not depend on it.
    progress: draw a progress bar on stderr while decoding (advanced per dispatch).
    return_logits: keep the logits of every generated token (for tests and notebooks).
    checks: run the compiled programs checked (``mla_jax.checks``): a failed run-time check
      (cache overflow, out-of-range lengths or ids, a query row without a top-k index)
      raises ``checks.CheckError`` instead of giving wrong tokens. Slower to compile and run.
    speculative_tokens: k > 0 decodes speculatively (``generation.speculative``): each
      iteration drafts k tokens with the model's MTP layers (``num_mtp_layers >= 1``)
      and verifies them in one forward of k + 1 tokens. Greedy tokens are the plain ones;
      sampled tokens have the plain distribution (rejection sampling), not the same draws.
      At most ``decoding.speculative.MAX_SPECULATIVE_TOKENS``; the cache needs k more rows;
      ``steps_per_dispatch`` then counts iterations; not with ``return_logits``.

  Integer arguments may be Python or NumPy ints. Each decode dispatch reads only the cache
  rows the live context can reach by its end, rounded up to a bucket
  (``mla_jax.cache.bucket_rows``), so the work per token follows the live context, not
  ``cache_capacity``; one program is compiled per bucket used.
  """
  request = check_request(model, prompt_ids, max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=seed, eos_id=eos_id, cache_capacity=cache_capacity,
                          cache_dtype=cache_dtype, steps_per_dispatch=steps_per_dispatch,
                          checks=checks, speculative_tokens=speculative_tokens,
                          return_logits=return_logits)
  new_tokens = request.max_new_tokens
  steps = min(request.steps_per_dispatch, max(new_tokens - 1, 1))
  compiled = _Programs(model, request, steps, return_logits)
  mesh = model.mesh
  # A verify step writes k draft rows past what its sequence keeps (``spare``: rings hold them).
  caches = model.init_cache(request.batch, request.capacity, request.cache_dtype,
                            spare=request.speculative_tokens)
  ids_BT, lens_B = _place(request.ids_BT, mesh), _place(request.lens_B, mesh)
  seed_arr = _place(np.uint32(request.seed), mesh, sharding.REPLICATED)
  if request.speculative_tokens:
    return _speculate(compiled, request, steps, caches, ids_BT, lens_B, seed_arr, mesh,
                      progress=progress)

  prefill = compiled.prefill(caches, ids_BT, lens_B, seed_arr)
  t0 = time.perf_counter()
  err, (tokens_B, _, caches) = prefill(compiled.state_leaves, caches, ids_BT, lens_B, seed_arr)
  throw(err)
  tokens_B.block_until_ready()
  prefill_s = time.perf_counter() - t0

  decoded = _decode_loop(compiled, request, steps, caches, tokens_B, seed_arr, mesh,
                         progress=progress, return_logits=return_logits)
  tokens = [[int(t) for t in row if t >= 0] for row in decoded.rows]
  return GenerationResult(
      tokens=tokens,
      prefill_routes=model.plan_layers(compiled.prefill_plan),
      compile_s=compiled.compile_s, prefill_s=prefill_s, decode_s=decoded.seconds,
      prefill_tokens=int(request.lens_B.sum()),
      decode_tokens=sum(len(t) for t in tokens) - request.batch,
      step_logits=decoded.logits(model.vocab_size) if return_logits else None,
      decode_buckets=tuple(sorted(compiled.decoders)))


def _check_not_past(emitted: int, new_tokens: int, done: np.ndarray) -> None:
  """Before a dispatch: every sequence that has emitted ``new_tokens`` tokens has ended
  (``stops.ends`` in the programs); an internal error, named rather than a loop without end."""
  if emitted >= new_tokens:
    raise RuntimeError(f"generate: {int((~done).sum())} sequences not ended after "
                       f"{new_tokens} tokens")


def _speculate(compiled: _Programs, request: Request, steps: int, caches, ids_BT, lens_B,
               seed_arr, mesh, *, progress: bool) -> GenerationResult:
  """``generate`` with speculative decoding: the MTP prefill, then dispatches of ``steps``
  iterations until every sequence has its tokens or its end-of-sequence id.

  The host keeps each sequence's tokens (the emitted buffer's ids >= 0, in order) and knows
  from them which are done and how far each cache reaches, for the next dispatch's bucket."""
  model, k = compiled.model, request.speculative_tokens
  new_tokens, eos_ids, batch = request.max_new_tokens, request.eos_id or (), request.batch
  mtp_caches = model.init_mtp_cache(batch, request.capacity, request.cache_dtype, spare=k)
  prefill = compiled.prefill(caches, mtp_caches, ids_BT, lens_B, seed_arr)
  t0 = time.perf_counter()
  err, (tokens_B, caches, mtp_caches, draft_BV, hidden_BD) = prefill(
      compiled.state_leaves, caches, mtp_caches, ids_BT, lens_B, seed_arr)
  throw(err)
  first = sharding.fetch(tokens_B)
  prefill_s = time.perf_counter() - t0

  rows = [[int(t)] for t in first]
  ended = lambda: np.array([stop_reason(r[-1], eos_ids, len(r), new_tokens) is not None
                            for r in rows])
  count = lambda value: _place(np.full(batch, value, np.int32), mesh)  # one buffer each
  state = DraftState(tokens_B=tokens_B, draft_BV=draft_BV, hidden_BD=hidden_BD,
                     done_B=_place(ended(), mesh), emitted_B=count(1), accepted_B=count(0),
                     drafted_B=count(0))
  # Iteration i reads cache rows up to n + (i + 1)(k + 1), and n + k + 1 at most once the
  # last token is due (n <= longest + new_tokens - 2 while a sequence is unfinished).
  rows_by = lambda: bucket_rows(min(max(int(lens) + len(r) - 1 for lens, r in
                                        zip(request.lens_B, rows)) + steps * (k + 1),
                                    request.longest + new_tokens + k - 1), request.capacity)
  iteration_arr = _place(np.int32(1), mesh, sharding.REPLICATED)
  end_arr = _place(np.int32(new_tokens), mesh, sharding.REPLICATED)
  args = lambda: (caches, mtp_caches, state, seed_arr, iteration_arr, end_arr)
  done = ended()
  if not done.all():  # the first bucket's program is compiled before the timing starts
    compiled.decoder(rows_by(), *args())
  bar = progress_bar(new_tokens, "decode", unit="tok", enabled=progress, initial=1)
  seconds, iterations = 0.0, 1
  while not done.all():
    _check_not_past(iterations, new_tokens, done)  # each iteration emits a token
    iterations += steps
    program = compiled.decoder(rows_by(), *args())  # a new bucket compiles outside the timing
    t0 = time.perf_counter()
    err, (caches, mtp_caches, state, iteration_arr, emitted_NBK) = program(
        compiled.state_leaves, *args())
    throw(err)
    emitted = sharding.fetch(emitted_NBK)  # syncs: the dispatch has finished
    seconds += time.perf_counter() - t0
    for row, new in zip(rows, emitted.swapaxes(0, 1).reshape(batch, -1)):
      row.extend(int(t) for t in new if t >= 0)
    done = ended()
    bar.update(max(len(r) for r in rows) - bar.n)
  bar.close()
  return GenerationResult(
      tokens=rows, prefill_routes=model.plan_layers(compiled.prefill_plan),
      compile_s=compiled.compile_s, prefill_s=prefill_s, decode_s=seconds,
      prefill_tokens=int(request.lens_B.sum()), decode_tokens=sum(map(len, rows)) - batch,
      decode_buckets=tuple(sorted(compiled.decoders)),
      drafted=int(sharding.fetch(state.drafted_B).sum()),
      accepted=int(sharding.fetch(state.accepted_B).sum()))


@dataclasses.dataclass
class _Decoded:
  rows: np.ndarray  # [B, max_new_tokens] ids, -1 after a sequence finished
  seconds: float  # in decode dispatches, compilation excluded
  step_logits: list  # [B, steps, V] per dispatch, when kept

  def logits(self, vocab_size: int) -> np.ndarray:
    """[B, max_new_tokens - 1, V]: the logits of every decode step."""
    if not self.step_logits:
      return np.zeros((self.rows.shape[0], 0, vocab_size), np.float32)
    return np.concatenate(self.step_logits, axis=1)[:, :self.rows.shape[1] - 1]


def _decode_loop(compiled: _Programs, request: Request, steps: int, caches, tokens_B,
                 seed_arr, mesh, *, progress: bool, return_logits: bool) -> _Decoded:
  """The decode dispatches after a prefill that sampled ``tokens_B`` (the first new token)."""
  new_tokens, eos_ids = request.max_new_tokens, request.eos_id or ()
  rows_by = lambda step: bucket_rows(request.longest + min(step + steps, new_tokens) - 1,
                                     request.capacity)
  out, logits = [sharding.fetch(tokens_B)[:, None]], []
  done = np.array([stop_reason(int(t), eos_ids, 1, new_tokens) is not None for t in out[0][:, 0]])
  done_B = _place(done, mesh)
  step_arr = _place(np.int32(1), mesh, sharding.REPLICATED)
  end_arr = _place(np.int32(new_tokens), mesh, sharding.REPLICATED)
  if not done.all():  # the first bucket's program is compiled before the timing starts
    compiled.decoder(rows_by(1), caches, tokens_B, done_B, seed_arr, step_arr, end_arr)
  bar = progress_bar(new_tokens, "decode", unit="tok", enabled=progress, initial=1)
  seconds, step = 0.0, 1
  while not done.all():  # the programs end each sequence at its last token too (``ends``)
    _check_not_past(step, new_tokens, done)
    # A new bucket compiles outside the timing.
    program = compiled.decoder(rows_by(step), caches, tokens_B, done_B, seed_arr, step_arr,
                               end_arr)
    t0 = time.perf_counter()
    err, (tokens_B, done_B, caches, step_arr, emitted_NB, logits_NBV) = program(
        compiled.state_leaves, caches, tokens_B, done_B, seed_arr, step_arr, end_arr)
    throw(err)
    emitted = sharding.fetch(emitted_NB).T  # syncs: the dispatch has finished
    seconds += time.perf_counter() - t0
    out.append(emitted)
    if return_logits:
      logits.append(sharding.fetch(logits_NBV).swapaxes(0, 1))
    done = sharding.fetch(done_B)
    step += steps
    bar.update(min(step, new_tokens) - bar.n)
  bar.close()
  return _Decoded(np.concatenate(out, axis=1)[:, :new_tokens], seconds, logits)
