"""Trains a named recipe from its seed and reports what a model card needs.

    python benchmarks/train_recipe.py --recipe recall --out runs/recall     # the shipped weights
    python benchmarks/train_recipe.py --recipe smoke --out /tmp/smoke --seed 1

Writes ``OUT/checkpoint`` (``save_pretrained`` format), ``OUT/history.json`` (every step's
losses, seconds and tokens; every evaluation) and ``OUT/report.json``: per stage the steps,
median step time, tokens/s (steps that compiled excluded) and first/last losses; the final
teacher-forced accuracy by width; and ``mla_jax.generate`` accuracy on single-query prompts
by prompt length for both attention classes. The same seed on the same software stack gives
the same weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from mla_jax.checkpoints import load_pretrained
from mla_jax.models.config import ATTENTION_KINDS
from mla_jax.training.data import LookupTask, generation_accuracy
from mla_jax.training.recipes import RECIPES, get_recipe, run_recipe


def stage_summary(history: list[dict], stage: str) -> dict:
  rows = [row for row in history if row["stage"] == stage]
  seen, timed = set(), []
  for row in rows:  # the first step of each width compiles
    if row["width"] in seen:
      timed.append(row)
    seen.add(row["width"])
  losses = [row["loss"] for row in rows]
  return {"steps": len(rows), "seconds": sum(row["seconds"] for row in rows),
          "median_step_ms": 1000 * statistics.median(row["seconds"] for row in timed),
          "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["seconds"] for r in timed),
          "loss_first10": float(np.mean(losses[:10])), "loss_last10": float(np.mean(losses[-10:]))}


def generation_by_length(checkpoint: Path, task: LookupTask, lengths, per_length: int) -> dict:
  """Greedy single-query lookups (no earlier query to copy from) per prompt length."""
  single = LookupTask(min_len=task.min_len, max_len=max(lengths), key_len=task.key_len,
                      max_pairs=task.max_pairs, max_queries=1)
  result = {}
  for attention in ATTENTION_KINDS:
    model = load_pretrained(checkpoint, dtype=jnp.float32, attention=attention, backend="xla")
    result[attention] = {}
    for n in lengths:
      rng = np.random.default_rng([n, 1])
      examples = [single.example(rng, n) for _ in range(per_length)]
      result[attention][n] = generation_accuracy(model, examples, batch_size=per_length)
  return result


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--recipe", choices=sorted(RECIPES), default="recall")
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--seed", type=int, default=None, help="default: the recipe's seed")
  parser.add_argument("--per-length", type=int, default=64,
                      help="single-query prompts per length for the generation check")
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.ERROR)

  recipe = get_recipe(args.recipe)
  start = time.perf_counter()
  trainer = run_recipe(recipe, out_dir=args.out, seed=args.seed, progress=not args.quiet)
  wall_s = time.perf_counter() - start
  topk = recipe.model.mla.indexer.topk
  lengths = sorted({recipe.task.min_len, topk // 2, topk, topk + 1, 2 * topk, 4 * topk,
                    recipe.task.max_len, 2 * recipe.task.max_len} - {0})
  lengths = [n for n in lengths if n >= recipe.task.min_len]
  report = {
      "recipe": recipe.name, "seed": recipe.seed if args.seed is None else args.seed,
      "wall_s": wall_s,
      "stages": {stage.name: stage_summary(trainer.history, stage.name)
                 for stage, _ in recipe.stages},
      "final_evaluation": trainer.evaluations[-1],
      "generation_accuracy": generation_by_length(Path(trainer.checkpoint["path"]), recipe.task,
                                                  lengths, args.per_length),
  }
  (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
