"""Decode step time against the live context, one optimization at a time; mla_jax vs HF eager.

    python benchmarks/decode.py                            # the context sweep (~4 minutes)
    python benchmarks/decode.py --hf-python /path/to/venv/bin/python   # + HF eager, batch 1/8/32
    python benchmarks/decode.py --no-sweep --dispatch       # host time per dispatch (~1 minute)
    python benchmarks/decode.py --no-sweep --speculative CKPT   # MTP speculative decoding

Sweep: the ``small`` preset with ``max_position_embeddings`` raised to the largest context,
one cache of that capacity per variant, its rows filled with random values and every
sequence's length set so that a dispatch ends at the live context L. Each column adds one
change to the one before:

* before: the decode program as it was before caches were donated: caches not donated (every
  step copies every layer's whole cache), attention and indexer over the whole capacity, one
  step per dispatch. Emulated with the current program jitted without donation and
  ``kv_rows`` = capacity (there is no flag for it in ``generate``).
* donated: the caches donated (updated in place); still the whole capacity, one step.
* + buckets: only the rows of the live context, rounded up to a power of two (>= 256).
* + N per dispatch: N steps in one compiled loop (one host round trip per N tokens).
* + fp8 cache: the latent rows and indexer keys in fp8 (e4m3 + float32 scales).

Times are per decode step (one token for every sequence of the batch), the best of
``--repeats`` dispatches after a warm-up (the variants' dispatches interleaved); the lengths
are reset before each dispatch, so L stays fixed. This machine is shared and noisy: the best
dispatch is the least disturbed one, and ratios within a table mean more than absolute times.

Dispatch (``--dispatch``): the host time of one decode dispatch, as the median wall time of a
program that takes and returns what a decode dispatch does and computes nothing, called the
way ``generate`` calls its programs now and the way it did before (an ``nnx.State`` argument,
whose flattening runs Python per call, and a ``checkify.debug_check`` effect, which sends
every call through jax's Python dispatch path); then ``generate``'s decode tokens/s at 1 and 8
steps per dispatch on the ``tiny`` preset, batch 1.

HF (``--hf-python``, an interpreter with torch and transformers): ``hf_eager_decode.py``
builds and saves a random tiny DeepSeek-V3.2 checkpoint (the tiny preset's dimensions) and
times HF eager greedy decoding; mla_jax loads the same files and decodes the same prompts.

Speculative (``--speculative CKPT``, a checkpoint with MTP layers, e.g. the recall model with
its head): greedy decode tokens/s and the acceptance rate for each ``--speculative-tokens``
k (0 is plain decoding, the baseline of the speed-up column), at each
``--speculative-batches`` batch, on one prompt (``--speculative-prompt`` through the
checkpoint's tokenizer, else ``--prompt-len`` random ids) copied over the batch. With
``--engine``, the same through the ``Engine`` (per-request ``speculative_tokens``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import checkify  # noqa: E402

from benchmarks import timing  # noqa: E402
from mla_jax import generation  # noqa: E402
from mla_jax.cache import bucket_rows  # noqa: E402
from mla_jax.decoding.steps import Progress  # noqa: E402
from mla_jax.generation import programs  # noqa: E402
from mla_jax.models.config import small_lm, tiny_lm  # noqa: E402
from mla_jax.models.lm import CausalLM, ModelCache  # noqa: E402
from mla_jax.serving.engine import Engine  # noqa: E402
from mla_jax.serving.scheduler import pages_for  # noqa: E402
from mla_jax.serving.sequence import SamplingParams  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  donate: bool
  buckets: bool
  steps: int
  cache_dtype: str


def variants(steps: int) -> list[Variant]:
  return [Variant("before", False, False, 1, "fp32"),
          Variant("donated", True, False, 1, "fp32"),
          Variant("+ buckets", True, True, 1, "fp32"),
          Variant(f"+ {steps} per dispatch", True, True, steps, "fp32"),
          Variant("+ fp8 cache", True, True, steps, "fp8")]


def sweep_model(max_context: int) -> CausalLM:
  config = small_lm()
  config = dataclasses.replace(config, mla=dataclasses.replace(
      config.mla, max_position_embeddings=max(max_context, config.mla.max_position_embeddings)))
  return CausalLM(config, rngs=nnx.Rngs(0), backend="xla")


def random_caches(model, batch: int, capacity: int, cache_dtype: str) -> ModelCache:
  """A cache whose every row holds random values (positive scales), as after a long prefill."""
  caches = model.init_cache(batch, capacity, cache_dtype)
  leaves, tree = jax.tree_util.tree_flatten_with_path(caches)
  keys = jax.random.split(jax.random.key(1), len(leaves))

  def fill(path, leaf, key):
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      return leaf  # lengths, set per measurement
    x = jax.random.normal(key, leaf.shape, jnp.float32)
    if "scales" in jax.tree_util.keystr(path):
      x = 2.0 ** jnp.round(jnp.clip(x, -2, 2) - 6)  # powers of two, as the writes make them
    return x.astype(leaf.dtype)

  return tree.unflatten([fill(p, leaf, k) for (p, leaf), k in zip(leaves, keys)])


class Runner:
  """One variant's model state, cache and compiled programs (one per bucket)."""

  def __init__(self, model, variant: Variant, capacity: int, batch: int):
    self.model, self.variant, self.capacity, self.batch = model, variant, capacity, batch
    self.graphdef, state = nnx.split(model)
    self.state_leaves, self.state_def = jax.tree.flatten(state)
    self.caches = random_caches(model, batch, capacity, variant.cache_dtype)
    self.seed = jnp.asarray(0, jnp.uint32)
    self.first, self.end = jnp.asarray(1, jnp.int32), jnp.asarray(2**30, jnp.int32)
    self.programs = {}

  def rows(self, context: int) -> int:
    return bucket_rows(context, self.capacity) if self.variant.buckets else self.capacity

  def _inputs(self, context: int):
    """The caches with a dispatch's steps ending at ``context`` rows, fresh tokens and
    progress."""
    return (self.caches.with_num_cached(jnp.int32(context - self.variant.steps)),
            jnp.zeros((self.batch,), jnp.int32),
            Progress.start(jnp.ones((self.batch,), bool), 1))

  def compile(self, context: int) -> None:
    rows = self.rows(context)
    if rows not in self.programs:
      plan = self.model.step_plan(1, None, capacity=self.capacity, kv_rows=rows)
      settings = programs.DecodeSettings(plan, steps=self.variant.steps)
      fn = programs.jitted(self.graphdef, self.state_def, settings)
      if not self.variant.donate:  # "before": the same computation, every cache copied
        fn = jax.jit(fn.__wrapped__)
      self.programs[rows] = fn.lower(self.state_leaves, *self._inputs(context), self.seed,
                                     self.first, self.end).compile()

  def dispatch(self, context: int):
    """``(setup, run)``: one dispatch ending at ``context``; ``setup`` makes its inputs."""
    program = self.programs[self.rows(context)]

    def run(caches, tokens, progress):
      result = program(self.state_leaves, caches, tokens, progress, self.seed, self.first,
                       self.end)
      self.caches = result[1][2]  # the donated buffers live on in the result
      return result

    return (lambda: self._inputs(context)), run


