"""Serving: the Engine against static batches of ``generate``; prefix caching; latency; host time.

    python benchmarks/serving.py                   # tiny and small presets (~45 minutes)
    python benchmarks/serving.py --quick           # tiny sizes, tiny preset (~2 minutes)
    python benchmarks/serving.py --preset small --requests 64 --seed 1
    python benchmarks/serving.py --quick --sections throughput,static   # two of the six
    python benchmarks/serving.py --preset tiny --hf-python /path/to/venv/bin/python  # + HF

Every figure comes from one run (XLA:CPU, random weights from ``randomize_params``, greedy
sampling, no end-of-sequence id, so every request produces exactly its ``max_tokens``); this
machine is shared and noisy, so compare the ratios within a table, not tables of different runs.

1. Throughput: ``--requests`` requests (prompt lengths log-uniform, output lengths uniform), all
   arriving at once. Output tokens/s of the Engine against ``generate`` over static batches of
   ``max_num_seqs`` requests in arrival order, each batch running to its longest ``max_tokens``
   (only each request's own tokens count as output). With ``--hf-python`` (an interpreter with
   torch and transformers), also HF transformers ``generate`` over the same static batches
   (``hf_static_batches.py``: left-padded, eager, tiny preset only).
2. Shared prefix: requests sharing a long prefix plus a short distinct suffix, all at once: time
   to first token with prefix caching and without (``Engine(prefix_caching=False)``).
3. Latency: Poisson arrivals at fractions of the request rate the Engine sustained in (1);
   the engine is driven incrementally (``add_request`` once a request's arrival time has passed,
   ``step`` in a loop). Time to first token counts from the scheduled arrival; inter-token
   latency is every gap between a request's consecutive tokens.
4. Host time per engine dispatch (scheduling, input building, commit) with 32 running
   sequences decoding (a dispatch runs ``decode_steps`` decode steps).
5. Static batches through the engine: b prompts at once, 64 new tokens each, the engine's
   decode tokens/s against ``generate``'s on the same prompts.
6. Warm-up: a fresh process builds an engine with the default settings (``mla-jax serve``'s)
   and runs ``Engine.warmup``: cold, then twice over a persistent compilation cache (the first
   fills it, the second reads it: a restart).

Compilation is excluded everywhere but (6). Every engine warms up first (``Engine.warmup``),
and a workload's figures come from its second run at the earliest (the first run of a freshly
compiled program is slow too), at most its third, the first that compiled nothing; the clock
of a drive also stops while the engine compiles (``EngineStats.compile_s``), and
``generate``'s own ``compile_s`` is taken off its wall time. Every engine of a preset has the
same page pool, so they all share compiled programs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import timing  # noqa: E402
from benchmarks.generate import PRESETS  # noqa: E402
from mla_jax.generation.loop import generate  # noqa: E402
from mla_jax.models.lm import CausalLM  # noqa: E402
from mla_jax.serving.engine import Engine  # noqa: E402
from mla_jax.serving.pages import pages_for  # noqa: E402
from mla_jax.serving.sequence import RequestOutput, SamplingParams  # noqa: E402
from mla_jax.testing import randomize_params  # noqa: E402

PAGE_SIZE = 64
HOST_GOAL_S = 0.5e-3
HOST_SEQS = 32  # running sequences of the host-time measurement
HF_PRESET = "tiny"  # the one preset hf_eager_decode.py builds in transformers' classes


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The workloads of one run (lengths are inclusive ranges)."""

  requests: int
  prompt_lens: tuple[int, int]     # log-uniform
  output_lens: tuple[int, int]     # uniform
  max_num_seqs: int
  max_step_tokens: int
  prefix_requests: int
  prefix_len: int
  suffix_lens: tuple[int, int]
  prefix_max_tokens: int
  latency_requests: int            # per rate
  rates: tuple[float, ...]         # fractions of the engine's sustained request rate
  host_steps: int                  # measured decode steps at HOST_SEQS running

  @property
  def host_prompt(self) -> int:
    """The prompts of the host-time measurement: all HOST_SEQS prefill in one step."""
    return max(1, self.max_step_tokens // HOST_SEQS)

  def num_pages(self) -> int:
    """A pool where every seat can hold the longest request: no preemption is needed, and the
    static batches' caches are no smaller."""
    longest = max(self.prompt_lens[1] + self.output_lens[1],
                  self.prefix_len + self.suffix_lens[1] + self.prefix_max_tokens,
                  self.host_prompt + 2 * self.host_steps)
    return max(self.max_num_seqs, HOST_SEQS) * pages_for(longest, PAGE_SIZE)


FULL = Sizes(requests=256, prompt_lens=(16, 1024), output_lens=(16, 256), max_num_seqs=32,
             max_step_tokens=512, prefix_requests=64, prefix_len=512, suffix_lens=(8, 32),
             prefix_max_tokens=16, latency_requests=64, rates=(0.25, 0.5, 0.9), host_steps=128)
# Few distinct shapes (each costs seconds of compilation on 2 cores): short prompts, one static
# batch, a step budget of 128 tokens (the prefix spans one full step, so later requests hit it).
QUICK = Sizes(requests=8, prompt_lens=(16, 64), output_lens=(8, 16), max_num_seqs=8,
              max_step_tokens=128, prefix_requests=4, prefix_len=128, suffix_lens=(4, 12),
              prefix_max_tokens=4, latency_requests=8, rates=(0.25, 0.5, 0.9), host_steps=32)


@dataclasses.dataclass(frozen=True)
class Request:
  prompt: list[int]
  max_tokens: int
  arrival: float = 0.0  # seconds after the start of a drive


# ---- workloads ---------------------------------------------------------------------------

def random_requests(rng: np.random.Generator, n: int, prompt_lens, output_lens) -> list[Request]:
  """Prompt lengths log-uniform and output lengths uniform over their (inclusive) ranges."""
  lo, hi = np.log(prompt_lens[0]), np.log(prompt_lens[1] + 1)
  lengths = np.minimum(np.exp(rng.uniform(lo, hi, n)).astype(int), prompt_lens[1])
  outputs = rng.integers(output_lens[0], output_lens[1] + 1, n)
  return [Request(rng.integers(0, 256, p).tolist(), int(o)) for p, o in zip(lengths, outputs)]


def shared_prefix_requests(rng: np.random.Generator, sizes: Sizes) -> list[Request]:
  prefix = rng.integers(0, 256, sizes.prefix_len).tolist()
  suffixes = rng.integers(sizes.suffix_lens[0], sizes.suffix_lens[1] + 1, sizes.prefix_requests)
  return [Request(prefix + rng.integers(0, 256, s).tolist(), sizes.prefix_max_tokens)
          for s in suffixes]


def poisson_arrivals(rng: np.random.Generator, requests: list[Request], rate: float
                     ) -> list[Request]:
  """The requests arriving as a Poisson process of ``rate`` per second (the first at 0)."""
  gaps = rng.exponential(1 / rate, len(requests))
  gaps[0] = 0.0
  return [dataclasses.replace(r, arrival=float(t)) for r, t in zip(requests, np.cumsum(gaps))]


# ---- models and engines ------------------------------------------------------------------

def build_model(preset: str, seed: int) -> CausalLM:
  """The preset with random weights. Built and randomized in one jitted program: eagerly, every
  parameter shape compiles its own initializer, which takes twice as long on 2 cores."""

  @nnx.jit
  def build():
    model = CausalLM(PRESETS[preset](), rngs=nnx.Rngs(seed), backend="xla")
    randomize_params(model, seed)
    return model

  return build()


def make_engine(model: CausalLM, sizes: Sizes, **overrides) -> Engine:
  """An engine over the preset's pool, its step programs compiled (``warmup``)."""
  settings = dict(num_pages=sizes.num_pages(), page_size=PAGE_SIZE,
                  max_num_seqs=sizes.max_num_seqs, max_step_tokens=sizes.max_step_tokens,
                  log_interval=None)
  engine = Engine(model, **{**settings, **overrides})
  engine.warmup()
  return engine


def measured(fns: dict[str, Callable[[], Any]], tries: int = 3
             ) -> tuple[dict[str, Any], dict[str, Any]]:
  """Each function's first result (the warm-up) and its first later result that compiled
  nothing (``.compile_s == 0``; the last of ``tries`` calls at most), the calls interleaved as
  timing.py does. Taking compile time off the clock is not enough: the first run of a freshly
  compiled program is slow too (tens of ms on XLA:CPU, against a few ms warm)."""
  warm = {name: fn() for name, fn in fns.items()}
  last = {name: fn() for name, fn in fns.items()}
  for _ in range(tries - 2):
    for name in [name for name, result in last.items() if result.compile_s > 0]:
      last[name] = fns[name]()
  return warm, last


# ---- driving the engine ------------------------------------------------------------------

@dataclasses.dataclass
class Trace:
  """One drive: per request, its arrival and the time each of its tokens came back (seconds
  from the drive's start, compilation excluded), and its final output; the engine's steps,
  preemptions and compile seconds during the drive."""

  arrivals: list[float]
  token_times: list[list[float]]
  outputs: list[RequestOutput]
  compile_s: float = 0.0
  steps: int = 0
  preemptions: int = 0
  decode_tps: float | None = None  # section 5: decode tokens/s after the last first token

  @property
  def elapsed(self) -> float:
    return max(times[-1] for times in self.token_times)

  @property
  def output_tokens(self) -> int:
    return sum(len(times) for times in self.token_times)

  def ttft(self) -> np.ndarray:
    return np.array([times[0] - a for times, a in zip(self.token_times, self.arrivals)])

  def itl(self) -> np.ndarray:
    """Gaps between a request's arrivals of tokens: the tokens of one multi-step dispatch
    arrive together, one gap (as vLLM's benchmark counts a chunk of several tokens)."""
    return np.concatenate([np.diff(np.unique(times)) for times in self.token_times])


def drive(engine: Engine, requests: list[Request]) -> Trace:
  """Adds each request once its arrival time has passed and steps until all have finished,
  sleeping while nothing is queued. The clock stops while the engine compiles."""
  before, preempted = dataclasses.replace(engine.stats), engine.scheduler.num_preemptions
  clock = lambda: time.perf_counter() - (engine.stats.compile_s - before.compile_s)
  start = clock()
  pending = collections.deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
  index, times = {}, [[] for _ in requests]
  while pending or engine.has_unfinished():
    now = clock() - start
    while pending and requests[pending[0]].arrival <= now:
      r = requests[pending[0]]
      index[engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens))] = pending[0]
      pending.popleft()
    if not engine.has_unfinished():
      time.sleep(requests[pending[0]].arrival - now)
      continue
    for out in engine.step():  # a multi-step dispatch returns several tokens at one time
      times[index[out.request_id]].extend([clock() - start] * len(out.new_tokens))
  outputs = [None] * len(requests)
  for request_id, i in index.items():
    outputs[i] = engine.release(request_id)
  return Trace([r.arrival for r in requests], times, outputs,
               compile_s=engine.stats.compile_s - before.compile_s,
               steps=engine.stats.steps - before.steps,
               preemptions=engine.scheduler.num_preemptions - preempted)


