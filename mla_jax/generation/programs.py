"""The compiled programs of ``generate`` (a prefill, and a decode per cache bucket; with
speculative decoding a prefill that also runs the MTP layer, and a speculative decode per
bucket) and the bounded cache that keeps them.

A program is a jitted closure over one model structure and one settings value, compiled ahead
of time for its arguments' shapes, so that ``generate`` reports compile time apart from run
time. Two things keep a call on jax's C++ dispatch path (tens of microseconds of host time;
``benchmarks/decode.py --dispatch`` measures it): the model state goes in as a flat list of
arrays (an ``nnx.State`` is flattened by Python callbacks on every call), and an unchecked
program carries no effects (``checks.functionalize`` leaves its checks out of the trace).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.checks import functionalize, static_int
from mla_jax.decoding import programs
from mla_jax.decoding.programs import signature
from mla_jax.decoding.sampling import SamplingConfig, sample
from mla_jax.decoding.speculative import MAX_SPECULATIVE_TOKENS
from mla_jax.decoding.steps import decode_steps
from mla_jax.decoding.stops import stop_ids_of
from mla_jax.generation import speculative

trace_counts: collections.Counter = collections.Counter()  # incremented while tracing only


def _check_plan(plan) -> None:
  """A model's step plan (the decode protocol's ``step_plan``: a frozen dataclass, hashable,
  with its tokens per sequence and the cache rows it reads)."""
  if not (dataclasses.is_dataclass(plan) and not isinstance(plan, type)
          and hasattr(plan, "num_new_tokens") and hasattr(plan, "kv_rows")):
    raise TypeError(f"plan must be a step plan (model.step_plan), got {type(plan).__name__}")


@dataclasses.dataclass(frozen=True)
class PrefillSettings:
  """A prefill program's static settings: one hashable value (the cache key's part).

  ``plan``: the model's ``StepPlan`` for the prompt (every layer reads it)."""

  plan: object  # the model's step plan
  sampling: SamplingConfig = SamplingConfig()
  checked: bool = False  # run-time checks raise (``checks.CheckError``) instead of compiling out

  def __post_init__(self):
    _check_plan(self.plan)


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """A decode program's static settings: one hashable value (the cache key's part).

  ``plan``: the model's ``StepPlan`` for one token per sequence after an unknown cached
  length, reading the rows of the live context's bucket (``plan.kv_rows``)."""

  plan: object  # the model's step plan
  sampling: SamplingConfig = SamplingConfig()
  eos_id: tuple[int, ...] | None = None
  steps: int = 1  # decode steps per dispatch (a ``lax.scan``)
  keep_logits: bool = False
  checked: bool = False

  def __post_init__(self):
    _check_plan(self.plan)
    object.__setattr__(self, "steps", static_int(self.steps, "steps", minimum=1))


@dataclasses.dataclass(frozen=True)
class SpeculativePrefillSettings(PrefillSettings):
  """A speculative generation's prefill: the main prefill, then MTP layer 0 over the
  prompt's pairs (``speculative.prefill``), under the same ``plan``."""


@dataclasses.dataclass(frozen=True)
class SpeculativeSettings:
  """A speculative decode program's static settings: one hashable value (the cache key's
  part). Each of its ``steps`` iterations drafts k = ``verify_plan.num_new_tokens - 1``
  tokens and verifies them (``speculative.iteration``).

  ``verify_plan``: the model's ``StepPlan`` for k + 1 tokens per sequence after an unknown
  cached length (the verify forward and the MTP step over the verified pairs);
  ``draft_plan``: one token per sequence (the further draft steps). Both read the rows of
  the live context's bucket (``plan.kv_rows``)."""

  verify_plan: object  # the model's step plans
  draft_plan: object
  sampling: SamplingConfig = SamplingConfig()
  eos_id: tuple[int, ...] | None = None
  steps: int = 1  # iterations per dispatch (a ``lax.scan``)
  checked: bool = False

  def __post_init__(self):
    _check_plan(self.verify_plan)
    _check_plan(self.draft_plan)
    object.__setattr__(self, "steps", static_int(self.steps, "steps", minimum=1))
    limit = MAX_SPECULATIVE_TOKENS
    if not 2 <= self.verify_plan.num_new_tokens <= limit + 1:
      raise ValueError(f"verify_plan must be a step of k + 1 tokens with k in [1, {limit}], "
                       f"got {self.verify_plan.num_new_tokens}")
    if self.draft_plan.num_new_tokens != 1 or (self.draft_plan.kv_rows
                                               != self.verify_plan.kv_rows):
      raise ValueError("draft_plan must be a one-token step reading verify_plan's kv_rows")


