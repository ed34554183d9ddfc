"""Union against exact top-k over a context axis, on the trained recall model.

    python benchmarks/context_modes.py [--ranks 4] [--per-length 16] [--trajectory 32]

The shipped ``recall`` model (MQA-only) served by ``Engine`` on 8 CPU host devices with its page
pools split over ``context=RANKS``: in ``exact`` mode (the global top-k, one device's tokens)
and in ``union`` mode (each rank's own top-k merged by log-sum-exp, no candidate exchange), and
on one device. For the boundary-length retrieval probe's lengths (top-k / 2 to 8 x top-k,
``benchmarks/retrieval_probe.py``) it prints each one's lookup accuracy, how often union's
answer equals exact's, and how often exact's equals one device's (it must: always). Then the
share of identical greedy tokens over ``--trajectory`` tokens after the longest prompts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("PJRT_NPROC", "32")  # see docs/scaling.md: collectives need threads
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.retrieval_probe import probe_examples, probe_lengths  # noqa: E402
from mla_jax import presets, sharding  # noqa: E402
from mla_jax.checkpoints import load_pretrained  # noqa: E402
from mla_jax.serving import Engine  # noqa: E402
from mla_jax.training.data import tokenizer  # noqa: E402
from mla_jax.training.recipes import get_recipe  # noqa: E402

PAGE = 16


def engines(ranks: int, max_len: int) -> dict[str, Engine]:
  """The recall model on one device and over ``context=ranks`` in both modes."""
  sizes = sharding.parse_mesh_spec(f"context={ranks}")
  mesh = sharding.make_mesh(sizes, jax.devices()[:math.prod(sizes.values())])
  pages = ranks * -(-4 * (max_len + PAGE) // (PAGE * ranks))  # four sequences at once
  settings = dict(num_pages=pages, page_size=PAGE, max_num_seqs=4, max_step_tokens=256,
                  max_model_len=max_len, log_interval=None)
  load = lambda mesh: load_pretrained(presets.RECALL_CHECKPOINT, dtype=jnp.float32,
                                      backend="xla", mesh=mesh)
  return {"one device": Engine(load(None), **settings),
          "exact": Engine(load(mesh), **settings, context_topk="exact"),
          "union": Engine(load(mesh), **settings, context_topk="union")}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--ranks", type=int, default=4, choices=(2, 4, 8))
  parser.add_argument("--per-length", type=int, default=16)
  parser.add_argument("--trajectory", type=int, default=32)
  args = parser.parse_args()
  recipe = get_recipe("recall")
  topk = recipe.model.mla.indexer.topk
  lengths = probe_lengths(topk)
  runs = engines(args.ranks, max(lengths) + args.trajectory + 1)
  print(f"recall model, top-k {topk}, context={args.ranks} on {jax.device_count()} CPU host "
        f"devices, {args.per_length} prompts per length\n")
  print("| prompt tokens | accuracy: one device | exact | union | union = exact | "
        "exact = one device |")
  print("|---|---|---|---|---|---|")
  for n in lengths:
    examples = probe_examples(recipe.task, n, args.per_length, seed=0)
    prompts = [tokenizer.encode(e.prompt()[0]) for e in examples]
    expected = [tokenizer.encode(e.prompt()[1])[-1] for e in examples]
    got = {name: [o.tokens[0] for o in engine.generate(prompts, max_tokens=1)]
           for name, engine in runs.items()}
    share = lambda a, b: np.mean([x == y for x, y in zip(a, b)])
    print(f"| {n} | {share(got['one device'], expected):.2f} | "
          f"{share(got['exact'], expected):.2f} | {share(got['union'], expected):.2f} | "
          f"{share(got['union'], got['exact']):.2f} | "
          f"{share(got['exact'], got['one device']):.2f} |")
  examples = probe_examples(recipe.task, max(lengths), args.per_length, seed=1)
  prompts = [tokenizer.encode(e.prompt()[0]) for e in examples]
  tokens = {name: [o.tokens for o in engine.generate(prompts, max_tokens=args.trajectory)]
            for name, engine in runs.items()}
  same = lambda a, b: np.mean([x == y for s, t in zip(a, b) for x, y in zip(s, t)])
  print(f"\ngreedy trajectories of {args.trajectory} tokens after {len(prompts)} prompts of "
        f"{max(lengths)} tokens: union = exact on {same(tokens['union'], tokens['exact']):.1%}"
        f" of tokens, exact = one device on {same(tokens['exact'], tokens['one device']):.1%}")


if __name__ == "__main__":
  main()