# ---- 1. throughput -----------------------------------------------------------------------

def engine_compile_s(model: CausalLM, sizes: Sizes) -> float:
  """Seconds the first engine of a preset spends compiling its step programs (its warm-up);
  later engines reuse them."""
  engine = Engine(model, num_pages=sizes.num_pages(), page_size=PAGE_SIZE,
                  max_num_seqs=sizes.max_num_seqs, max_step_tokens=sizes.max_step_tokens,
                  log_interval=None)
  engine.warmup()
  return engine.stats.compile_s


@dataclasses.dataclass
class Static:
  """``generate`` over static batches: compile-free seconds, useful and computed tokens."""

  seconds: float
  compile_s: float
  useful: int
  computed: int
  tokens: list[list[int]]


def static_batches(model: CausalLM, requests: list[Request], batch: int) -> Static:
  out = Static(0.0, 0.0, 0, 0, [])
  for first in range(0, len(requests), batch):
    group = requests[first:first + batch]
    longest = max(r.max_tokens for r in group)
    result, wall = timing.once(generate, model, [r.prompt for r in group], longest, sync=None)
    out.seconds += wall - result.compile_s
    out.compile_s += result.compile_s
    out.useful += sum(r.max_tokens for r in group)
    out.computed += len(group) * longest
    out.tokens += [row[:r.max_tokens] for row, r in zip(result.tokens, group)]
  return out