def measure(model, columns, contexts, batch: int, repeats: int):
  """Seconds per step for every (variant, context): the best of ``repeats`` dispatches, the
  variants' dispatches interleaved so that the machine's load changes hit every column alike."""
  runners = [Runner(model, v, max(contexts), batch) for v in columns]
  out = {v.name: {} for v in columns}
  for context in contexts:
    for r in runners:
      r.compile(context)
    dispatches = {r.variant.name: r.dispatch(context) for r in runners}
    best = timing.side_by_side({name: run for name, (_, run) in dispatches.items()}, repeats,
                               stat="best", setup={name: setup for name, (setup, _)
                                                   in dispatches.items()})
    for r in runners:
      out[r.variant.name][context] = best[r.variant.name] / r.variant.steps
    print(f"[context {context} measured]", file=sys.stderr, flush=True)
  return out, {r.variant.name: len(r.programs) for r in runners}


def sweep(args) -> None:
  contexts = sorted(args.contexts)
  model = sweep_model(max(contexts))
  cfg = model.config
  per_layer = {d: model.init_cache(1, 1, d).layer(0).bytes_per_token for d in ("fp32", "fp8")}
  print(f"## Decode step time (ms) against the live context\n\n`small` preset "
        f"({cfg.num_layers} layers, A={cfg.mla.kv_lora_rank}, R={cfg.mla.qk_rope_head_dim}, "
        f"index top-k {cfg.mla.indexer.topk}), batch {args.batch}, cache capacity "
        f"{max(contexts)}, XLA backend on {jax.devices()[0].platform}; cache bytes per token "
        f"per layer: fp32 {per_layer['fp32']}, fp8 {per_layer['fp8']}. Best of "
        f"{args.repeats} interleaved dispatches.\n", flush=True)
  columns = variants(args.steps_per_dispatch)
  results, programs = measure(model, columns, contexts, args.batch, args.repeats)
  first, last = columns[0].name, columns[-1].name
  print("| live context | " + " | ".join(v.name for v in columns) + f" | {first} / {last} |")
  print("|---" * (len(columns) + 2) + "|")
  for context in contexts:
    cells = " | ".join(f"{results[v.name][context] * 1e3:.2f}" for v in columns)
    print(f"| {context} | {cells} | {results[first][context] / results[last][context]:.1f}x |")
  print("\nCompiled decode programs per column: "
        + ", ".join(f"{name} {n}" for name, n in programs.items()) + "\n", flush=True)
  if args.dispatch_context:
    dispatch_table(model, args)


