"""Dense-MHA vs sparse-MQA prefill of one MLA layer, side by side, as a markdown table.

    python benchmarks/routes.py                      # tiny preset (top-k 16)
    python benchmarks/routes.py --config small       # small_lm().mla (top-k 64)
    python benchmarks/routes.py --lengths 8,64,512 --repeats 7

Per prompt length and route: FLOPs and bytes from XLA's ``cost_analysis()`` of the compiled
layer, the analytic attention FLOPs (docs/design.md §2), and the median wall time of
``--repeats`` calls (one warm-up excluded; routes interleaved in one run; each call ended by
``block_until_ready``). Ratios are sparse / dense. Past ``index_topk`` the library never runs
dense MHA (it would not be exact), so the dense column there is the same layer built without
an indexer: plain causal MLA. The shared implementation lives in ``route_measurements.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import mla_jax as m  # noqa: E402
from benchmarks import route_measurements as rm  # noqa: E402
from mla_jax.models.config import small_lm, tiny_lm  # noqa: E402

CONFIGS = {"tiny": lambda: tiny_lm().mla, "small": lambda: small_lm().mla}


def default_lengths(topk: int) -> list[int]:
  """A geometric range from topk/4 to 16*topk (powers of two around top-k)."""
  return [topk * 2**e // 4 for e in range(0, 7)]


def _ratio(num: float, den: float) -> str:
  return f"{num / den:.2f}" if den else "n/a"


def markdown_table(rows: list[dict], timing: bool) -> str:
  head = ["L", "route", "module", "XLA FLOPs", "XLA bytes", "analytic FLOPs"]
  if timing:
    head.append("median ms")
  head += ["FLOPs / other", "bytes / other"] + (["time / other"] if timing else [])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in rows:
    for route, other in (("dense_mha", "sparse_mqa"), ("sparse_mqa", "dense_mha")):
      cells = [str(row["length"]), route, row[f"{route}_module"],
               rm.format_si(row[f"{route}_flops"]), rm.format_si(row[f"{route}_bytes"], "B"),
               rm.format_si(row[f"{route}_analytic"])]
      if timing:
        cells.append(f"{row[f'{route}_s'] * 1e3:.3f}")
      cells += [_ratio(row[f"{route}_flops"], row[f"{other}_flops"]),
                _ratio(row[f"{route}_bytes"], row[f"{other}_bytes"])]
      if timing:
        cells.append(_ratio(row[f"{route}_s"], row[f"{other}_s"]))
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def crossover_lines(config: m.MLAConfig, name: str, rows: list[dict], timing: bool) -> list[str]:
  lengths = [r["length"] for r in rows]
  out = []
  for label, cfg in ((f"{name} config", config), ("DeepSeek-V3.2 dims", m.deepseek_v32()),
                     ("GLM-5 dims", m.glm5())):
    spec = rm.analytic_crossover(cfg)
    full = rm.analytic_crossover(cfg, include_absorption=True)
    out.append(f"- analytic crossover, {label} (top-k {cfg.indexer.topk}): sparse MQA cheaper "
               f"from L = {spec} (design.md §2 cost model), L = {full} (adding the MQA absorption "
               f"2AH(N+V) per query)")
  out.append(f"- measured XLA FLOPs crossover, {name}: " + rm.measured_crossover(
      lengths, [r["dense_mha_flops"] for r in rows], [r["sparse_mqa_flops"] for r in rows]))
  out.append(f"- measured XLA bytes crossover, {name}: " + rm.measured_crossover(
      lengths, [r["dense_mha_bytes"] for r in rows], [r["sparse_mqa_bytes"] for r in rows]))
  if timing:
    out.append(f"- measured CPU wall-time crossover, {name}: " + rm.measured_crossover(
        lengths, [r["dense_mha_s"] for r in rows], [r["sparse_mqa_s"] for r in rows]))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
  parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",") if x],
                      default=None, help="comma-separated prompt lengths (default: around top-k)")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls per route and length")
  parser.add_argument("--no-timing", action="store_true", help="cost analysis only")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  config = CONFIGS[args.config]()
  topk = config.indexer.topk
  lengths = args.lengths or default_lengths(topk)
  if any(n < 1 for n in lengths):
    parser.error("lengths must be positive")
  layers = rm.build_route_layers(config, seed=args.seed)
  rows = rm.measure_routes(layers, lengths, repeats=args.repeats, seed=args.seed,
                           timing=not args.no_timing)
  timing = not args.no_timing
  print(f"## Prefill routes, `{args.config}` config (H={config.num_heads}, A={config.kv_lora_rank}, "
        f"top-k {topk}), {jax.devices()[0].platform.upper()}, XlaBackend, float32, batch 1\n")
  print(markdown_table(rows, timing))
  print()
  print("\n".join(crossover_lines(config, args.config, rows, timing)))
  print(f"\nRatios are this route / the other route. Dense rows past top-k ({topk}) use "
        "MLAAttention without an indexer (the library never runs dense MHA there).")
  return 0


if __name__ == "__main__":
  sys.exit(main())