def _model(graphdef, state_def, state_leaves):
  return nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))


def _prefill(graphdef, state_def, settings: PrefillSettings):
  """``run(state_leaves, caches, ids_BT, lens_B, seed) -> (err, (tokens, logits, caches))``;
  ``err`` is None unless checked. The caches are donated: updated in place."""

  def body(state_leaves, caches, ids_BT, lens_B, seed):
    model = _model(graphdef, state_def, state_leaves)
    logits_BTV, caches = model(ids_BT, caches, new_lens_B=lens_B, plan=settings.plan)
    last_BV = jnp.take_along_axis(logits_BTV, (lens_B - 1)[:, None, None], axis=1)[:, 0]
    return sample(last_BV, seed, 0, settings.sampling), logits_BTV, caches

  def run(*args):
    trace_counts["prefill"] += 1
    return functionalize(body, settings.checked)(*args)

  return jax.jit(run, donate_argnums=1)


def _decode(graphdef, state_def, settings: DecodeSettings):
  """``run(state_leaves, caches, tokens_B, progress, seed, step, end_step)``: ``settings.steps``
  decode steps in one program (one dispatch), through the one device decode loop
  (``decoding.steps``).

  Step i (``step <= i < step + steps``) samples token index i (``sampling.sample``) and runs only
  for the sequences ``progress`` holds active; the others keep their token and their cache. A
  sequence ends at an end-of-sequence id or its ``end_step``-th token. The caches (and the
  token buffer) are donated: updated in place; the progress is not, so the host reads it
  while the next dispatch runs. Returns ``(err, (tokens,
  progress, caches, next_step, emitted, logits))``; ``next_step`` is the next dispatch's
  ``step``, so the counter stays on the device; ``err`` is None unless checked.
  """
  def body(state_leaves, caches, tokens_B, progress, seed, first_step, end_step):
    model = _model(graphdef, state_def, state_leaves)

    def one_step(carry, progress, i):
      tokens_B, caches = carry
      active_B = progress.active_B
      logits_B1V, caches = model(tokens_B[:, None], caches,
                                 new_lens_B=active_B.astype(jnp.int32), plan=settings.plan)
      next_B = jnp.where(active_B, sample(logits_B1V[:, 0], seed, first_step + i,
                                          settings.sampling), tokens_B)
      return ((next_B, caches), next_B[:, None], jnp.ones_like(next_B),
              logits_B1V[:, 0] if settings.keep_logits else None)

    (tokens_B, caches), progress, emitted_NBK, logits_NBV = decode_steps(
        one_step, (tokens_B, caches), progress, settings.steps,
        stop_ids=stop_ids_of(settings.eos_id), max_tokens=end_step)
    return tokens_B, progress, caches, first_step + settings.steps, emitted_NBK, logits_NBV

  def run(*args):
    trace_counts["decode"] += 1
    return functionalize(body, settings.checked)(*args)

  return jax.jit(run, donate_argnums=(1, 2))


def _speculative_prefill(graphdef, state_def, settings: SpeculativePrefillSettings):
  """``run(state_leaves, caches, mtp_caches, ids_BT, lens_B, seed) -> (err, (tokens_B,
  caches, mtp_caches, draft_BV, hidden_BD))``: ``speculative.prefill``, sampling as the
  plain prefill does. Both caches are donated."""

  def body(state_leaves, caches, mtp_caches, ids_BT, lens_B, seed):
    return speculative.prefill(_model(graphdef, state_def, state_leaves), caches, mtp_caches,
                               ids_BT, lens_B, seed, plan=settings.plan,
                               sampling=settings.sampling)

  def run(*args):
    trace_counts["speculative_prefill"] += 1
    return functionalize(body, settings.checked)(*args)

  return jax.jit(run, donate_argnums=(1, 2))