def dispatch_table(model, args) -> None:
  """Step time against the steps per dispatch, at one context (picks the default N)."""
  context = args.dispatch_context
  print(f"## Steps per dispatch at live context {context} (ms per step, batch {args.batch})\n")
  counts = (1, 2, 4, 8, 16)
  columns = [Variant(str(n), True, True, n, "fp32") for n in counts]
  results, _ = measure(model, columns, [context], args.batch, args.repeats)
  print("| steps per dispatch | " + " | ".join(map(str, counts)) + " |")
  print("|---" * (len(counts) + 1) + "|")
  print("| ms per step | " + " | ".join(f"{results[str(n)][context] * 1e3:.2f}"
                                        for n in counts) + " |\n", flush=True)


def _empty_program(model, capacity: int, before: bool):
  """A program taking and returning what a decode dispatch does, computing (next to) nothing:
  its wall time per call is the host time of a dispatch. ``before``: as ``generate`` called its programs
  until 2026-12 (the state as an ``nnx.State`` pytree, a ``debug_check`` effect in the
  program); otherwise as it calls them now (the state's leaves, no effects)."""
  _, state = nnx.split(model)
  state_in = state if before else jax.tree.leaves(state)

  def body(state, caches, tokens_B, done_B, seed, step, end_step):
    if before:
      checkify.debug_check(step < end_step, "step {} past the end", step)
    # One element of every array, so that jit prunes no argument (as the real program uses all).
    touched = sum(x.ravel()[0].astype(jnp.int32) for x in jax.tree.leaves((state, caches, seed)))
    return None, (tokens_B, done_B, caches, step + 1, (tokens_B + 0 * touched)[None], None)

  args = [model.init_cache(1, capacity), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool),
          jnp.uint32(0), jnp.int32(1), jnp.int32(2**30)]
  program = jax.jit(body, donate_argnums=(1, 2, 3)).lower(state_in, *args).compile()

  def run():
    err, (args[1], args[2], args[0], args[4], emitted, _) = program(state_in, *args)
    return emitted

  return run


def dispatch_overhead(args) -> None:
  """Host time per dispatch and decode tokens/s against the steps per dispatch (tiny preset)."""
  model = CausalLM(tiny_lm(), rngs=nnx.Rngs(0), backend="xla")
  prompt = [list(range(1, args.prompt_len + 1))]
  capacity = args.prompt_len + args.new_tokens
  paths = {"before (nnx.State argument, checks' effects)": _empty_program(model, capacity, True),
           "now (state leaves, no effects)": _empty_program(model, capacity, False)}
  host = timing.side_by_side(paths, 200, warmup=5)
  print(f"## Host time per dispatch and steps per dispatch\n\n`tiny` preset, batch 1, XLA on "
        f"{jax.devices()[0].platform}. Host time: the median wall time of a call of a program "
        "that takes and returns what a decode dispatch does and computes nothing (200 calls).\n")
  print("| dispatch path | host ms per dispatch |\n|---|---|")
  for name, seconds in host.items():
    print(f"| {name} | {seconds * 1e3:.3f} |")
  counts = (1, 8)
  decode = {n: functools.partial(generation.generate, model, prompt, args.new_tokens,
                                 steps_per_dispatch=n) for n in counts}
  runs = {n: [] for n in counts}
  for _ in range(args.repeats + 1):  # the first round compiles
    for n in counts:
      runs[n].append(decode[n]().decode_tokens_per_s)
  best = {n: max(r[1:]) for n, r in runs.items()}
  print(f"\nDecode tokens/s of `generate` ({args.prompt_len}-token prompt, {args.new_tokens} "
        f"new tokens), the best of {args.repeats} interleaved runs:\n")
  print("| steps per dispatch | " + " | ".join(map(str, counts)) + " | 8 / 1 |")
  print("|---" * (len(counts) + 2) + "|")
  print("| tokens/s | " + " | ".join(f"{best[n]:.0f}" for n in counts)
        + f" | {best[8] / best[1]:.2f}x |")
  print("| ms per dispatch | " + " | ".join(f"{n / best[n] * 1e3:.3f}" for n in counts)
        + " | |\n", flush=True)