def hf_static_batches(hf_python: str, requests: list[Request], batch: int) -> dict:
  """HF transformers over the same static batches, in the side interpreter ``hf_python``."""
  import json
  import subprocess
  import tempfile

  with tempfile.TemporaryDirectory() as tmp:
    work = os.path.join(tmp, "requests.json")
    with open(work, "w") as f:
      json.dump({"prompts": [r.prompt for r in requests],
                 "max_tokens": [r.max_tokens for r in requests]}, f)
    done = subprocess.run([hf_python, os.path.join(HERE, "hf_static_batches.py"), work,
                           os.path.join(tmp, "ckpt"), "--batch", str(batch)],
                          capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise SystemExit(f"--hf-python {hf_python} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def throughput(model: CausalLM, sizes: Sizes, rng: np.random.Generator,
               hf_python: str | None = None) -> dict:
  requests = random_requests(rng, sizes.requests, sizes.prompt_lens, sizes.output_lens)
  before = engine_compile_s(model, sizes)
  warm, runs = measured({
      "engine": lambda: drive(make_engine(model, sizes), requests),
      "static": lambda: static_batches(model, requests, sizes.max_num_seqs)})
  trace, static = runs["engine"], runs["static"]
  same = sum(list(o.tokens) == s for o, s in zip(trace.outputs, static.tokens))
  return {"requests": len(requests), "engine_tps": trace.output_tokens / trace.elapsed,
          "static_tps": static.useful / static.seconds, "useful": static.useful / static.computed,
          "engine_compile_s": before,
          "static_compile_s": warm["static"].compile_s,
          "request_rate": len(requests) / trace.elapsed, "steps": trace.steps,
          "preemptions": trace.preemptions, "same": same,
          "hf": None if hf_python is None else hf_static_batches(hf_python, requests,
                                                                 sizes.max_num_seqs)}


# ---- 2. shared prefix --------------------------------------------------------------------

def shared_prefix(model: CausalLM, sizes: Sizes, rng: np.random.Generator) -> dict:
  requests = shared_prefix_requests(rng, sizes)
  _, traces = measured({caching: lambda caching=caching: drive(
      make_engine(model, sizes, prefix_caching=caching), requests) for caching in (True, False)})
  ttft = {caching: t.ttft() for caching, t in traces.items()}
  cached = np.mean([o.num_cached_prompt_tokens for o in traces[True].outputs])
  return {"requests": len(requests), "mean": {c: t.mean() for c, t in ttft.items()},
          "p50": {c: np.median(t) for c, t in ttft.items()}, "cached": cached}


# ---- 3. latency --------------------------------------------------------------------------

def latency(model: CausalLM, sizes: Sizes, rng: np.random.Generator, sustained: float
            ) -> list[dict]:
  requests = random_requests(rng, sizes.latency_requests, sizes.prompt_lens, sizes.output_lens)
  rows = []
  for fraction in sizes.rates:
    rate = fraction * sustained
    arriving = poisson_arrivals(rng, requests, rate)
    trace = measured({"": lambda: drive(make_engine(model, sizes), arriving)})[1][""]
    ttft, itl = (np.percentile(x, [50, 99]) for x in (trace.ttft(), trace.itl()))
    rows.append({"fraction": fraction, "rate": rate, "ttft": ttft, "itl": itl,
                 "compile_s": trace.compile_s})
  return rows


# ---- 4. host time per step ---------------------------------------------------------------

def host_time(model: CausalLM, sizes: Sizes, rng: np.random.Generator) -> dict:
  """Host and device seconds of each of ``host_steps`` decode steps with HOST_SEQS sequences
  running, once every sequence has its first token."""
  engine = make_engine(model, sizes, max_num_seqs=HOST_SEQS)
  for prompt in rng.integers(0, 256, (HOST_SEQS, sizes.host_prompt)).tolist():
    engine.add_request(prompt, SamplingParams(max_tokens=2 * sizes.host_steps))
  running, stats = engine.scheduler.running, engine.stats
  while len(running) < HOST_SEQS or any(seq.num_uncomputed > 1 for seq in running):
    engine.step()
  engine.step()  # the first decode step: this engine's first use of its program is slower
  host, run, tokens = [], [], 0
  for _ in range(sizes.host_steps // engine.decode_steps):
    before = dataclasses.replace(stats)
    engine.step()
    host.append(stats.host_s - before.host_s)
    run.append(stats.run_s - before.run_s)
    tokens += stats.output_tokens - before.output_tokens
  assert len(running) == HOST_SEQS, "a sequence finished before the end"
  return {"steps": len(host), "host_mean": np.mean(host), "host_p50": np.median(host),
          "run_p50": np.median(run), "tokens_per_dispatch": tokens / len(host) / HOST_SEQS}


# ---- 5. static batches through the engine ------------------------------------------------

STATIC_BATCHES = (1, 8)
STATIC_NEW_TOKENS = 64
STATIC_PROMPT = 64


def static_through_engine(model: CausalLM, sizes: Sizes, rng: np.random.Generator) -> list[dict]:
  """Per batch size b: b prompts of ``STATIC_PROMPT`` tokens at once, ``STATIC_NEW_TOKENS``
  each; decode tokens/s (every token after each request's first, over the time after the
  last first token) of the engine and of ``generate`` (its ``decode_tokens_per_s``)."""
  rows = []
  for b in STATIC_BATCHES:
    prompts = rng.integers(0, 256, (b, STATIC_PROMPT)).tolist()
    requests = [Request(p, STATIC_NEW_TOKENS) for p in prompts]

    def engine_run():
      trace = drive(make_engine(model, sizes), requests)
      start = max(times[0] for times in trace.token_times)
      decoded = sum(len(times) - 1 for times in trace.token_times)
      return dataclasses.replace(trace, decode_tps=decoded / (trace.elapsed - start))

    _, runs = measured({"engine": engine_run,
                        "generate": lambda: generate(model, prompts, STATIC_NEW_TOKENS)})
    same = [list(o.tokens) for o in runs["engine"].outputs] == runs["generate"].tokens
    rows.append({"batch": b, "engine": runs["engine"].decode_tps,
                 "generate": runs["generate"].decode_tokens_per_s, "same": same})
  return rows


# ---- 6. warm-up --------------------------------------------------------------------------

def warmup_child(preset: str, cache: str | None) -> None:
  """In a fresh process: an engine with ``mla-jax serve``'s default settings warms up; prints
  ``programs seconds``."""
  if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  model = build_model(preset, 0)
  engine = Engine(model, num_pages=512, log_interval=None)
  count, seconds = engine.warmup()
  print(count, seconds)


def warmup_times(preset: str) -> dict:
  """Cold warm-up, then a first and a second (a restart's) over one persistent cache."""
  import subprocess
  import tempfile

  def child(*flags):
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--warmup-child", preset,
                           *flags], capture_output=True, text=True, check=False)
    if done.returncode != 0:
      raise SystemExit(f"warm-up child failed:\n{done.stderr[-3000:]}")
    count, seconds = done.stdout.split()[-2:]
    return int(count), float(seconds)

  with tempfile.TemporaryDirectory() as cache:
    cold = child()
    filling = child("--warmup-cache", cache)
    restart = child("--warmup-cache", cache)
  return {"programs": cold[0], "cold": cold[1], "filling": filling[1], "restart": restart[1]}


