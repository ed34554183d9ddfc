"""Generation throughput per route: prefill / decode tokens/s and compile time, one table.

    python benchmarks/generate.py                 # tiny and small presets, short and long prompts
    python benchmarks/generate.py --new-tokens 64 --repeats 3

Every configuration is measured in the same run (this machine is noisy, so compare rows of
one table, not tables of different runs). Timings are medians over ``--repeats`` generations
after the compiling one; compile time is that first generation's ahead-of-time compile.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from flax import nnx

import mla_jax
from mla_jax.models.config import small_lm, tiny_lm

PRESETS = {"tiny": tiny_lm, "small": small_lm}


def measure(preset: str, attention: str, prompt_len: int, new_tokens: int, repeats: int):
  model = mla_jax.CausalLM(PRESETS[preset](attention), rngs=nnx.Rngs(0), backend="xla")
  prompt = np.random.default_rng(prompt_len).integers(0, 256, size=prompt_len).tolist()
  first = mla_jax.generate(model, [prompt], new_tokens)
  runs = [mla_jax.generate(model, [prompt], new_tokens) for _ in range(repeats)]
  return {
      "route": first.prefill_routes[0].value,
      "compile_s": first.compile_s,
      "prefill_tps": statistics.median(r.prefill_tokens_per_s for r in runs),
      "decode_tps": statistics.median(r.decode_tokens_per_s for r in runs),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  print("| preset | attention | prompt | prefill route | compile s | prefill tok/s | "
        "decode tok/s |")
  print("|---|---|---|---|---|---|---|")
  for preset in args.presets:
    topk = PRESETS[preset]().mla.indexer.topk
    for prompt_len in (topk, 4 * topk):
      for attention in ("dense-capable", "mqa-only"):
        r = measure(preset, attention, prompt_len, args.new_tokens, args.repeats)
        print(f"| {preset} | {attention} | {prompt_len} | {r['route']} | {r['compile_s']:.2f} | "
              f"{r['prefill_tps']:.0f} | {r['decode_tps']:.0f} |", flush=True)


if __name__ == "__main__":
  main()
