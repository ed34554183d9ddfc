"""Jit-compiled generation: one prefill program and a decode program per cache bucket.

A decode program runs several steps per dispatch (a ``lax.scan``) and reads only the cache
rows the live context can reach, rounded up to a power-of-two bucket; it is compiled once per
(model structure, batch, capacity, sampling settings, bucket) and reused, so a generation
never retraces per token. The caches are donated to every program and updated in place.
Prefill takes the route its layers resolve for a fresh cache (dense MHA only where both the
layer class and the backend allow it); every decode step is MQA, because the cached length
is traced.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import numbers
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import PartitionSpec as P

from mla_jax import sharding
from mla_jax.cache import bucket_rows, resolve_cache_dtype
from mla_jax.checks import functionalize, throw
from mla_jax.progress import progress_bar
from mla_jax.routing import PrefillRoute

trace_counts: collections.Counter = collections.Counter()  # incremented while tracing only


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.0
  top_p: float = 1.0

  def __post_init__(self):
    for name in ("temperature", "top_p"):  # NaN would sample id 0 for every token
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
      object.__setattr__(self, name, float(value))
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


def sample(logits_BV, key, sampling: SamplingConfig):
  """Greedy at temperature 0; otherwise nucleus sampling over ``logits / temperature``."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / sampling.temperature
  if sampling.top_p < 1:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
    keep_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < sampling.top_p
    cutoff_B = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1)
    logits_BV = jnp.where(logits_BV >= cutoff_B[:, None], logits_BV, -jnp.inf)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "checked"),
                   donate_argnames=("caches",))
def _prefill(graphdef, state, caches, ids_BT, lens_B, seed, *, sampling, checked=False):
  """``(err, (tokens, logits, caches))``; ``err`` is None unless ``checked``."""
  trace_counts["prefill"] += 1

  def run(state, caches, ids_BT, lens_B, seed):
    key = jax.random.fold_in(jax.random.key(seed), 0)
    model = nnx.merge(graphdef, state)
    logits_BTV, caches = model(ids_BT, caches, new_lens_B=lens_B, num_cached_tokens=0)
    last_BV = jnp.take_along_axis(logits_BTV, (lens_B - 1)[:, None, None], axis=1)[:, 0]
    return sample(last_BV, key, sampling), logits_BTV, caches

  return functionalize(run, checked)(state, caches, ids_BT, lens_B, seed)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "eos_id", "steps",
                                             "kv_rows", "keep_logits", "checked"),
                   donate_argnames=("caches", "tokens_B", "done_B"))
def _decode(graphdef, state, caches, tokens_B, done_B, seed, first_step, end_step, *, sampling,
            eos_id, steps, kv_rows, keep_logits, checked=False):
  """``steps`` decode steps in one program (one dispatch), as a ``lax.scan``.

  Step i (``first_step <= i < first_step + steps``) samples with key ``fold_in(seed, i)`` and
  runs only for unfinished sequences while ``i < end_step``; the others keep their token and
  their cache. The caches (and the token/done buffers) are donated: updated in place.
  Returns ``(err, (tokens, done, caches, emitted, logits))``; ``err`` is None unless ``checked``.
  """
  trace_counts["decode"] += 1

  def run(state, caches, tokens_B, done_B, seed, first_step, end_step):
    model = nnx.merge(graphdef, state)

    def one_step(carry, i):
      tokens_B, done_B, caches = carry
      step = first_step + i
      active_B = ~done_B & (step < end_step)
      logits_B1V, caches = model(tokens_B[:, None], caches,
                                 new_lens_B=active_B.astype(jnp.int32), kv_rows=kv_rows)
      key = jax.random.fold_in(jax.random.key(seed), step)
      next_B = jnp.where(active_B, sample(logits_B1V[:, 0], key, sampling), tokens_B)
      if eos_id is not None:
        done_B = done_B | (active_B & jnp.isin(next_B, jnp.asarray(eos_id, jnp.int32)))
      emitted_B = jnp.where(active_B, next_B, -1)
      return (next_B, done_B, caches), (emitted_B, logits_B1V[:, 0] if keep_logits else None)

    (tokens_B, done_B, caches), (emitted_NB, logits_NBV) = jax.lax.scan(
        one_step, (tokens_B, done_B, caches), jnp.arange(steps, dtype=jnp.int32))
    return tokens_B, done_B, caches, emitted_NB, logits_NBV

  return functionalize(run, checked)(state, caches, tokens_B, done_B, seed, first_step,
                                     end_step)


_executables: dict = {}


