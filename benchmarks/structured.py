"""Structured outputs: decode tokens/s of constrained rows against unconstrained ones.

    python benchmarks/structured.py                       # tiny preset, batch 8 (~2 minutes)
    python benchmarks/structured.py --preset recall --batch 1 8

b prompts of 32 random byte tokens at once, 128 new tokens each, through an engine (8 decode
steps per dispatch, as ``mla-jax serve``'s, a step budget of 64 tokens, structured outputs on)
with the byte tokenizer and no end-of-sequence id. Decode tokens/s: every token after each request's first,
over the time after the last first token. Rows:

- ``plain``: unconstrained greedy rows (multi-step decode dispatches, asynchronous).
- ``plain, one step``: the same through an engine of one decode step per dispatch.
- ``plain, FULL``: unconstrained rows asking for log-probabilities (one step per dispatch,
  the ``FULL`` program, asynchronous): what a constrained row pays for its program alone.
- ``json schema``: rows under a JSON schema (an array of at least 100 digits, so no row
  completes before its 128 tokens): the masked ``FULL`` program, one step per dispatch, each
  step read before the next is dispatched, a mask computed per token on the host.
- ``json schema, half``: half the rows constrained, half plain, in the same steps.

Also the host's mask time per constrained token (``Guide.advance``: the matcher consumes the
token and computes the next mask). XLA:CPU on this machine, shared and noisy: compare ratios
within a run. The figures are each row's best of two runs after one that compiled (and the
background compiles it started, waited for).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.serving import build_model  # noqa: E402
from mla_jax import presets  # noqa: E402
from mla_jax.checkpoints import load_pretrained  # noqa: E402
from mla_jax.serving import constraints  # noqa: E402
from mla_jax.serving.constraints import Constraint  # noqa: E402
from mla_jax.serving.engine import Engine  # noqa: E402
from mla_jax.serving.sequence import SamplingParams  # noqa: E402
from mla_jax.tokenizer import ByteTokenizer  # noqa: E402

PROMPT, NEW = 32, 128
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 100}


def _model(preset: str):
  if preset == "recall":
    return load_pretrained(presets.RECALL_CHECKPOINT, dtype=jnp.float32, backend="xla")
  return build_model(preset, 0)


def decode_rate(engine: Engine, prompts, params) -> tuple[float, float]:
  """(decode tokens/s, host mask seconds per constrained token) of one run."""
  mask_s, masked = [0.0], [0]
  advance = constraints.Guide.advance

  def timed(guide, token):
    t0 = time.perf_counter()
    out = advance(guide, token)
    mask_s[0] += time.perf_counter() - t0
    masked[0] += 1
    return out

  constraints.Guide.advance = timed
  try:
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    start = time.perf_counter()
    first, count = {}, 0
    while engine.has_unfinished():
      for update in engine.step():
        now = time.perf_counter() - start
        first.setdefault(update.request_id, now)
        count += len(update.new_tokens)
    elapsed = time.perf_counter() - start
    for i in ids:
      engine.release(i)
  finally:
    constraints.Guide.advance = advance
  decoded = count - len(prompts)
  return decoded / (elapsed - max(first.values())), mask_s[0] / max(masked[0], 1)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="tiny", help="tiny (random weights) or recall")
  parser.add_argument("--batch", type=int, nargs="+", default=[8])
  args = parser.parse_args()
  model = _model(args.preset)
  tok = ByteTokenizer()
  settings = dict(num_pages=96, page_size=64, max_num_seqs=max(args.batch), max_step_tokens=64,
                  tokenizer=tok, structured_outputs=True, log_interval=None)
  engine = Engine(model, **settings)
  one_step = Engine(model, decode_steps=1, **settings)  # shares the one-step programs
  engine.warmup()
  json_schema = Constraint.json_schema(SCHEMA)
  plain = lambda i: SamplingParams(max_tokens=NEW)
  kinds = {
      "plain": plain,
      "plain, one step": plain,
      "plain, FULL": lambda i: SamplingParams(max_tokens=NEW, logprobs=0),
      "json schema": lambda i: SamplingParams(max_tokens=NEW, constraint=json_schema),
      "json schema, half": lambda i: SamplingParams(
          max_tokens=NEW, constraint=json_schema if i % 2 else None),
  }
  rng = np.random.default_rng(0)
  print(f"preset {args.preset}, {PROMPT}-token prompts, {NEW} new tokens, XLA:CPU")
  print("| batch | rows | decode tok/s | / plain | host mask ms per constrained token |")
  print("|---|---|---|---|---|")
  for b in args.batch:
    prompts = rng.integers(0, 256, (b, PROMPT)).tolist()
    rates = {}
    for name, make in kinds.items():
      params = [make(i) for i in range(b)]
      runner = one_step if name == "plain, one step" else engine
      decode_rate(runner, prompts, params)  # compiles what it needs
      runner.runner.wait_for_compiles()  # its own key-block buckets, compiled in background
      rates[name] = max(decode_rate(runner, prompts, params) for _ in range(2))
    for name, (rate, mask_s) in rates.items():
      mask = f"{mask_s * 1e3:.3f}" if "json" in name else "–"
      print(f"| {b} | {name} | {rate:.0f} | {rate / rates['plain'][0]:.2f}x | {mask} |")


if __name__ == "__main__":
  main()