# ---- tables ------------------------------------------------------------------------------

def table(header: list[str], rows: list[list]) -> None:
  print("| " + " | ".join(header) + " |")
  print("|---" * len(header) + "|")
  for row in rows:
    print("| " + " | ".join(map(str, row)) + " |")
  print(flush=True)


def ms(seconds: float) -> str:
  return f"{seconds * 1e3:.1f}"


def report_throughput(results: dict[str, dict], sizes: Sizes) -> None:
  print(f"## 1. Throughput: Engine vs static batches of `generate`\n\nPrompts log-uniform in "
        f"{sizes.prompt_lens}, outputs uniform in {sizes.output_lens}, all arriving at once; "
        f"`max_num_seqs` = static batch = {sizes.max_num_seqs}, `max_step_tokens` "
        f"{sizes.max_step_tokens}, pages of {PAGE_SIZE}. Output tokens/s of the measured run "
        f"(after a warm-up run that compiled for the seconds shown). Static useful: the share "
        f"of the static batches' decoded tokens that are requests' own.\n")
  def hf(t, column):
    if t["hf"] is None:
      return "-"
    tps = t["hf"]["useful"] / t["hf"]["seconds"]
    return f"{tps:.0f}" if column == "tps" else f"{t['engine_tps'] / tps:.1f}x"

  table(["preset", "requests", "engine tok/s", "static tok/s", "engine / static",
         "HF static tok/s", "engine / HF", "static useful",
         "warm-up compile s, engine / static", "engine steps", "preemptions",
         "same greedy tokens"],
        [[p, t["requests"], f"{t['engine_tps']:.0f}", f"{t['static_tps']:.0f}",
          f"{t['engine_tps'] / t['static_tps']:.2f}x", hf(t, "tps"), hf(t, "ratio"),
          f"{t['useful']:.0%}", f"{t['engine_compile_s']:.0f} / {t['static_compile_s']:.0f}",
          t["steps"], t["preemptions"], f"{t['same']}/{t['requests']}"]
         for p, t in ((p, r["throughput"]) for p, r in results.items())])
  versions = [r["throughput"]["hf"] for r in results.values() if r["throughput"]["hf"]]
  if versions:
    v = versions[0]
    print(f"HF: transformers {v['transformers']}, torch {v['torch']} ({v['threads']} threads), "
          f"eager attention with the KV cache, left-padded static batches, the {HF_PRESET} "
          "preset's dimensions with its own random weights.")
  else:
    print(f"HF: not measured (give --hf-python; {HF_PRESET} preset only).")
  print()


