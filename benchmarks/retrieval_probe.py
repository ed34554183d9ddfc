"""The boundary-length retrieval probe: lookup accuracy against prompt length around top-k.

    python benchmarks/retrieval_probe.py                 # the shipped recall model
    python benchmarks/retrieval_probe.py --per-length 16 --checkpoint DIR

For the trained ``recall`` model loaded three ways (the dense-capable class, the MQA-only
class, and the MQA-only class with the deliberately misrouted layer of
``mla_jax.misrouted``), greedy single-query lookups decoded by ``mla_jax.generate`` at 19
prompt lengths from top-k / 2 to 8 x top-k. A correct engine gives the two honest classes the
same answer at every length; the misrouted layer skips indexer scoring for prompts up to
top-k tokens and attends to nothing there.

It also measures the indexer's quality: the share of each layer's main attention that its
top-k captures, for the trained indexer and for the indexer at initialisation (the weights it
had before the warm-up stage: the dense stages give it no gradient).
"""

from __future__ import annotations

import argparse
import logging
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import presets, testing
from mla_jax.checkpoints import load_pretrained
from mla_jax.misrouted import MisroutedV32Attention
from mla_jax.models.lm import CausalLM
from mla_jax.training.data import LookupTask, tokenizer
from mla_jax.training.recipes import get_recipe

MODELS = ("dense-capable", "mqa-only", "misrouted")


def probe_lengths(topk: int, count: int = 19) -> list[int]:
  """``count`` prompt lengths from top-k / 2 to 8 x top-k, densest around top-k."""
  low, high = topk // 2, 8 * topk
  near = list(range(topk - 2, topk + 3))  # both sides of the boundary, one token apart
  spread = np.geomspace(low, high, count - len(near) + 2).round().astype(int).tolist()
  lengths = sorted(set(near) | set(spread))
  while len(lengths) > count:  # drop the spread point closest to a neighbour
    gaps = [b - a for a, b in zip(lengths, lengths[1:])]
    i = min((i for i in range(1, len(lengths) - 1) if lengths[i] not in near),
            key=lambda i: gaps[i - 1] + gaps[i])
    lengths.pop(i)
  return lengths


def load_models(checkpoint) -> dict[str, CausalLM]:
  """The checkpoint as each of ``MODELS`` (float32, XLA backend), sharing its weights."""
  models = {kind: load_pretrained(checkpoint, dtype=jnp.float32, attention=kind, backend="xla")
            for kind in ("dense-capable", "mqa-only")}
  honest = models["mqa-only"]
  misrouted = CausalLM(honest.config, rngs=nnx.Rngs(0), backend="xla",
                       attention_class=MisroutedV32Attention)
  nnx.update(misrouted, nnx.state(honest, nnx.Param))
  models["misrouted"] = misrouted
  return models


def probe_examples(task: LookupTask, length: int, count: int, seed: int):
  """``count`` single-query lookups whose prompts (BOS included) hold ``length`` tokens."""
  single = LookupTask(min_len=task.min_len, max_len=max(task.max_len, length + 1),
                      key_len=task.key_len, max_pairs=task.max_pairs, max_queries=1)
  rng = np.random.default_rng([seed, length])
  return [single.example(rng, length + 1) for _ in range(count)]  # + 1: the answer


def answers(model: CausalLM, examples) -> list[int]:
  """The greedy first token ``mla_jax.generate`` emits after each example's prompt."""
  from mla_jax.generation import generate

  prompts = [tokenizer.encode(e.prompt()[0]) for e in examples]
  return [t[0] for t in generate(model, prompts, 1).tokens]


def accuracy_by_length(models: dict[str, CausalLM], task: LookupTask, lengths,
                       per_length: int, seed: int = 0):
  """Greedy lookup accuracy of every model at every prompt length, on the same prompts.

  Returns ``(accuracy, agreement)``: ``{model: {length: accuracy}}`` and, per length, the
  share of prompts on which the dense-capable and MQA-only models give the same token.
  """
  accuracy, agreement = {name: {} for name in models}, {}
  for n in lengths:
    examples = probe_examples(task, n, per_length, seed)
    expected = [tokenizer.encode(e.prompt()[1])[-1] for e in examples]
    got = {name: answers(model, examples) for name, model in models.items()}
    for name in models:
      accuracy[name][n] = float(np.mean([a == b for a, b in zip(got[name], expected)]))
    agreement[n] = float(np.mean([a == b for a, b in zip(got["dense-capable"],
                                                          got["mqa-only"])]))
  return accuracy, agreement


