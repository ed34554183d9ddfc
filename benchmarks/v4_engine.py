"""DeepSeek-V4 in the engine against ``mla_jax.generate``, and its prefix cache (issue 48).

    python benchmarks/v4_engine.py            # both tables (a few minutes, CPU)

1. Static batch: 8 prompts of 64 tokens, 32 new tokens each, greedy, on the tiny V4 model
   (every layer type): ``mla_jax.generate`` against ``Engine.generate`` (pages of 16, a 512-
   token step budget, 8 decode steps a dispatch), each warmed by one identical run first.
   Goal: engine / generate >= 1x in tokens per second.
2. Shared prefix: a 512-token prefix plus 16 distinct tokens, 8 new tokens; an engine serves
   one such request (which saves the prefix's pages and state snapshots), then the time to
   first token of another, with prefix caching on and off. Goal: >= 3x lower with it.

XLA:CPU on this machine, one run, median of 3; compare ratios within a table.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mla_jax.generation import generate  # noqa: E402
from mla_jax.serving import Engine  # noqa: E402
from mla_jax.v4.config import tiny_v4_config  # noqa: E402
from mla_jax.v4.model import V4CausalLM  # noqa: E402

ENGINE = dict(page_size=16, max_num_seqs=8, max_step_tokens=512, max_model_len=640,
              log_interval=None)


def _median_seconds(run, repeats: int = 3) -> float:
  run()  # warm: every program compiled
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def static_batch(model) -> None:
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, 256, (8, 64)).tolist()
  new = 32
  engine = Engine(model, num_pages=8 * 6, decode_steps=8, **ENGINE)
  want = generate(model, prompts, new).tokens
  assert [list(o.tokens) for o in engine.generate(prompts, max_tokens=new)] == want
  t_gen = _median_seconds(lambda: generate(model, prompts, new))
  t_eng = _median_seconds(lambda: engine.generate(prompts, max_tokens=new))
  tokens = 8 * new
  print("| static batch of 8 x 64 tokens, 32 new | tokens/s | vs generate |")
  print("|---|---|---|")
  print(f"| mla_jax.generate | {tokens / t_gen:.0f} | 1.00x |")
  print(f"| Engine.generate | {tokens / t_eng:.0f} | {t_gen / t_eng:.2f}x |")


def shared_prefix(model) -> None:
  rng = np.random.default_rng(1)
  prefix = rng.integers(0, 256, 512).tolist()
  ttft = {}
  for caching in (False, True):
    engine = Engine(model, num_pages=128, prefix_caching=caching, **ENGINE)
    times = []
    for i in range(4):  # the first computes the prefix (and compiles); the rest are timed
      prompt = prefix + rng.integers(0, 256, 16).tolist()
      out = engine.generate([prompt], max_tokens=8)[0]
      if i:
        times.append(out.ttft)
    ttft[caching] = statistics.median(times)
  print("\n| 512-token shared prefix + 16 | TTFT (ms) | vs no cache |")
  print("|---|---|---|")
  print(f"| prefix caching off | {ttft[False] * 1e3:.1f} | 1.00x |")
  print(f"| prefix caching on | {ttft[True] * 1e3:.1f} | {ttft[False] / ttft[True]:.2f}x lower |")


def main() -> None:
  model = V4CausalLM(tiny_v4_config(), rngs=nnx.Rngs(0), backend="xla")
  static_batch(model)
  shared_prefix(model)


if __name__ == "__main__":
  main()