def report_prefix(results: dict[str, dict], sizes: Sizes) -> None:
  print(f"## 2. Shared prefix: time to first token (ms)\n\nA {sizes.prefix_len}-token prefix "
        f"plus {sizes.suffix_lens} distinct tokens, {sizes.prefix_max_tokens} output tokens, "
        f"all arriving at once; prefix caching on and off.\n")
  table(["preset", "requests", "mean, caching", "mean, no caching", "ratio",
         "p50, caching", "p50, no caching", "ratio", "prompt tokens from the cache (mean)"],
        [[p, s["requests"], ms(s["mean"][True]), ms(s["mean"][False]),
          f"{s['mean'][False] / s['mean'][True]:.2f}x", ms(s["p50"][True]), ms(s["p50"][False]),
          f"{s['p50'][False] / s['p50'][True]:.2f}x", f"{s['cached']:.0f}"]
         for p, s in ((p, r["prefix"]) for p, r in results.items())])


def report_latency(results: dict[str, dict], sizes: Sizes) -> None:
  print(f"## 3. Latency under Poisson arrivals (ms)\n\n{sizes.latency_requests} requests per "
        f"rate (the throughput workload's distributions); rates are fractions of the request "
        f"rate the engine sustained in (1). TTFT from the scheduled arrival. A drive whose "
        f"batches differ from its warm-up's may compile: its clock stops meanwhile.\n")
  table(["preset", "load", "requests/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
         "compile s while measured"],
        [[p, f"{row['fraction']:.0%}", f"{row['rate']:.2f}", ms(row["ttft"][0]),
          ms(row["ttft"][1]), ms(row["itl"][0]), ms(row["itl"][1]), f"{row['compile_s']:.0f}"]
         for p, r in results.items() for row in r["latency"]])


