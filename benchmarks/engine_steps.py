"""The engine's step loop, apart from its model: host time with the device stubbed out, how much of
a step's host work hides behind the device, and what the indexer of a mixed step costs.

    python benchmarks/engine_steps.py                        # all three (~5 minutes, CPU)
    python benchmarks/engine_steps.py --sections host        # one of host, overlap, ragged

1. Host: ``Engine.step`` with a stand-in for the device (``StubRunner``: every program
   "returns" at once, token 1 for every sampled row), at 32 and 256 running sequences decoding
   after 1K- and 32K-token prompts, one step a dispatch and 8. Goal (issue 46): <= 0.2 ms a
   step at 32 sequences, <= 1 ms at 256, flat in context.
2. Overlap: a static batch decoding one step a dispatch: the engine's wall time a step against
   the device's alone (the same step program called back to back) and the host's alone (the
   stubbed engine in the same state). Goal: wall <= 1.1 x max(host, device).
3. Ragged: one step program over one 4K-reach decode row beside 16 short ones, against the
   long row's step and the short rows' step apart, and against the covering program (every
   row scoring up to the longest reach: what a step cost before the key blocks). Goal:
   together <= 1.3 x apart.

XLA:CPU on this machine, one run; compare ratios within a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mla_jax.models.config import tiny_lm  # noqa: E402
from mla_jax.models.lm import CausalLM  # noqa: E402
from mla_jax.serving import engine as engine_module  # noqa: E402
from mla_jax.serving.engine import Engine  # noqa: E402
from mla_jax.serving.runner import InFlight  # noqa: E402
from mla_jax.serving.sequence import SamplingParams  # noqa: E402
from mla_jax.serving.step_inputs import Layout  # noqa: E402
from mla_jax.testing import randomize_params  # noqa: E402

PAGE = 64
MAX_CONTEXT = 32768  # every host engine is sized for the longest context: only the context varies
HOST_GOALS_MS = {32: 0.2, 256: 1.0}


class _StubFlight(InFlight):
  def read(self):
    outputs = {name: np.zeros(dims, dtype) for name, dims, dtype in self.layout.output_fields()}
    outputs["tokens"][:] = 1
    return outputs


class StubRunner:
  """Stands in for ``ModelRunner``: no pools, no programs, outputs at once."""

  def __init__(self, model, *, logit_rows, mtp, **_):
    self.logit_rows, self.mtp = logit_rows, mtp
    self.compile_s = self.background_compile_s = 0.0
    self.programs = []

  def layout(self, shape):
    return Layout(shape, self.logit_rows, self.mtp)

  def program_shape(self, shape):
    return shape

  def dispatch(self, shape, inputs):
    return _StubFlight(self.layout(shape), None, time.perf_counter())


def stubbed_engine(seqs: int, context: int, decode_steps: int) -> Engine:
  """An engine over an abstract model (nothing allocated) with ``seqs`` requests decoding after
  ``context``-token prompts, every prompt computed."""
  config = tiny_lm()
  config = dataclasses.replace(config, mla=dataclasses.replace(
      config.mla, max_position_embeddings=2 * MAX_CONTEXT))
  model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), backend="xla"))
  real = engine_module.ModelRunner
  engine_module.ModelRunner = StubRunner
  try:
    engine = Engine(model, num_pages=seqs * (MAX_CONTEXT // PAGE + 4), page_size=PAGE,
                    max_num_seqs=seqs, max_step_tokens=max(512, seqs), log_interval=None,
                    decode_steps=decode_steps)
  finally:
    engine_module.ModelRunner = real
  rng = np.random.default_rng(0)
  for _ in range(seqs):
    engine.add_request(rng.integers(0, 256, context).tolist(),
                       SamplingParams(max_tokens=context // 2, ignore_eos=True))
  while any(s.num_output == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
    engine.step()
  return engine


def host_ms(engine: Engine, steps: int = 64) -> tuple[float, float]:
  """Median and mean ms of ``engine.step()`` (the device stubbed out)."""
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3, statistics.mean(times) * 1e3


def section_host() -> list[list]:
  rows = []
  for seqs in (32, 256):
    for context in (1024, 32768):
      for steps in (1, 8):
        engine = stubbed_engine(seqs, context, steps)
        p50, mean = host_ms(engine)
        per_step = p50 / steps
        rows.append([seqs, context, steps, f"{p50:.3f}", f"{mean:.3f}", f"{per_step:.3f}",
                     f"<= {HOST_GOALS_MS[seqs]}", "met" if per_step <= HOST_GOALS_MS[seqs]
                     else "missed"])
        print(f"[host {seqs} x {context}, {steps} steps: {p50:.3f} ms]", file=sys.stderr)
  return rows


def real_model(seed: int = 0) -> CausalLM:
  @nnx.jit
  def build():
    model = CausalLM(tiny_lm(), rngs=nnx.Rngs(seed), backend="xla")
    randomize_params(model, seed)
    return model
  return build()


def _device_ms(engine: Engine, chunks, repeats: int = 20) -> float:
  """Median ms of the step program over ``chunks`` (the engine's next batch, or part of it),
  its own key-block bucket, called back to back and read each time; the engine's state is
  not advanced (the rows are rewritten with the same values)."""
  shape = engine.buckets.shape(chunks)
  return _program_ms(engine, shape, chunks, repeats)


def _program_ms(engine: Engine, shape, chunks, repeats: int = 20) -> float:
  engine.runner._program(shape)
  inputs = engine._inputs.build(chunks, engine.runner.layout(shape))
  engine.runner.dispatch(shape, inputs).read()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    engine.runner.dispatch(shape, inputs).read()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def section_overlap(model: CausalLM) -> list[list]:
  rows = []
  for batch in (1, 8):
    engine = Engine(model, num_pages=64, page_size=PAGE, max_num_seqs=8, max_step_tokens=512,
                    log_interval=None, decode_steps=1)
    rng = np.random.default_rng(batch)
    for _ in range(batch):
      engine.add_request(rng.integers(0, 256, 64).tolist(), SamplingParams(max_tokens=200))
    for _ in range(8):  # prefill and the first decodes (compiles)
      engine.step()
    device = _device_ms(engine, engine.scheduler.schedule().chunks)
    before = dataclasses.replace(engine.stats)
    wall = []
    for _ in range(64):
      t0 = time.perf_counter()
      engine.step()
      wall.append(time.perf_counter() - t0)
    host = (engine.stats.host_s - before.host_s) / 64 * 1e3
    wall_ms = statistics.median(wall) * 1e3
    rows.append([batch, f"{wall_ms:.3f}", f"{device:.3f}", f"{host:.3f}",
                 f"{wall_ms / max(host, device):.2f}x",
                 "met" if wall_ms <= 1.1 * max(host, device) else "missed"])
  return rows


def section_ragged(model: CausalLM) -> list[list]:
  engine = Engine(model, num_pages=128, page_size=PAGE, max_num_seqs=32, max_step_tokens=512,
                  log_interval=None, decode_steps=1)
  rng = np.random.default_rng(0)
  engine.add_request(rng.integers(0, 256, 4000).tolist(), SamplingParams(max_tokens=64))
  for _ in range(16):
    engine.add_request(rng.integers(0, 256, 16).tolist(), SamplingParams(max_tokens=64))
  while any(s.num_output == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
    engine.step()
  engine.step()  # the step in flight read: the next batch is every sequence's decode
  chunks = engine.scheduler.schedule().chunks
  long = [c for c in chunks if c.num_cached > 1000]
  short = [c for c in chunks if c.num_cached < 1000]
  together = _device_ms(engine, chunks)
  apart = _device_ms(engine, long) + _device_ms(engine, short)
  covering = _program_ms(engine, engine.buckets.covering(engine.buckets.shape(chunks)), chunks)
  return [[len(long), len(short), f"{together:.2f}", f"{apart:.2f}",
           f"{together / apart:.2f}x", f"{covering:.2f}", f"{covering / apart:.2f}x",
           "met" if together <= 1.3 * apart else "missed"]]


def table(header, rows):
  print("| " + " | ".join(header) + " |")
  print("|---" * len(header) + "|")
  for row in rows:
    print("| " + " | ".join(map(str, row)) + " |")
  print(flush=True)


SECTIONS = ("host", "overlap", "ragged")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of {','.join(SECTIONS)}")
  sections = [s.strip() for s in parser.parse_args(argv).sections.split(",") if s.strip()]
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown or not sections:
    parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
  model = real_model() if {"overlap", "ragged"} & set(sections) else None
  print("# Engine steps (XLA:CPU)\n")
  if "host" in sections:
    print("## 1. Host time a step, the device stubbed out (ms)\n")
    table(["running", "prompt tokens", "decode steps a dispatch", "ms a dispatch (p50)",
           "mean", "ms a step", "goal", ""], section_host())
  if "overlap" in sections:
    print("## 2. Wall time a step against the host's and the device's alone (ms, tiny)\n")
    table(["batch", "wall", "device alone", "host", "wall / max", "goal <= 1.1x"],
          section_overlap(model))
  if "ragged" in sections:
    print("## 3. One long row beside short ones: the step program's ms (tiny)\n")
    table(["long rows (4K)", "short rows (16)", "together", "apart", "together / apart",
           "covering (rows x longest)", "covering / apart", "goal <= 1.3x"],
          section_ragged(model))


if __name__ == "__main__":
  main()
