"""Trains the shipped ``recall`` model's MTP head (main model frozen) and measures it.

    python benchmarks/train_mtp.py --out runs/recall_mtp           # train and report
    python benchmarks/train_mtp.py --out runs/recall_mtp --ship    # and write it into the preset

Starts from the shipped main weights (``load_pretrained(RECALL_CHECKPOINT, mtp=False)``),
adds one MTP layer and runs ``recipes.recall_mtp()`` (``run_mtp_recipe``): the head learns
the model's own greedy continuations of seeded lookup and copy prompts. Writes
``OUT/checkpoint`` (``save_pretrained``, MTP layer as ``model.layers.2``), ``OUT/history.json``
and ``OUT/report.json``: the stage's time and losses and the teacher-forced k = 1 acceptance
(``data.draft_acceptance``) on held-out continuations of each prompt kind. ``--ship`` copies
``config.json`` and ``model.safetensors`` into ``mla_jax/presets/recall`` after checking that
every main tensor is bitwise the shipped one. The same seed on the same stack gives the same
head.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from mla_jax.checkpoints import load_pretrained
from mla_jax.presets import RECALL_CHECKPOINT
from mla_jax.training import recipes
from mla_jax.training.data import draft_acceptance

MAIN_LAYERS = 2  # the recall model's; its MTP layer is model.layers.2


def acceptance_by_kind(model, recipe: recipes.MTPRecipe, main_model, seed: int,
                       new_tokens: int) -> dict:
  """k = 1 acceptance on held-out continuations (``new_tokens`` long) of lookup prompts
  (8-128 tokens), copy prompts, and the recipe's mix."""
  result = {}
  for kind, fraction in (("lookup", 0.0), ("copy", 1.0)):
    held_out = dataclasses.replace(recipe, copy_fraction=fraction, new_tokens=new_tokens)
    data = recipes.mtp_data(held_out, main_model, seed, eval=True)
    accepted, proposed = draft_acceptance(model, data)
    result[kind] = {"accepted": accepted, "proposed": proposed,
                    "acceptance": accepted / proposed}
  accepted, proposed = (sum(r[k] for r in result.values()) for k in ("accepted", "proposed"))
  result["all"] = {"accepted": accepted, "proposed": proposed, "acceptance": accepted / proposed}
  return result


def raw_tensors(path: Path) -> dict[str, tuple]:
  """name -> (dtype, shape, bytes) of a safetensors file, read straight from its layout."""
  data = path.read_bytes()
  size = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + size])
  return {name: (e["dtype"], e["shape"], data[8 + size + e["data_offsets"][0]:
                                             8 + size + e["data_offsets"][1]])
          for name, e in header.items() if name != "__metadata__"}


def check_main_unchanged(checkpoint: Path) -> int:
  """Every main tensor of the shipped file is in ``checkpoint`` byte for byte; returns how
  many there are."""
  shipped = {name: t for name, t in raw_tensors(RECALL_CHECKPOINT / "model.safetensors").items()
             if not name.startswith(f"model.layers.{MAIN_LAYERS}.")}  # a shipped head: replaced
  new = raw_tensors(checkpoint / "model.safetensors")
  for name, tensor in shipped.items():
    if new.get(name) != tensor:
      raise AssertionError(f"main tensor {name} differs from the shipped one")
  return len(shipped)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--seed", type=int, default=None, help="default: the recipe's seed")
  parser.add_argument("--ship", action="store_true",
                      help="write the head into mla_jax/presets/recall")
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.ERROR)

  recipe = recipes.recall_mtp()
  seed = recipe.seed if args.seed is None else args.seed
  main_model = load_pretrained(RECALL_CHECKPOINT, dtype=jnp.float32, mtp=False, backend="xla")
  start = time.perf_counter()
  trainer = recipes.run_mtp_recipe(recipe, main_model, out_dir=args.out, seed=seed,
                                   progress=not args.quiet)
  wall_s = time.perf_counter() - start
  steps = [row["seconds"] for row in trainer.history]
  losses = [row["lm_loss"] for row in trainer.history]
  report = {
      "seed": seed, "wall_s": wall_s, "train_s": sum(steps),
      "median_step_ms": 1000 * float(np.median(steps)),
      "loss_first10": float(np.mean(losses[:10])), "loss_last10": float(np.mean(losses[-10:])),
      "final_evaluation": trainer.evaluations[-1],
      "acceptance": {n: acceptance_by_kind(trainer.model, recipe, main_model, seed + 1, n)
                     for n in (recipe.new_tokens, 2 * recipe.new_tokens)},
  }
  checkpoint = args.out / "checkpoint"
  report["main_tensors_unchanged"] = check_main_unchanged(checkpoint)
  if args.ship:
    for name in ("config.json", "model.safetensors"):
      shutil.copyfile(checkpoint / name, RECALL_CHECKPOINT / name)
  (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