def report_host(results: dict[str, dict]) -> None:
  print(f"## 4. Host time per engine dispatch, {HOST_SEQS} running sequences\n\n"
        f"`stats.host_s / stats.steps` (compilation taken off) over decode dispatches (each "
        f"runs up to the engine's `decode_steps` decode steps), goal <= 0.5 ms a dispatch; the "
        f"median beside it (this machine is shared), per decode step, and the median "
        f"dispatch's program run time.\n")
  table(["preset", "dispatches", "host ms/dispatch (mean)", "host ms/dispatch (median)",
         "host ms per decode step", "run ms/dispatch (median)", "goal"],
        [[p, h["steps"], f"{h['host_mean'] * 1e3:.3f}", f"{h['host_p50'] * 1e3:.3f}",
          f"{h['host_mean'] * 1e3 / h['tokens_per_dispatch']:.3f}",
          f"{h['run_p50'] * 1e3:.2f}", "met" if h["host_mean"] <= HOST_GOAL_S else "missed"]
         for p, h in ((p, r["host"]) for p, r in results.items())])


def report_static(results: dict[str, dict]) -> None:
  print(f"## 5. Static batches through the engine: decode tokens/s\n\n{STATIC_PROMPT}-token "
        f"prompts, {STATIC_NEW_TOKENS} new tokens each, all at once; the engine (multi-step "
        f"decode dispatches) against `generate` on the same prompts (goal >= 0.9x).\n")
  table(["preset", "batch", "engine decode tok/s", "generate decode tok/s", "engine / generate",
         "same greedy tokens"],
        [[p, row["batch"], f"{row['engine']:.0f}", f"{row['generate']:.0f}",
          f"{row['engine'] / row['generate']:.2f}x", "yes" if row["same"] else "NO"]
         for p, r in results.items() for row in r["static"]])


