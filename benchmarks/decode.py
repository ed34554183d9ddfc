"""Decode step time against the live context, one optimization at a time; mla_jax vs HF eager.

    python benchmarks/decode.py                            # the context sweep (~3 minutes)
    python benchmarks/decode.py --hf-python /path/to/venv/bin/python   # + HF eager, batch 1/8/32

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

Times are per decode step (one token for every sequence of the batch), medians of
``--repeats`` dispatches after a warm-up; every lengths reset keeps L fixed across repeats.
Everything in one table is measured in the same run: this machine is shared and noisy, so
compare ratios within a table, not across runs.

HF (``--hf-python``, an interpreter with torch and transformers): ``hf_eager_decode.py``
builds and saves a random tiny DeepSeek-V3.2 checkpoint (the tiny preset's dimensions) and
times HF eager greedy decoding; mla_jax loads the same files and decodes the same prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mla_jax import generation  # noqa: E402
from mla_jax.cache import bucket_rows  # noqa: E402
from mla_jax.generation import SamplingConfig  # noqa: E402
from mla_jax.models.config import small_lm  # noqa: E402
from mla_jax.models.lm import CausalLM, ModelCache  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DECODE_STATIC = ("graphdef", "sampling", "eos_id", "steps", "kv_rows", "keep_logits")
# The decode program without donation: "before" (the same computation, caches copied).
_decode_copying = jax.jit(generation._decode.__wrapped__, static_argnames=DECODE_STATIC)


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


def with_lengths(caches: ModelCache, length: int) -> ModelCache:
  """The same buffers with every sequence holding ``length`` rows."""
  return ModelCache(tuple(tuple(dataclasses.replace(
      c, lengths_B=jnp.full(c.lengths_B.shape, length, jnp.int32)) for c in unit)
      for unit in caches.groups), caches.layout)


def time_variant(model, variant: Variant, contexts, batch: int, repeats: int):
  """Seconds per decode step at each live context (a dispatch ends at that context)."""
  capacity = max(contexts)
  graphdef, state = nnx.split(model)
  caches = random_caches(model, batch, capacity, variant.cache_dtype)
  fn = generation._decode if variant.donate else _decode_copying
  scalar = lambda i: jnp.asarray(i, jnp.int32)
  seed, first, end = jnp.asarray(0, jnp.uint32), scalar(1), scalar(2**30)
  programs, out = {}, {}
  for context in contexts:
    rows = bucket_rows(context, capacity) if variant.buckets else capacity
    static = dict(sampling=SamplingConfig(), eos_id=None, steps=variant.steps, kv_rows=rows,
                  keep_logits=False)
    tokens, done = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool)
    if rows not in programs:
      programs[rows] = fn.lower(graphdef, state, caches, tokens, done, seed, first, end,
                                **static).compile()
    times = []
    for _ in range(repeats + 1):  # the first dispatch warms up
      caches = with_lengths(caches, context - variant.steps)
      tokens, done = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool)
      t0 = time.perf_counter()
      result = programs[rows](state, caches, tokens, done, seed, first, end)
      jax.block_until_ready(result)
      times.append((time.perf_counter() - t0) / variant.steps)
      caches = result[2]
    out[context] = statistics.median(times[1:])
  return out, len(programs)


def sweep(args) -> None:
  contexts = sorted(args.contexts)
  model = sweep_model(max(contexts))
  cfg = model.config
  per_layer = {d: model.init_cache(1, 1, d).layer(0).bytes_per_token for d in ("fp32", "fp8")}
  print(f"## Decode step time (ms) against the live context\n\n`small` preset "
        f"({cfg.num_layers} layers, A={cfg.mla.kv_lora_rank}, R={cfg.mla.qk_rope_head_dim}, "
        f"index top-k {cfg.mla.indexer.topk}), batch {args.batch}, cache capacity "
        f"{max(contexts)}, XLA backend on {jax.devices()[0].platform}; cache bytes per token "
        f"per layer: fp32 {per_layer['fp32']}, fp8 {per_layer['fp8']}. Medians of "
        f"{args.repeats} dispatches.\n", flush=True)
  columns = variants(args.steps_per_dispatch)
  results, programs = {}, {}
  for v in columns:
    t0 = time.perf_counter()
    results[v.name], programs[v.name] = time_variant(model, v, contexts, args.batch,
                                                     args.repeats)
    print(f"[{v.name}: {programs[v.name]} program(s), {time.perf_counter() - t0:.0f}s]",
          file=sys.stderr, flush=True)
  first, last = columns[0].name, columns[-1].name
  print("| live context | " + " | ".join(v.name for v in columns) + f" | {first} / {last} |")
  print("|---" * (len(columns) + 2) + "|")
  for context in contexts:
    cells = " | ".join(f"{results[v.name][context] * 1e3:.2f}" for v in columns)
    print(f"| {context} | {cells} | {results[first][context] / results[last][context]:.1f}x |")
  print(f"\nCompiled decode programs per column: "
        + ", ".join(f"{v.name} {programs[v.name]}" for v in columns) + "\n", flush=True)
  if args.dispatch_context:
    dispatch_table(model, args)


def dispatch_table(model, args) -> None:
  """Step time against the steps per dispatch, at one context (picks the default N)."""
  context = args.dispatch_context
  print(f"## Steps per dispatch at live context {context} (ms per step, batch {args.batch})\n")
  row = {}
  for n in (1, 2, 4, 8, 16):
    times, _ = time_variant(model, Variant(f"{n}", True, True, n, "fp32"), [context],
                            args.batch, args.repeats)
    row[n] = times[context]
  print("| steps per dispatch | " + " | ".join(str(n) for n in row) + " |")
  print("|---" * (len(row) + 1) + "|")
  print("| ms per step | " + " | ".join(f"{t * 1e3:.2f}" for t in row.values()) + " |\n",
        flush=True)


def mla_jax_tokens_per_s(model, ids, new_tokens: int, repeats: int, cache_dtype: str):
  generation.generate(model, ids, new_tokens, cache_dtype=cache_dtype)  # compiles
  runs = [generation.generate(model, ids, new_tokens, cache_dtype=cache_dtype)
          for _ in range(repeats)]
  return statistics.median(r.decode_tokens_per_s for r in runs), runs[0].tokens


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
        f"compile excluded), medians of {args.repeats_hf} runs after a warm-up. HF: torch "
        f"{hf['torch']}, transformers {hf['transformers']}, {hf['threads']} threads, eager "
        f"attention with its KV cache. mla_jax: XLA backend, "
        f"{generation.DEFAULT_STEPS_PER_DISPATCH} steps per dispatch.\n")
  print("| batch | HF eager | mla_jax fp32 cache | ratio | mla_jax fp8 cache | ratio |")
  print("|---|---|---|---|---|---|")
  agreement = None
  for batch in args.hf_batches:
    hf_tps = hf["tokens_per_s"][str(batch)]
    fp32, tokens = mla_jax_tokens_per_s(model, ids[:batch], args.new_tokens, args.repeats_hf,
                                        "fp32")
    fp8, _ = mla_jax_tokens_per_s(model, ids[:batch], args.new_tokens, args.repeats_hf, "fp8")
    if batch == 1:
      agreement = np.mean(np.asarray(tokens[0]) == np.asarray(hf["tokens"]))
    print(f"| {batch} | {hf_tps:.0f} | {fp32:.0f} | {fp32 / hf_tps:.1f}x | {fp8:.0f} | "
          f"{fp8 / hf_tps:.1f}x |", flush=True)
  if agreement is not None:
    print(f"\nBatch 1 greedy tokens equal to HF's (fp32 cache): {agreement:.0%}\n")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--contexts", type=int, nargs="+",
                      default=[256, 1024, 4096, 16384, 32768])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--steps-per-dispatch", type=int,
                      default=generation.DEFAULT_STEPS_PER_DISPATCH)
  parser.add_argument("--dispatch-context", type=int, default=1024,
                      help="context of the steps-per-dispatch table (0: no table)")
  parser.add_argument("--hf-python", help="a Python with torch and transformers: adds the HF "
                                          "eager comparison")
  parser.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats-hf", type=int, default=3)
  parser.add_argument("--no-sweep", action="store_true", help="only the HF comparison")
  args = parser.parse_args(argv)
  if min(args.contexts) <= args.steps_per_dispatch:
    parser.error(f"every context must exceed --steps-per-dispatch {args.steps_per_dispatch}")
  if not args.no_sweep:
    sweep(args)
  if args.hf_python:
    hf_comparison(args)


if __name__ == "__main__":
  main()