def _speculative_decode(graphdef, state_def, settings: SpeculativeSettings):
  """``run(state_leaves, caches, mtp_caches, state, progress, seed, iteration, max_new)``:
  ``settings.steps`` speculative iterations in one program, through the one device decode
  loop (``decoding.steps``).

  Iteration i (``iteration <= i < iteration + steps``) draws with key ``fold_in(seed, i)``;
  a sequence ends at its end-of-sequence id or its ``max_new``-th token, and then writes
  nothing. The caches and the ``DraftState`` are donated; the progress is not (the host
  reads it while the next dispatch runs). Returns ``(err,
  (caches, mtp_caches, state, progress, next_iteration, emitted))`` with the emitted tokens
  [steps, B, k + 1] (-1 where none); ``err`` is None unless checked."""

  def body(state_leaves, caches, mtp_caches, state, progress, seed, first_iteration, max_new):
    model = _model(graphdef, state_def, state_leaves)

    def one_iteration(carry, progress, i):
      key = jax.random.fold_in(jax.random.key(seed), first_iteration + i)
      *carry, tokens_BK, valid_B = speculative.iteration(
          model, *carry, progress, key, max_new, verify_plan=settings.verify_plan,
          draft_plan=settings.draft_plan, sampling=settings.sampling)
      return tuple(carry), tokens_BK, valid_B, None

    (caches, mtp_caches, state), progress, emitted_NBK, _ = decode_steps(
        one_iteration, (caches, mtp_caches, state), progress, settings.steps,
        stop_ids=stop_ids_of(settings.eos_id), max_tokens=max_new)
    return caches, mtp_caches, state, progress, first_iteration + settings.steps, emitted_NBK

  def run(*args):
    trace_counts["speculative_decode"] += 1
    return functionalize(body, settings.checked)(*args)

  return jax.jit(run, donate_argnums=(1, 2, 3))


_PROGRAMS = {PrefillSettings: _prefill, DecodeSettings: _decode,
             SpeculativePrefillSettings: _speculative_prefill,
             SpeculativeSettings: _speculative_decode}


def jitted(graphdef, state_def, settings):
  """A new jitted program for one model structure (``graphdef``, the state's treedef) and
  ``settings`` (one of ``_PROGRAMS``' settings classes); it takes the state's leaves."""
  if type(settings) not in _PROGRAMS:
    raise TypeError(f"settings must be one of {', '.join(c.__name__ for c in _PROGRAMS)}, "
                    f"got {type(settings).__name__}")
  return _PROGRAMS[type(settings)](graphdef, state_def, settings)


def trace(graphdef, state, *args, settings) -> jax.stages.Traced:
  """The program ``generate`` runs for ``settings``, traced on ``state`` and ``args`` (arrays
  or ``jax.ShapeDtypeStruct``s, as ``run`` above takes them after the state): nothing
  compiles or runs. ``.lower()`` it, e.g. for another platform, or read its ``.jaxpr``."""
  state_leaves, state_def = jax.tree.flatten(state)
  return jitted(graphdef, state_def, settings).trace(state_leaves, *args)


class ProgramCache(programs.ProgramCache):
  """``generate``'s programs (``decoding.programs.ProgramCache``), keyed by the settings, the
  model structure and the arguments' signature: a hit costs one hash of the key, once per
  ``generate`` and bucket, never per dispatch."""

  def get(self, graphdef, state_def, state_leaves, *args, settings
          ) -> tuple[jax.stages.Compiled, float]:
    """The compiled program for these arguments and the seconds spent compiling it (0 when
    it was cached). Call it as ``program(state_leaves, *args)``."""
    key = (settings, graphdef, state_def, signature((state_leaves, args)))
    return self.lookup(key, lambda: jitted(graphdef, state_def, settings).lower(
        state_leaves, *args).compile())


cache = ProgramCache()  # generate's programs, shared by every call in the process