def report_warmup(results: dict[str, dict]) -> None:
  print("## 6. Warm-up: every step program of the default settings\n\nA fresh process builds "
        "an engine with `mla-jax serve`'s defaults (512 pages of 64, 32 seats, 512 tokens a "
        "step, 8 decode steps a dispatch) and runs `Engine.warmup()`: cold, then twice over one "
        "persistent compilation cache (`--compilation-cache`): filling it, then a restart.\n")
  table(["preset", "programs", "cold s", "filling the cache s", "restart from the cache s",
         "cold / restart"],
        [[p, w["programs"], f"{w['cold']:.1f}", f"{w['filling']:.1f}", f"{w['restart']:.1f}",
          f"{w['cold'] / w['restart']:.1f}x"]
         for p, w in ((p, r["warmup"]) for p, r in results.items())])


SECTIONS = ("throughput", "prefix", "latency", "host", "static", "warmup")


def run_preset(preset: str, sizes: Sizes, seed: int, hf_python: str | None = None,
               sections=SECTIONS) -> dict:
  model = build_model(preset, seed)
  rng = lambda tag: np.random.default_rng((seed, tag))
  measure = {
      "throughput": lambda out: throughput(model, sizes, rng(1),
                                           hf_python if preset == HF_PRESET else None),
      "prefix": lambda out: shared_prefix(model, sizes, rng(2)),
      # Poisson arrivals at fractions of the rate the throughput run sustained.
      "latency": lambda out: latency(model, sizes, rng(3), out["throughput"]["request_rate"]),
      "host": lambda out: host_time(model, sizes, rng(4)),
      "static": lambda out: static_through_engine(model, sizes, rng(5)),
      "warmup": lambda out: warmup_times(preset),
  }
  out = {}
  for name in SECTIONS:
    if name in sections:
      out[name] = measure[name](out)
  return out


def parse_sections(text: str) -> tuple[str, ...]:
  """``--sections``: a comma-separated subset of ``SECTIONS`` (latency needs throughput)."""
  sections = tuple(t.strip() for t in text.split(",") if t.strip())
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown or not sections:
    raise argparse.ArgumentTypeError(f"unknown sections {unknown}; choose from "
                                     f"{', '.join(SECTIONS)}")
  if "latency" in sections and "throughput" not in sections:
    raise argparse.ArgumentTypeError("latency needs throughput (its arrival rates come from it)")
  return sections


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(PRESETS),
                      help="one preset (default: both; --quick: tiny)")
  parser.add_argument("--requests", type=int, help="throughput requests (default 256; quick 8)")
  parser.add_argument("--quick", action="store_true", help="tiny sizes, tiny preset (~2 minutes)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sections", type=parse_sections, default=SECTIONS,
                      help=f"comma-separated subset of {','.join(SECTIONS)} (default all)")
  parser.add_argument("--warmup-child", help=argparse.SUPPRESS)  # internal: section 6
  parser.add_argument("--warmup-cache", help=argparse.SUPPRESS)
  parser.add_argument("--hf-python", metavar="PYTHON",
                      help="an interpreter with torch and transformers: adds HF static batches "
                           f"to the throughput table ({HF_PRESET} preset)")
  args = parser.parse_args(argv)
  if args.warmup_child:
    warmup_child(args.warmup_child, args.warmup_cache)
    return
  sizes = QUICK if args.quick else FULL
  if args.requests is not None:
    if args.requests < 1:
      parser.error(f"--requests must be >= 1, got {args.requests}")
    sizes = dataclasses.replace(sizes, requests=args.requests)
  presets = [args.preset] if args.preset else ["tiny"] if args.quick else ["tiny", "small"]
  t0 = time.perf_counter()
  results = {}
  for preset in presets:
    results[preset] = run_preset(preset, sizes, args.seed, args.hf_python, args.sections)
    print(f"[{preset} measured, {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
  print(f"# Serving benchmark (XLA on {jax.devices()[0].platform}, seed {args.seed})\n")
  reports = {"throughput": lambda: report_throughput(results, sizes),
             "prefix": lambda: report_prefix(results, sizes),
             "latency": lambda: report_latency(results, sizes),
             "host": lambda: report_host(results), "static": lambda: report_static(results),
             "warmup": lambda: report_warmup(results)}
  for name in args.sections:
    reports[name]()


if __name__ == "__main__":
  main()