def layer_inputs(model: CausalLM, ids: list[int]) -> list[np.ndarray]:
  """Each layer's attention input (after its input norm) for one prompt, as float64 [T, D]."""
  ids_BT = jnp.asarray([ids], jnp.int32)
  caches = model.init_cache(1, len(ids))
  h_BTD = model.model.embed_tokens(ids_BT)
  plan = model.step_plan(len(ids), 0, capacity=len(ids), force_mqa=True)
  inputs = []
  for i in range(model.config.num_layers):
    layer = model.layer_module(i)
    inputs.append(np.asarray(layer.input_layernorm(h_BTD)[0], np.float64))
    h_BTD, _, _ = layer(h_BTD, caches.layer(i), plan)
  return inputs


def indexer_capture(model: CausalLM, indexer_params: list[dict] | None, task: LookupTask,
                    lengths, per_length: int, seed: int = 0) -> dict[int, dict[int, float]]:
  """Mean share of main attention on the indexer's top-k, ``{layer: {length: share}}``.

  Queries whose causal keys all fit the top-k capture everything, so only queries past
  top-k count. ``indexer_params`` (one dict per layer, ``testing.numpy_params`` names)
  replace the model's indexer weights, e.g. the ones it had before the warm-up.
  """
  topk = model.config.mla.indexer.topk
  result = {i: {} for i in range(model.config.num_layers)}
  for n in [n for n in lengths if n > topk]:
    shares = {i: [] for i in result}
    for e in probe_examples(task, n, per_length, seed):
      inputs = layer_inputs(model, tokenizer.encode(e.prompt()[0]))
      for i, x_TD in enumerate(inputs):
        params = testing.numpy_params(model.layer_module(i).self_attn)
        if indexer_params is not None:
          params.update(indexer_params[i])
        shares[i].extend(testing.indexer_capture_reference(params, model.config.mla, x_TD)[topk:])
    for i in result:
      result[i][n] = float(np.mean(shares[i]))
  return result


def initial_indexer_params(model: CausalLM, seed: int) -> list[dict]:
  """The indexer weights the recipe's model had at initialisation, per layer."""
  fresh = CausalLM(model.config, rngs=nnx.Rngs(seed), backend="xla")
  return [{k: v for k, v in testing.numpy_params(fresh.layer_module(i).self_attn).items()
           if k.startswith("indexer.")} for i in range(model.config.num_layers)]


def format_accuracy(acc: dict[str, dict[int, float]], topk: int) -> str:
  lengths = list(next(iter(acc.values())))
  lines = ["| prompt length | " + " | ".join(acc) + " |", "|---" * (len(acc) + 1) + "|"]
  for n in lengths:
    mark = " (<= top-k)" if n <= topk else ""
    lines.append(f"| {n}{mark} | " + " | ".join(f"{acc[m][n]:.2f}" for m in acc) + " |")
  return "\n".join(lines)


def format_capture(before, after) -> str:
  lines = ["| layer | prompt length | capture, indexer at init | capture, trained indexer |",
           "|---|---|---|---|"]
  for i in after:
    for n in after[i]:
      lines.append(f"| {i} | {n} | {before[i][n]:.3f} | {after[i][n]:.3f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", default=None,
                      help="default: the shipped recall model (mla_jax/presets/recall)")
  parser.add_argument("--per-length", type=int, default=32, help="prompts per length")
  parser.add_argument("--capture-per-length", type=int, default=4,
                      help="prompts per length for the indexer capture (float64, slow)")
  args = parser.parse_args(argv)
  logging.getLogger("mla_jax").setLevel(logging.ERROR)
  recipe = get_recipe("recall")
  checkpoint = args.checkpoint or presets.RECALL_CHECKPOINT
  t0 = time.perf_counter()
  models = load_models(checkpoint)
  topk = models["mqa-only"].config.mla.indexer.topk
  lengths = probe_lengths(topk)
  acc, agreement = accuracy_by_length(models, recipe.task, lengths, args.per_length)
  print(f"recall model ({checkpoint}), top-k {topk}, {args.per_length} prompts per length")
  print(format_accuracy(acc, topk))
  print(f"dense-capable and MQA-only agree on {min(agreement.values()):.0%} of the answers at "
        "every length (the lowest share over lengths)")
  model = models["mqa-only"]
  capture_lengths = [n for n in lengths if n > topk][::3]
  before = indexer_capture(model, initial_indexer_params(model, recipe.seed), recipe.task,
                           capture_lengths, args.capture_per_length)
  after = indexer_capture(model, None, recipe.task, capture_lengths, args.capture_per_length)
  print("\nshare of main attention on the indexer's top-k (queries past top-k):")
  print(format_capture(before, after))
  print(f"\nprobe ran in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
