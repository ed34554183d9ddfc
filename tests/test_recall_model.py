"""The shipped ``recall`` model: it loads, answers lookups as its model card says, the two
honest attention classes agree on it token for token, and the misrouted layer breaks it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import cli, presets
from mla_jax.checkpoints import load_pretrained
from mla_jax.generation import generate
from mla_jax.serving import Engine
from mla_jax.training import recipes
from mla_jax.training.data import draft_acceptance, tokenizer
from mla_jax.training.recipes import get_recipe
from benchmarks import retrieval_probe as rp

CARD = presets.RECALL_CHECKPOINT / "MODEL_CARD.md"
# One xdist worker: the module's probe fixture (about 30 s) is then built once, not per worker.


def card_threshold(name: str = "accuracy_threshold") -> float:
  found = re.search(name + r":\s*([0-9.]+)", CARD.read_text())
  assert found, f"{CARD} states no {name}"
  return float(found.group(1))


@pytest.fixture(scope="module")
def probe():
  """Accuracy per probe length up to the training length, and the honest classes' agreement.

  The prompts of all lengths up to top-k go in one ragged batch and the longer ones in
  another (two compiled programs per model instead of one per length): the routes depend on
  the padded width, which stays on the same side of top-k, and right padding changes no
  answer.
  """
  models = rp.load_models(presets.RECALL_CHECKPOINT)
  topk = models["mqa-only"].config.mla.indexer.topk
  task = get_recipe("recall").task
  lengths = [n for n in rp.probe_lengths(topk) if n <= task.max_len]
  examples = {n: rp.probe_examples(task, n, 8, seed=7) for n in lengths}
  accuracy, answers = {name: {} for name in models}, {name: {} for name in models}
  for side in ([n for n in lengths if n <= topk], [n for n in lengths if n > topk]):
    batch = [e for n in side for e in examples[n]]
    for name, model in models.items():
      got = iter(rp.answers(model, batch))
      for n in side:
        answers[name][n] = [next(got) for _ in examples[n]]
        expected = [tokenizer.encode(e.prompt()[1])[-1] for e in examples[n]]
        accuracy[name][n] = float(np.mean([a == b for a, b in zip(answers[name][n],
                                                                  expected)]))
  agreement = {n: answers["dense-capable"][n] == answers["mqa-only"][n] for n in lengths}
  return topk, lengths, accuracy, agreement


def test_probe_lengths_span_the_boundary():
  lengths = rp.probe_lengths(16)
  assert len(lengths) == 19 and lengths[0] == 8 and lengths[-1] == 128
  assert {14, 15, 16, 17, 18} <= set(lengths)


def test_accuracy_at_every_length_meets_the_model_card(probe):
  _, lengths, accuracy, _ = probe
  threshold = card_threshold()
  for kind in ("dense-capable", "mqa-only"):
    low = {n: a for n, a in accuracy[kind].items() if a < threshold}
    assert not low, f"{kind}: accuracy below the card's {threshold} at {low}"


def test_honest_classes_agree_token_for_token(probe):
  _, _, _, agreement = probe
  assert all(agreement.values()), agreement


def test_misrouted_layer_collapses_up_to_topk_only(probe):
  topk, lengths, accuracy, _ = probe
  short = [n for n in lengths if n <= topk]
  assert all(accuracy["misrouted"][n] < accuracy["mqa-only"][n] for n in short)
  assert all(accuracy["misrouted"][n] == accuracy["mqa-only"][n]
             for n in lengths if n > topk)  # past top-k it scores, like the honest class


def test_cli_preset_answers_a_lookup(capsys):
  assert cli.main(["generate", "--preset", "recall", "--prompt", "aQ ..kX zB ?k",
                   "--max-new-tokens", "1", "--quiet"]) == 0
  assert "generated text: 'X'" in capsys.readouterr().out


def test_shipped_checkpoint_loads_with_and_without_its_mtp_head():
  """``mtp=False`` (plain decoding) gets the main model alone; ``mtp=True`` the same main
  weights plus one MTP layer."""
  plain = load_pretrained(presets.RECALL_CHECKPOINT, dtype=jnp.float32, mtp=False, backend="xla")
  full = load_pretrained(presets.RECALL_CHECKPOINT, dtype=jnp.float32, backend="xla")
  assert plain.config.num_mtp_layers == 0 and len(plain.mtp) == 0
  assert full.config.num_mtp_layers == 1 and len(full.mtp) == 1
  main = nnx.state(full, nnx.Param).filter(lambda path, _: path[0] != "mtp")
  same = jax.tree.map(np.array_equal, nnx.state(plain, nnx.Param), main)
  assert all(jax.tree.leaves(same))


def test_mtp_head_acceptance_meets_the_model_card():
  """Teacher-forced k = 1 acceptance on 16 held-out prompts (lookups and copies, a seed the
  recipe never draws) continued by 32 greedy tokens."""
  model = load_pretrained(presets.RECALL_CHECKPOINT, dtype=jnp.float32, backend="xla")
  recipe = recipes.recall_mtp()
  rng = np.random.default_rng([7, 7])
  prompts = recipes.continuation_prompts(rng, 16, lookup=recipe.lookup, copy=recipe.copy)
  accepted, proposed = draft_acceptance(model, recipes.greedy_continuations(
      model, prompts, recipe.new_tokens))
  print(f"MTP acceptance {accepted}/{proposed} = {accepted / proposed:.3f}")
  assert accepted / proposed >= card_threshold("mtp_acceptance_threshold")


@pytest.fixture(scope="module")
def held_out():
  """The shipped model with its MTP head, 8 held-out prompts and their 24 greedy tokens."""
  model = load_pretrained(presets.RECALL_CHECKPOINT, dtype=jnp.float32, backend="xla")
  recipe = recipes.recall_mtp()
  prompts = recipes.continuation_prompts(np.random.default_rng([7, 7]), 8, lookup=recipe.lookup,
                                         copy=recipe.copy)
  return model, prompts, generate(model, prompts, 24).tokens


@pytest.mark.parametrize("k", [1, 2])
def test_speculative_decoding_with_the_shipped_head(held_out, k):
  """Greedy speculative decoding with the shipped head gives plain decoding's tokens and
  accepts drafts about as often as the model card says (its threshold is teacher-forced over
  every position; decoding drafts only the positions after each bonus token)."""
  model, prompts, plain = held_out
  spec = generate(model, prompts, 24, speculative_tokens=k)
  print(f"k={k}: acceptance {spec.acceptance_rate:.3f}")
  assert spec.tokens == plain
  assert spec.acceptance_rate >= card_threshold("mtp_acceptance_threshold") - 0.1 * k


def test_engine_decodes_speculatively_with_the_shipped_head(held_out):
  """The engine, each request asking for 2 drafts per step: plain decoding's tokens, and the
  drafts accepted about as often as in ``generate`` (the same threshold)."""
  model, prompts, plain = held_out
  engine = Engine(model, num_pages=64, page_size=16, max_num_seqs=8, max_step_tokens=256,
                  log_interval=None, max_speculative_tokens=2)
  outputs = engine.generate(prompts, max_tokens=24, speculative_tokens=2)
  rate = engine.stats.accepted_tokens / engine.stats.draft_tokens
  print(f"engine k=2: acceptance {rate:.3f}")
  assert [list(o.tokens) for o in outputs] == plain
  assert rate >= card_threshold("mtp_acceptance_threshold") - 0.2
