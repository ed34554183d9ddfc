"""``generate``: a checked request, its compiled programs, then its decode.

The decode runs one prefill, then decode dispatches of ``steps_per_dispatch`` steps (the one
device decode loop, ``decoding.steps``) until every sequence has its tokens or has emitted an
end-of-sequence id, through the one host decode loop (``decoding.driver.Pipeline``): each
dispatch is sent before the last one's tokens are read. Per dispatch the host only calls the
compiled program on arrays it already holds (the state's leaves, split once per call; the
caches, tokens, progress and step counter the last dispatch returned) and reads back the
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
from mla_jax.decoding.driver import Pipeline
from mla_jax.decoding.steps import Progress
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
    seed: sampling seed: sequence b draws with key ``key(seed + b)`` folded with each token's
      index, as an engine request of seed ``seed + b`` draws (``decoding.sampling``).
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
  steps = min(request.steps_per_dispatch, max(request.max_new_tokens - 1, 1))
  compiled = _Programs(model, request, steps, return_logits)
  mesh = model.mesh
  # A verify step writes k draft rows past what its sequence keeps (``spare``: rings hold them).
  caches = model.init_cache(request.batch, request.capacity, request.cache_dtype,
                            spare=request.speculative_tokens)
  ids_BT, lens_B = _place(request.ids_BT, mesh), _place(request.lens_B, mesh)
  seed_arr = _place(np.uint32(request.seed), mesh, sharding.REPLICATED)
  decode = (_SpeculativeDecode if request.speculative_tokens else _PlainDecode)(
      compiled, request, steps, seed_arr)
  t0 = time.perf_counter()
  first_B = jax.block_until_ready(decode.prefill(caches, ids_BT, lens_B))
  prefill_s = time.perf_counter() - t0 - compiled.compile_s
  decode_s = decode.run(first_B, progress=progress)
  tokens = decode.rows
  return GenerationResult(
      tokens=tokens, prefill_routes=model.plan_layers(compiled.prefill_plan),
      compile_s=compiled.compile_s, prefill_s=prefill_s, decode_s=decode_s,
      prefill_tokens=int(request.lens_B.sum()),
      decode_tokens=sum(map(len, tokens)) - request.batch,
      step_logits=decode.logits(model.vocab_size) if return_logits else None,
      decode_buckets=tuple(sorted(compiled.decoders)),
      **decode.draft_counts())


class _Decode:
  """One generation's decode after its prefill: the dispatches the host decode loop
  (``decoding.driver.Pipeline``) drives, one in flight, and the tokens read back.

  Each dispatch runs ``steps`` steps of the one device decode loop (``decoding.steps``) in
  the program of the cache bucket its sequences can reach by its end. The host knows, from
  the tokens read so far and the dispatches not read yet, how far each sequence can reach
  and whether any may still need a token; the device's ``Progress`` says which sequences
  ended (a stop id or their last token). A subclass holds its programs' state (``args``,
  ``take``)."""

  width = 1  # tokens a sequence may emit in one step

  def __init__(self, compiled: _Programs, request: Request, steps: int, seed_arr):
    self.compiled, self.request, self.steps, self.seed_arr = compiled, request, steps, seed_arr
    self.mesh = compiled.model.mesh
    self.rows: list[list[int]] = []
    self.done = np.zeros(request.batch, bool)
    self.unread = 0  # dispatches sent and not read yet
    self.step_logits: list[np.ndarray] = []

  def _start(self, first_B) -> None:
    """After the prefill sampled each sequence's first token (``first_B``, on the device)."""
    request = self.request
    self.rows = [[int(t)] for t in sharding.fetch(first_B)]
    self.done = np.array([stop_reason(r[0], request.eos_id or (), 1, request.max_new_tokens)
                          is not None for r in self.rows])
    self.progress = Progress(_place(~self.done, self.mesh),
                             _place(np.ones(request.batch, np.int32), self.mesh))
    self.step_arr = _place(np.int32(1), self.mesh, sharding.REPLICATED)
    self.end_arr = _place(np.int32(request.max_new_tokens), self.mesh, sharding.REPLICATED)

  def _unfinished(self):
    return [(int(n), len(r)) for n, r, d in zip(self.request.lens_B, self.rows, self.done)
            if not d]

  def _bucket(self) -> int:
    """The cache rows the next dispatch reads: the furthest an unfinished sequence can
    reach by its end (``width`` tokens a step, the unread dispatches' included)."""
    request = self.request
    reach = max(n + emitted - 1 for n, emitted in self._unfinished())
    reach += self.steps * self.width * (self.unread + 1)
    cap = request.longest + request.max_new_tokens - 1 + request.speculative_tokens
    return bucket_rows(min(reach, cap), request.capacity)

  def _may_need_tokens(self) -> bool:
    """Whether an unfinished sequence may still be short of its tokens once the unread
    dispatches are read (each step emits at least one token of every active sequence)."""
    least = min(emitted for _, emitted in self._unfinished())
    return least + self.steps * self.unread < self.request.max_new_tokens

  def dispatch(self, pipeline, updates):
    """The next dispatch (a driver's ``dispatch``), or None when none is needed."""
    if self.done.all() or not self._may_need_tokens():
      return None
    args = self.args()
    program = self.compiled.decoder(self._bucket(), *args)  # compiles a new bucket
    err, outputs = program(self.compiled.state_leaves, *args)
    throw(err)
    flight = self.take(outputs)
    for array in jax.tree.leaves(flight):
      array.copy_to_host_async()
    self.unread += 1
    return flight

  def settle(self, flight) -> list:
    """Reads a dispatch's emitted tokens [steps, B, K] and which sequences ended."""
    emitted_NBK, active_B, logits_NBV = flight
    self.unread -= 1
    emitted = sharding.fetch(emitted_NBK)
    for row, new in zip(self.rows, emitted.swapaxes(0, 1).reshape(len(self.rows), -1)):
      row.extend(int(t) for t in new if t >= 0)
    self.done = ~sharding.fetch(active_B)
    if logits_NBV is not None:
      self.step_logits.append(sharding.fetch(logits_NBV).swapaxes(0, 1))
    self.bar.update(max(map(len, self.rows)) - self.bar.n)
    return []

  def finished(self) -> bool:
    """With nothing in flight: every sequence ended. A sequence that has its tokens but
    did not end (``stops.ends`` in the programs) is an internal error, named rather than a
    loop without end."""
    if self.done.all():
      return True
    if not self._may_need_tokens():
      raise RuntimeError(f"generate: {int((~self.done).sum())} sequences not ended after "
                         f"{self.request.max_new_tokens} tokens")
    return False

  def run(self, first_B, *, progress: bool) -> float:
    """The decode dispatches after the prefill sampled ``first_B``: seconds spent in them,
    compilation excluded."""
    self._start(first_B)
    self.bar = progress_bar(self.request.max_new_tokens, "decode", unit="tok",
                            enabled=progress, initial=1)
    compile_before, t0 = self.compiled.compile_s, time.perf_counter()
    pipeline = Pipeline(self.dispatch, self.settle)
    for _ in pipeline.run(lambda: pipeline.in_flight is None and self.finished()):
      pass
    self.bar.close()
    return time.perf_counter() - t0 - (self.compiled.compile_s - compile_before)

  def logits(self, vocab_size: int) -> np.ndarray:
    """[B, max_new_tokens - 1, V]: the logits of every decode step."""
    if not self.step_logits:
      return np.zeros((self.request.batch, 0, vocab_size), np.float32)
    return np.concatenate(self.step_logits, axis=1)[:, :self.request.max_new_tokens - 1]

  def draft_counts(self) -> dict:
    return {}


