"""The three prefill routes of one MLA layer, side by side, as a markdown table.

    python benchmarks/routes.py                      # small_lm().mla (top-k 64), XLA:CPU
    python benchmarks/routes.py --config tiny        # tiny preset (top-k 16)
    python benchmarks/routes.py --lengths 64,512,1024 --repeats 7

Per prompt length and route: FLOPs and bytes from XLA's ``cost_analysis()`` of the compiled
layer, the analytic attention FLOPs (docs/design.md §2), and the median wall time of
``--repeats`` calls (one warm-up excluded; routes interleaved in one run; each call ended by
``block_until_ready``). Ratios are route / sparse MQA. Past ``index_topk`` the library never
runs dense MHA (it would not be exact), so the dense rows there are the same layer built
without an indexer: plain causal MLA. The masked route exists only past top-k, and is measured
past the backend's ``masked_mha_max_tokens`` too: where it stops paying is what this finds. The
shared implementation lives in ``route_measurements.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import mla_jax as m  # noqa: E402
from benchmarks import route_measurements as rm  # noqa: E402
from mla_jax.backends.pallas import PallasTritonBackend  # noqa: E402
from mla_jax.models.config import small_lm, tiny_lm  # noqa: E402

CONFIGS = {"tiny": lambda: tiny_lm().mla, "small": lambda: small_lm().mla}
MHA_ROUTES = ("dense_mha", "masked_mha")


def default_lengths(topk: int) -> list[int]:
  """A geometric range from topk/4 to 32*topk (powers of two around top-k)."""
  return [topk * 2**e // 4 for e in range(0, 8)]


def _ratio(num: float, den: float) -> str:
  return f"{num / den:.2f}" if den == den and num == num and den else "n/a"  # NaN: no route


def markdown_table(rows: list[dict], timing: bool) -> str:
  head = ["L", "route", "module", "XLA FLOPs", "XLA bytes", "analytic FLOPs"]
  if timing:
    head.append("median ms")
  head += ["FLOPs / sparse", "bytes / sparse"] + (["time / sparse"] if timing else [])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in rows:
    for route in rm.ROUTES:
      if row[f"{route}_module"] is None:
        continue
      cells = [str(row["length"]), route, row[f"{route}_module"],
               rm.format_si(row[f"{route}_flops"]), rm.format_si(row[f"{route}_bytes"], "B"),
               rm.format_si(row[f"{route}_analytic"])]
      if timing:
        cells.append(f"{row[f'{route}_s'] * 1e3:.3f}")
      for key in ("flops", "bytes") + (("s",) if timing else ()):
        cells.append(_ratio(row[f"{route}_{key}"], row[f"sparse_mqa_{key}"]))
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def analytic_lines(config: m.MLAConfig, name: str) -> list[str]:
  """Where the cost model and the kernels' declared costs put sparse MQA ahead."""
  out = []
  for label, cfg in ((f"{name} config", config), ("DeepSeek-V3.2 dims", m.deepseek_v32()),
                     ("GLM-5 dims", m.glm5())):
    for route in MHA_ROUTES:
      spec = rm.analytic_crossover(cfg, mha_route=route)
      full = rm.analytic_crossover(cfg, mha_route=route, include_absorption=True)
      out.append(f"- cost model, {label} (top-k {cfg.indexer.topk}): sparse MQA cheaper than "
                 f"{route} from L = {spec} (design.md §2), L = {full} (adding the MQA "
                 f"absorption 2AH(N+V) per query)")
    out.append(f"- kernels' declared FLOPs, {label}: sparse_mqa_attention below "
               f"masked_mha_prefill from L = {rm.kernel_estimate_crossover(cfg)}")
  return out


def measured_lines(name: str, rows: list[dict], timing: bool) -> list[str]:
  lengths = [r["length"] for r in rows]
  out = []
  for key, what in (("flops", "XLA FLOPs"), ("bytes", "XLA bytes")) + (
      (("s", "CPU wall time"),) if timing else ()):
    for route in MHA_ROUTES:
      out.append(f"- measured {what}, {name}, {route} vs sparse_mqa: " + rm.measured_crossover(
          lengths, [r[f"{route}_{key}"] for r in rows], [r[f"sparse_mqa_{key}"] for r in rows],
          mha_label=route.split("_")[0]))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
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
  timing = not args.no_timing
  rows = rm.measure_routes(layers, lengths, repeats=args.repeats, seed=args.seed, timing=timing)
  print(f"## Prefill routes, `{args.config}` config (H={config.num_heads}, A={config.kv_lora_rank}, "
        f"top-k {topk}), {jax.devices()[0].platform.upper()}, XlaBackend, float32, batch 1\n")
  print(markdown_table(rows, timing))
  print()
  print("\n".join(analytic_lines(config, args.config) + measured_lines(args.config, rows, timing)))
  print(f"- thresholds in use: XlaBackend masked_mha_max_tokens = "
        f"{m.XlaBackend().masked_mha_max_tokens} (measured on 2-core XLA:CPU, small config), "
        f"PallasTritonBackend = {PallasTritonBackend().masked_mha_max_tokens} (from the kernels' "
        "declared costs, to be tuned on a GPU)")
  print(f"\nRatios are this route / sparse MQA. Dense rows past top-k ({topk}) use MLAAttention "
        "without an indexer (the library never runs dense MHA there); masked rows exist only "
        "past top-k.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