def _compiled(fn, args, **static):
  """Ahead-of-time compiles ``fn`` once per model structure, shapes and sampling settings.

  Compiling explicitly (rather than on the first call) lets ``generate`` report compile time
  apart from prefill time; the cache makes a second generation with the same shapes free.
  """
  graphdef, *arrays = args
  signature = tuple((leaf.shape, str(leaf.dtype)) for leaf in jax.tree_util.tree_leaves(arrays))
  key = (fn, graphdef, jax.tree_util.tree_structure(arrays), signature,
         tuple(sorted(static.items())))
  if key not in _executables:
    _executables[key] = fn.lower(*args, **static).compile()
  return _executables[key]


@dataclasses.dataclass
class GenerationResult:
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

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prefill_tokens / max(self.prefill_s, 1e-9)

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / max(self.decode_s, 1e-9)


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _pad_prompts(prompt_ids, vocab_size: int):
  if isinstance(prompt_ids, (np.ndarray, jax.Array)):
    prompt_ids = np.asarray(prompt_ids)
    if not np.issubdtype(prompt_ids.dtype, np.integer) or prompt_ids.ndim not in (1, 2):
      raise TypeError(f"prompt_ids must be an int array [batch, tokens] or [tokens], got "
                      f"{prompt_ids.dtype} of shape {list(prompt_ids.shape)}")
    prompt_ids = [prompt_ids.tolist()] if prompt_ids.ndim == 1 else prompt_ids.tolist()
  if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Iterable):
    raise TypeError(f"prompt_ids must be a list of id lists or an int array, got "
                    f"{type(prompt_ids).__name__}")
  prompts = list(prompt_ids)
  if not prompts:
    raise ValueError("prompt_ids holds no prompt")
  for i, p in enumerate(prompts):
    if isinstance(p, (str, bytes)) or not isinstance(p, Iterable):
      raise TypeError(f"prompt {i} must be a list of int ids, got {type(p).__name__}")
    prompts[i] = p = list(p)
    if not p:
      raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    wrong_type = [t for t in p if not _is_int(t)]
    if wrong_type:
      raise TypeError(f"prompt {i} holds {type(wrong_type[0]).__name__} values "
                      f"({wrong_type[:3]}); token ids must be ints")
    bad = [t for t in p if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has ids outside [0, {vocab_size}): {bad[:5]}")
  lens = np.array([len(p) for p in prompts], np.int32)
  ids = np.zeros((len(prompts), lens.max()), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  return ids, lens


def _place(array, mesh, spec=P(sharding.DATA)):
  """A host array on the model's mesh (batch over ``data``), or on the default device."""
  return jnp.asarray(array) if mesh is None else sharding.put(array, mesh, spec)


DEFAULT_STEPS_PER_DISPATCH = 8  # benchmarks/decode.py: beyond ~8 the per-token gain is small


def _eos_ids(eos_id, vocab_size: int) -> tuple[int, ...] | None:
  """``eos_id`` as a tuple of ids (a tokenizer may have several end-of-sequence tokens)."""
  if eos_id is None:
    return None
  ids = tuple(eos_id) if isinstance(eos_id, (list, tuple)) else (eos_id,)
  if not ids or not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
    raise ValueError(f"eos_id must be an id in [0, {vocab_size}) or a non-empty list of them, "
                     f"got {eos_id!r}")
  return tuple(int(i) for i in ids)


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | list[int] | None = None,
             cache_capacity: int | None = None, cache_dtype=jnp.float32,
             steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH, progress: bool = False,
             return_logits: bool = False, checks: bool = False) -> GenerationResult:
  """Generates up to ``max_new_tokens`` after each prompt (a batch of ragged prompts).

  Args:
    model: a ``CausalLM``.
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

  Each decode dispatch reads only the cache rows the live context can reach by its end,
  rounded up to a bucket (``mla_jax.cache.bucket_rows``), so the work per token follows the
  live context, not ``cache_capacity``; one program is compiled per bucket used.
  """
  if not _is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
  if not _is_int(seed) or not 0 <= seed < 2**32:
    raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
  if not _is_int(steps_per_dispatch) or steps_per_dispatch < 1:
    raise ValueError(f"steps_per_dispatch must be a positive int, got {steps_per_dispatch!r}")
  sampling = SamplingConfig(temperature, top_p)
  cfg = model.config
  eos_id = _eos_ids(eos_id, cfg.vocab_size)
  if cache_capacity is not None and (not _is_int(cache_capacity) or cache_capacity < 1):
    raise ValueError(f"cache_capacity must be None or a positive int, got {cache_capacity!r}")
  cache_dtype = resolve_cache_dtype(cache_dtype, "cache_dtype")
  if not isinstance(checks, bool):
    raise TypeError(f"checks must be a bool, got {type(checks).__name__}")
  ids_BT, lens_B = _pad_prompts(prompt_ids, cfg.vocab_size)
  batch, longest = ids_BT.shape
  needed = longest + max_new_tokens
  max_positions = cfg.mla.max_position_embeddings
  if cache_capacity is None and needed > max_positions:
    raise ValueError(f"prompt of {longest} tokens plus {max_new_tokens} new tokens needs "
                     f"{needed} positions, more than max_position_embeddings {max_positions}")
  capacity = needed if cache_capacity is None else cache_capacity
  if needed > capacity:
    raise ValueError(f"prompt of {longest} tokens plus {max_new_tokens} new tokens needs "
                     f"{needed} cache rows, more than cache_capacity {capacity}")
  if capacity > max_positions:
    raise ValueError(f"cache_capacity {capacity} exceeds max_position_embeddings "
                     f"{max_positions}")

  graphdef, state = nnx.split(model)
  caches = model.init_cache(batch, capacity, cache_dtype)
  mesh = model.mesh
  ids_BT, lens_B = _place(ids_BT, mesh), _place(lens_B, mesh)
  seed = _place(np.uint32(seed), mesh, P())
  scalar = lambda i: _place(np.int32(i), mesh, P())
  steps = min(steps_per_dispatch, max(max_new_tokens - 1, 1))
  decode_static = dict(sampling=sampling, eos_id=eos_id, steps=steps, keep_logits=return_logits,
                       checked=checks)

  def decoder(kv_rows):
    """The compiled decode program for ``kv_rows`` cache rows, and its compile seconds."""
    t0 = time.perf_counter()
    fn = _compiled(_decode, (graphdef, state, caches, lens_B, lens_B > 0, seed, scalar(1),
                             scalar(1)), kv_rows=kv_rows, **decode_static)
    return fn, time.perf_counter() - t0

  args = (graphdef, state, caches, ids_BT, lens_B, seed)
  t0 = time.perf_counter()
  prefill = _compiled(_prefill, args, sampling=sampling, checked=checks)
  rows_by = lambda step: bucket_rows(longest + min(step + steps, max_new_tokens) - 1, capacity)
  programs = {}
  if max_new_tokens > 1:
    programs[rows_by(1)], _ = decoder(rows_by(1))
  compile_s = time.perf_counter() - t0

  t0 = time.perf_counter()
  err, (tokens_B, _, caches) = prefill(*args[1:])
  throw(err)
  tokens_B.block_until_ready()
  prefill_s = time.perf_counter() - t0

  out, logits = [sharding.fetch(tokens_B)[:, None]], []
  done = np.isin(out[0][:, 0], eos_id) if eos_id is not None else np.zeros((batch,), bool)
  done_B = _place(done, mesh)
  bar = progress_bar(max_new_tokens, "decode", unit="tok", enabled=progress, initial=1)
  decode_s, step = 0.0, 1
  while step < max_new_tokens and not done.all():
    kv_rows = rows_by(step)
    if kv_rows not in programs:  # a new bucket: compile outside the decode timing
      programs[kv_rows], seconds = decoder(kv_rows)
      compile_s += seconds
    t0 = time.perf_counter()
    err, (tokens_B, done_B, caches, emitted_NB, logits_NBV) = programs[kv_rows](
        state, caches, tokens_B, done_B, seed, scalar(step), scalar(max_new_tokens))
    throw(err)
    emitted = sharding.fetch(emitted_NB).T  # syncs: the dispatch has finished
    decode_s += time.perf_counter() - t0
    out.append(emitted)
    if return_logits:
      logits.append(sharding.fetch(logits_NBV).swapaxes(0, 1))
    done = sharding.fetch(done_B) if eos_id is not None else done
    step += steps
    bar.update(min(step, max_new_tokens) - bar.n)
  bar.close()

  rows = np.concatenate(out, axis=1)[:, :max_new_tokens]
  tokens = [[int(t) for t in row if t >= 0] for row in rows]
  step_logits = None
  if return_logits:
    step_logits = np.concatenate(logits, axis=1)[:, :max_new_tokens - 1] if logits else \
        np.zeros((batch, 0, cfg.vocab_size), np.float32)
  return GenerationResult(
      tokens=tokens, prefill_routes=model.prefill_routes(longest, 0), compile_s=compile_s,
      prefill_s=prefill_s, decode_s=decode_s, prefill_tokens=int(sharding.fetch(lens_B).sum()),
      decode_tokens=sum(len(t) for t in tokens) - batch, step_logits=step_logits,
      decode_buckets=tuple(sorted(programs)))