def mla_jax_tokens_per_s(model, ids, new_tokens: int, repeats: int, **kwargs):
  """The best decode tokens/s of ``repeats`` generations after a warm-up, and the first."""
  generation.generate(model, ids, new_tokens, **kwargs)  # compiles
  runs = [generation.generate(model, ids, new_tokens, **kwargs) for _ in range(repeats)]
  return max(r.decode_tokens_per_s for r in runs), runs[0]


def hf_comparison(args) -> None:
  sys.path.insert(0, HERE)
  from hf_eager_decode import prompts

  from mla_jax.checkpoints import load_pretrained

  with tempfile.TemporaryDirectory() as ckpt:
    command = [args.hf_python, os.path.join(HERE, "hf_eager_decode.py"), ckpt,
               "--batches", *map(str, args.hf_batches), "--new-tokens", str(args.new_tokens),
               "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats_hf)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
      raise SystemExit(f"--hf-python {args.hf_python} failed:\n{done.stderr[-3000:]}")
    hf = json.loads(done.stdout.strip().splitlines()[-1])
    model = load_pretrained(ckpt, dtype=jnp.float32, backend="xla")
  ids = prompts(0, max(args.hf_batches), args.prompt_len)
  print(f"## Greedy decode tokens/s: mla_jax vs HF transformers eager\n\nThe same random tiny "
        f"DeepSeek-V3.2 checkpoint (tiny preset dimensions, float32), prompts of "
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens; decode only (prefill and "
        f"compile excluded), the best of {args.repeats_hf} runs after a warm-up on each side (the "
        f"machine is shared: the best run is the least disturbed one). HF: torch "
        f"{hf['torch']}, transformers {hf['transformers']}, {hf['threads']} threads, eager "
        f"attention with its KV cache. mla_jax: XLA backend, "
        f"{generation.DEFAULT_STEPS_PER_DISPATCH} steps per dispatch.\n")
  print("| batch | HF eager | mla_jax fp32 cache | ratio | mla_jax fp8 cache | ratio |")
  print("|---|---|---|---|---|---|")
  agreement = None
  for batch in args.hf_batches:
    hf_tps = hf["tokens_per_s"][str(batch)]
    fp32, run = mla_jax_tokens_per_s(model, ids[:batch], args.new_tokens, args.repeats_hf,
                                     cache_dtype="fp32")
    fp8, _ = mla_jax_tokens_per_s(model, ids[:batch], args.new_tokens, args.repeats_hf,
                                  cache_dtype="fp8")
    if batch == 1:
      same = np.asarray(run.tokens[0]) == np.asarray(hf["tokens"])
      agreement = len(same) if same.all() else int(same.argmin())
    print(f"| {batch} | {hf_tps:.0f} | {fp32:.0f} | {fp32 / hf_tps:.1f}x | {fp8:.0f} | "
          f"{fp8 / hf_tps:.1f}x |", flush=True)
  if agreement is not None:
    print(f"\nBatch 1, fp32 cache: the first {agreement} of {args.new_tokens} greedy tokens equal "
          "HF's (after a first difference the sequences part; logit parity is "
          "tests/test_hf_parity.py's job).\n")


def speculative_table(args) -> None:
  from mla_jax.checkpoints import load_pretrained
  from mla_jax.tokenizer import checkpoint_tokenizer

  model = load_pretrained(args.speculative, dtype=jnp.float32, backend="xla", mtp=True)
  if args.speculative_prompt is not None:
    prompt = checkpoint_tokenizer(args.speculative).encode(args.speculative_prompt)
  else:
    prompt = np.random.default_rng(0).integers(0, min(model.config.vocab_size, 256),
                                               args.prompt_len).tolist()
  print(f"## Speculative decoding with MTP drafts: {args.speculative}\n\nGreedy, float32, "
        f"a prompt of {len(prompt)} tokens, {args.new_tokens} new tokens, decode only (the "
        f"best of {args.repeats} runs after a warm-up); XLA backend, "
        f"{generation.DEFAULT_STEPS_PER_DISPATCH} steps (iterations) per dispatch.\n")

  def generate_row(batch, k):
    tps, run = mla_jax_tokens_per_s(model, [prompt] * batch, args.new_tokens, args.repeats,
                                    speculative_tokens=k)
    return tps, run.acceptance_rate

  k_table(generate_row, args, "decode tokens/s")
  if args.engine:
    engine_speculative_table(model, prompt, args)


def k_table(measure, args, column: str) -> None:
  """A row per (batch, k) of ``measure(batch, k) -> (tokens/s, acceptance or None)``, with
  the speed-up over k = 0 of the same batch."""
  print(f"| batch | k | acceptance | {column} | speed-up |")
  print("|---|---|---|---|---|")
  for batch in args.speculative_batches:
    base = None
    for k in args.speculative_tokens:
      tps, rate = measure(batch, k)
      base = tps if k == 0 else base
      speed_up = "-" if base is None else f"{tps / base:.2f}x"
      print(f"| {batch} | {k} | {'-' if rate is None else f'{rate:.2f}'} | {tps:.0f} | "
            f"{speed_up} |", flush=True)


def engine_tokens_per_s(engine, prompts, new_tokens: int, repeats: int, k: int):
  """The engine's best output tokens/s (prefill step included, compiles excluded) of
  ``repeats`` runs after a warm-up, and the last run's acceptance rate."""
  params = SamplingParams(max_tokens=new_tokens, speculative_tokens=k)
  engine.generate(prompts, params)  # compiles
  best, rate = 0.0, None
  for _ in range(repeats):
    before = dataclasses.replace(engine.stats)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    seconds = time.perf_counter() - t0 - (engine.stats.compile_s - before.compile_s)
    best = max(best, len(prompts) * new_tokens / seconds)
    drafted = engine.stats.draft_tokens - before.draft_tokens
    rate = (engine.stats.accepted_tokens - before.accepted_tokens) / drafted if drafted else None
  return best, rate


def engine_speculative_table(model, prompt, args) -> None:
  """The same table through the Engine: each request asks for k drafts per step; k = 0 runs
  on an engine without MTP caches (plain serving's engine)."""
  new = args.new_tokens
  make = lambda k: Engine(model, num_pages=2 * max(args.speculative_batches)
                          * pages_for(len(prompt) + new, 16), page_size=16,
                          max_num_seqs=max(args.speculative_batches), max_step_tokens=512,
                          log_interval=None, max_speculative_tokens=k)
  plain, speculative = make(0), make(max(args.speculative_tokens))
  print(f"\n### Through the Engine (continuous batching, paged caches)\n\nThe same prompt "
        f"copied over the batch, all arriving at once; output tokens/s over the whole run (its "
        f"prefill step included), the best of {args.repeats} runs after a warm-up; one step "
        f"per dispatch; page size 16, prefix caching on; k = 0 on an engine without MTP "
        f"caches.\n")
  k_table(lambda batch, k: engine_tokens_per_s(speculative if k else plain, [prompt] * batch,
                                               new, args.repeats, k), args, "output tokens/s")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--contexts", type=int, nargs="+",
                      default=[256, 1024, 4096, 16384, 32768])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--steps-per-dispatch", type=int,
                      default=generation.DEFAULT_STEPS_PER_DISPATCH)
  parser.add_argument("--dispatch-context", type=int, default=1024,
                      help="context of the steps-per-dispatch table (0: no table)")
  parser.add_argument("--hf-python", help="a Python with torch and transformers: adds the HF "
                                          "eager comparison")
  parser.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats-hf", type=int, default=5)
  parser.add_argument("--no-sweep", action="store_true", help="no context sweep")
  parser.add_argument("--dispatch", action="store_true",
                      help="host time per dispatch and tokens/s at 1 vs 8 steps per dispatch")
  parser.add_argument("--speculative", metavar="CKPT",
                      help="a checkpoint with MTP layers: the speculative decoding table")
  parser.add_argument("--speculative-tokens", type=int, nargs="+", default=[0, 1, 2, 3])
  parser.add_argument("--speculative-batches", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--speculative-prompt", help="the table's prompt, as text")
  parser.add_argument("--engine", action="store_true",
                      help="with --speculative: the same table through the Engine")
  args = parser.parse_args(argv)
  if min(args.contexts) <= args.steps_per_dispatch:
    parser.error(f"every context must exceed --steps-per-dispatch {args.steps_per_dispatch}")
  if not args.no_sweep:
    sweep(args)
  if args.dispatch:
    dispatch_overhead(args)
  if args.hf_python:
    hf_comparison(args)
  if args.speculative:
    speculative_table(args)


if __name__ == "__main__":
  main()