class _PlainDecode(_Decode):
  """Decode steps of one sampled token each."""

  def prefill(self, caches, ids_BT, lens_B):
    prefill = self.compiled.prefill(caches, ids_BT, lens_B, self.seed_arr)
    err, (tokens_B, _, self.caches) = prefill(self.compiled.state_leaves, caches, ids_BT,
                                              lens_B, self.seed_arr)
    throw(err)
    self.tokens_B = tokens_B
    return tokens_B

  def args(self):
    return (self.caches, self.tokens_B, self.progress, self.seed_arr, self.step_arr,
            self.end_arr)

  def take(self, outputs):
    (self.tokens_B, self.progress, self.caches, self.step_arr, emitted_NBK,
     logits_NBV) = outputs
    return emitted_NBK, self.progress.active_B, logits_NBV


class _SpeculativeDecode(_Decode):
  """Speculative iterations (``generation.speculative``): k drafts verified per step."""

  def __init__(self, *args):
    super().__init__(*args)
    self.width = self.request.speculative_tokens + 1

  def prefill(self, caches, ids_BT, lens_B):
    request, seed_arr = self.request, self.seed_arr
    mtp_caches = self.compiled.model.init_mtp_cache(request.batch, request.capacity,
                                                    request.cache_dtype,
                                                    spare=request.speculative_tokens)
    prefill = self.compiled.prefill(caches, mtp_caches, ids_BT, lens_B, seed_arr)
    err, (tokens_B, self.caches, self.mtp_caches, draft_BV, hidden_BD) = prefill(
        self.compiled.state_leaves, caches, mtp_caches, ids_BT, lens_B, seed_arr)
    throw(err)
    count = lambda: _place(np.zeros(request.batch, np.int32), self.mesh)  # one buffer each
    self.state = DraftState(tokens_B=tokens_B, draft_BV=draft_BV, hidden_BD=hidden_BD,
                            accepted_B=count(), drafted_B=count())
    return tokens_B

  def args(self):
    return (self.caches, self.mtp_caches, self.state, self.progress, self.seed_arr,
            self.step_arr, self.end_arr)

  def take(self, outputs):
    self.caches, self.mtp_caches, self.state, self.progress, self.step_arr, emitted_NBK = outputs
    return emitted_NBK, self.progress.active_B, None

  def draft_counts(self) -> dict:
    return dict(drafted=int(sharding.fetch(self.state.drafted_B).sum()),
                accepted=int(sharding.fetch(self.state.accepted_B).sum()))
