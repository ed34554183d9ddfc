"""Training data, the train loop (smoke run, checkpoints, bad inputs) and the train command."""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import cli
from mla_jax.checkpoints import load_pretrained
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.training import recipes
from mla_jax.training.data import (Batch, CopyTask, LookupTask, answer_hits, encode,
                                   generation_accuracy)
from mla_jax.training.train import Stage, Trainer, TrainingDiverged
from mla_jax.tokenizer import ByteTokenizer

tokenizer = ByteTokenizer()  # the lookup task's vocabulary: UTF-8 bytes and BOS/EOS/PAD


# ---- data -----------------------------------------------------------------------------------

def _pairs_and_queries(text: str):
  """Parses a lookup text independently of the generator: {key: value}, [(key, answer)]."""
  pairs, queries = {}, []
  for item in text.split(" "):
    if item.startswith("?"):
      queries.append((item[1:-1], item[-1]))
    else:
      item = item.lstrip(".")
      pairs[item[:-1]] = item[-1]
  return pairs, queries


@pytest.mark.parametrize("key_len", [1, 2])
def test_lookup_examples_have_exact_lengths_and_correct_answers(key_len):
  task = LookupTask(min_len=2 * key_len + 5, max_len=128, key_len=key_len)
  rng = np.random.default_rng(0)
  for n in [task.shortest, task.shortest + 1, 17, 40, 128]:
    for _ in range(50):
      e = task.example(rng, n)
      assert e.num_tokens == n
      pairs, queries = _pairs_and_queries(e.text)
      assert queries and len(queries) == len(e.answers)
      assert all(re.fullmatch(f"[a-z]{{{key_len}}}", k) and v.isupper() for k, v in pairs.items())
      assert [pairs[k] for k, _ in queries] == [a for _, a in queries]  # each answer is right
      assert [e.text[i] for i in e.answers] == [a for _, a in queries]
      prompt, answer = e.prompt()
      assert prompt.endswith("?" + queries[-1][0]) and answer == queries[-1][1]


def test_lookup_batches_are_seeded_padded_and_masked():
  task = LookupTask(max_len=64)
  a = task.batch(np.random.default_rng(3), 6)
  b = task.batch(np.random.default_rng(3), 6)
  c = task.batch(np.random.default_rng(4), 6)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, a, c)))
  width = a.ids_BT.shape[1]
  assert width in task.widths and a.ids_BT.dtype == np.int32 and a.lens_B.dtype == np.int32
  low = ([task.min_len] + [w + 1 for w in task.widths])[task.widths.index(width)]
  assert ((a.lens_B >= low) & (a.lens_B <= width)).all()
  for row in range(6):
    n = a.lens_B[row]
    assert a.ids_BT[row, 0] == tokenizer.BOS_ID and (a.ids_BT[row, n:] == tokenizer.PAD_ID).all()
    text = tokenizer.decode(a.ids_BT[row, :n])
    _, queries = _pairs_and_queries(text)
    answers = np.flatnonzero(a.answer_mask_BT[row])
    assert [chr(a.ids_BT[row, t]) for t in answers] == [v for _, v in queries]
    assert (a.ids_BT[row, answers - 2] == ord("?")).all()  # "?", the key, the answer
  np.testing.assert_array_equal(a.loss_mask_BT, a.answer_mask_BT.astype(np.float32))
  every = dataclasses.replace(task, loss_on="all").batch(np.random.default_rng(3), 6)
  t = np.arange(width)
  np.testing.assert_array_equal(every.loss_mask_BT, (t > 0) & (t < every.lens_B[:, None]))


def test_lookup_lengths_cover_every_bucket():
  task = LookupTask(min_len=8, max_len=128)
  rng = np.random.default_rng(5)
  widths = {task.batch(rng, 1).ids_BT.shape[1] for _ in range(200)}
  assert widths == {16, 32, 64, 128}


def test_copy_task_targets_the_copy():
  batch = CopyTask(min_copy=4, max_copy=7).batch(np.random.default_rng(0), 5)
  assert batch.ids_BT.shape == (5, 16)
  for row in range(5):
    text = tokenizer.decode(batch.ids_BT[row, :batch.lens_B[row]])
    first, second = text.split("|")
    assert first == second and 4 <= len(first) <= 7
    targets = np.flatnonzero(batch.loss_mask_BT[row])
    assert targets.tolist() == list(range(len(first) + 3, 2 * len(first) + 2))


@pytest.mark.parametrize("bad,match", [
    (dict(min_len=5), "min_len must be >= 7"), (dict(max_len=6, min_len=7), "max_len"),
    (dict(loss_on="keys"), "loss_on"), (dict(max_pairs=27), "max_pairs 27 exceeds"),
    (dict(max_queries=0), "max_queries must be a positive int")])
def test_lookup_task_rejects_bad_fields(bad, match):
  with pytest.raises(ValueError, match=match):
    LookupTask(**bad)


def test_encode_rejects_empty_and_overlong_examples():
  task = LookupTask()
  with pytest.raises(ValueError, match="examples is empty"):
    encode([], 16)
  with pytest.raises(ValueError, match="does not fit width 16"):
    encode([task.example(np.random.default_rng(0), 20)], 16)


# ---- accuracy evaluators --------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["mqa-only", "dense-capable"])
def test_generation_accuracy_matches_teacher_forcing(attention):
  """The inference path (prefill routes, greedy decode) and the training forward agree on
  each prompt's answer, above and below top-k."""
  model = CausalLM(tiny_lm(attention, moe=False), rngs=nnx.Rngs(0), backend="xla")
  task = LookupTask(max_len=40, max_queries=1)
  rng = np.random.default_rng(1)
  examples = [task.example(rng, n) for n in (9, 12, 16, 17, 30, 40)]
  batch = encode(examples, 40)
  logits, _ = model.forward_train(jnp.asarray(batch.ids_BT), jnp.asarray(batch.lens_B))
  hits = np.asarray(answer_hits(logits, batch)).sum(1)
  predicted = np.asarray(jnp.argmax(logits, -1))
  teacher = [tokenizer.decode([predicted[i, e.answers[-1]]]) for i, e in enumerate(examples)]
  for i, example in enumerate(examples):
    assert hits[i] == (teacher[i] == example.prompt()[1])
  forced = [dataclasses.replace(e, text=e.prompt()[0] + t) for e, t in zip(examples, teacher)]
  # Greedy generation predicts the teacher-forced tokens, on short (dense-capable: dense
  # route) and long (sparse route) prompts alike.
  assert generation_accuracy(model, forced[:3]) == 1.0
  assert generation_accuracy(model, forced[3:]) == 1.0
  answers = [e.prompt()[1] for e in examples]
  assert generation_accuracy(model, examples) == np.mean([t == a for t, a in zip(teacher,
                                                                                 answers)])


# ---- the train loop -------------------------------------------------------------------------

def _batches(task, n, batch_size=4, seed=0):
  rng = np.random.default_rng(seed)
  return [task.batch(rng, batch_size) for _ in range(n)]


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_smoke_recipe_lowers_the_losses(tmp_path):
  """20 steps on the tiny preset: the LM loss falls in the LM stage, the dense KL falls in
  the indexer warm-up (main model frozen), the sparse stage runs; a checkpoint is written."""
  recipe = recipes.smoke()
  assert sum(stage.steps for stage, _ in recipe.stages) == 20
  trainer = recipes.run_recipe(recipe, out_dir=tmp_path, progress=False)
  evals = {(e["stage"], e["step"]): e for e in trainer.evaluations}
  assert evals[("dense_lm", 8)]["lm_loss"] < 0.8 * evals[("dense_lm", 0)]["lm_loss"]
  warm = evals[("indexer_warmup", 0)], evals[("indexer_warmup", 6)]
  assert warm[1]["lm_loss"] == pytest.approx(warm[0]["lm_loss"], rel=1e-5)  # indexer only
  assert warm[1]["indexer_loss"] < 0.8 * warm[0]["indexer_loss"]
  assert all(math.isfinite(row["loss"]) for row in trainer.history)
  assert [row["stage"] for row in trainer.history].count("sparse") == 6
  lr = [row["learning_rate"] for row in trainer.history[:8]]
  assert lr[0] < lr[1] < lr[2] == pytest.approx(1e-2) and lr[7] < lr[3]  # warm-up, cosine
  loaded = load_pretrained(tmp_path / "checkpoint", backend="xla")
  assert loaded.config.mla.indexer.topk == 16  # the real top-k, not the dense stages' one
  state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
  assert (state["stage"], state["step"]) == ("sparse", 6)
  history = json.loads((tmp_path / "history.json").read_text())
  assert len(history["steps"]) == 20


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_a_recipe_reproduces_its_weights_from_the_seed():
  """The shipped model's claim: same seed, same stack -> the same weights, bit for bit (the
  initialisation, the data and the optimiser; two steps of the smoke recipe's sparse stage,
  the one that routes through the indexer's top-k)."""
  recipe = recipes.smoke()
  stage, task = recipe.stages[-1]
  short = dataclasses.replace(recipe, stages=(
      (dataclasses.replace(stage, steps=2, warmup_steps=1, eval_every=0), task),))
  runs = [nnx.state(recipes.run_recipe(short, progress=False).model, nnx.Param)
          for _ in range(2)]
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), runs[0], runs[1])
  assert all(jax.tree.leaves(same))
  fresh = nnx.state(CausalLM(recipe.model, rngs=nnx.Rngs(recipe.seed), backend="xla"),
                    nnx.Param)
  assert not jnp.array_equal(runs[0]["lm_head"]["weight"][...],
                             fresh["lm_head"]["weight"][...])  # the steps did train


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_dense_capable_class_trains_every_objective():
  """The smoke recipe trains the MQA-only class; this one takes the dense-MHA route."""
  model = CausalLM(tiny_lm("dense-capable", moe=False), rngs=nnx.Rngs(0), backend="xla")
  trainer = Trainer(model, progress=False)
  task = LookupTask(max_len=32)
  before = jax.tree.map(np.array, nnx.state(model, nnx.Param))
  for objective, topk in (("lm", 32), ("indexer_warmup", 32), ("sparse", None)):
    stage = Stage(name=objective, objective=objective, steps=2, learning_rate=1e-3,
                  batch_size=4, topk=topk)
    trainer.run_stage(stage, _batches(task, 2))
  after = nnx.state(model, nnx.Param)
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), before, after))
  assert all(changed)


def test_donated_train_step_updates_in_place():
  """The compiled step aliases the trainable parameters and optimizer state to its outputs."""
  from mla_jax.training.train import make_train_step, trainable_filter

  model = CausalLM(tiny_lm(moe=False), rngs=nnx.Rngs(0), backend="xla")
  graphdef, state = nnx.split(model)
  trainable, frozen = nnx.split_state(state, trainable_filter("lm"), ...)
  stage = Stage(name="s", objective="lm", steps=1, learning_rate=1e-3, batch_size=2)
  tx = stage.optimizer()
  opt_state = tx.init(trainable)
  batch = _batches(LookupTask(max_len=16), 1, batch_size=2)[0]
  step = make_train_step(graphdef, tx, "lm")
  text = step.lower(trainable, opt_state, frozen, batch).compile().as_text()
  assert "input_output_alias" in text
  leaf = jax.tree.leaves(trainable)[0]
  step(trainable, opt_state, frozen, batch)
  assert leaf.is_deleted()


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  model = CausalLM(tiny_lm(moe=False), rngs=nnx.Rngs(0), backend="xla")
  trainer = Trainer(model, out_dir=tmp_path, progress=False)
  task = LookupTask(max_len=16)
  good = Stage(name="good", objective="lm", steps=2, learning_rate=1e-3, batch_size=2)
  trainer.run_stage(good, _batches(task, 2))
  saved = (tmp_path / "checkpoint" / "model.safetensors").read_bytes()
  trainer.params = jax.tree.map(lambda x: x * jnp.nan, trainer.params)
  bad = dataclasses.replace(good, name="bad")
  with pytest.raises(TrainingDiverged, match=r"stage 'bad' step 1: loss nan .* not finite; "
                     r"training stopped and the last good checkpoint \('good' step 2\) is kept"):
    trainer.run_stage(bad, _batches(task, 2))
  assert (tmp_path / "checkpoint" / "model.safetensors").read_bytes() == saved
  assert not (tmp_path / "checkpoint.tmp").exists()
  reloaded = load_pretrained(tmp_path / "checkpoint", backend="xla")
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(reloaded)))


def test_nan_loss_before_any_checkpoint_says_so():
  model = CausalLM(tiny_lm(moe=False), rngs=nnx.Rngs(0), backend="xla")
  trainer = Trainer(model, progress=False)
  trainer.params = jax.tree.map(lambda x: x * jnp.nan, trainer.params)
  stage = Stage(name="s", objective="lm", steps=1, learning_rate=1e-3, batch_size=2)
  with pytest.raises(TrainingDiverged, match="no checkpoint was saved yet"):
    trainer.run_stage(stage, _batches(LookupTask(max_len=16), 1))


@pytest.mark.parametrize("lr", [0, -1e-3, float("nan"), float("inf")])
def test_bad_learning_rate_is_refused(lr):
  with pytest.raises(ValueError, match="stage 's': learning_rate must be a finite number > 0"):
    Stage(name="s", objective="lm", steps=1, learning_rate=lr, batch_size=1)


@pytest.mark.parametrize("bad,match", [
    (dict(objective="kl"), "objective must be one of"), (dict(steps=0), "steps must be"),
    (dict(batch_size=0), "batch_size must be"), (dict(warmup_steps=5), "warmup_steps"),
    (dict(topk=0), "topk must be"), (dict(clip_norm=0), "clip_norm")])
def test_bad_stage_fields_are_refused(bad, match):
  with pytest.raises(ValueError, match=match):
    Stage(**{**dict(name="s", objective="lm", steps=5, learning_rate=1e-3, batch_size=1), **bad})


def test_bad_data_is_refused_before_any_step():
  model = CausalLM(tiny_lm(moe=False), rngs=nnx.Rngs(0), backend="xla")
  trainer = Trainer(model, progress=False)
  stage = Stage(name="s", objective="lm", steps=2, learning_rate=1e-3, batch_size=2)
  task = LookupTask(max_len=16)
  with pytest.raises(ValueError, match="stage 's': the data is empty"):
    trainer.run_stage(stage, [])
  with pytest.raises(ValueError, match="the data ran out after 1 batches"):
    trainer.run_stage(stage, _batches(task, 1))
  limit = model.config.mla.max_position_embeddings
  long = Batch(np.zeros((1, limit + 1), np.int32), np.array([limit + 1], np.int32),
               np.ones((1, limit + 1), np.float32), np.zeros((1, limit + 1), bool))
  with pytest.raises(ValueError, match=f"sequences of {limit + 1} tokens exceed the model's "
                     f"max_position_embeddings {limit}"):
    trainer.run_stage(stage, [long, long])
  batch = _batches(task, 1)[0]
  no_targets = batch._replace(loss_mask_BT=np.zeros_like(batch.loss_mask_BT))
  with pytest.raises(ValueError, match="batch 1: the batch has no loss targets"):
    trainer.run_stage(stage, [no_targets, no_targets])
  with pytest.raises(ValueError, match="token ids must lie in"):
    trainer.run_stage(stage, [batch._replace(ids_BT=batch.ids_BT + 1000)] * 2)


def test_recipe_refuses_sequences_longer_than_the_model_allows():
  recipe = recipes.smoke()
  short = dataclasses.replace(recipe.model, mla=dataclasses.replace(
      recipe.model.mla, max_position_embeddings=20))
  with pytest.raises(ValueError, match="sequences of up to 32 tokens exceed the model's "
                     "max_position_embeddings 20"):
    dataclasses.replace(recipe, model=short)


def test_recall_recipe_routes_densely_then_sparsely():
  recipe = recipes.recall()
  topk = recipe.model.mla.indexer.topk
  assert topk in (16, 32)
  stages = [stage for stage, _ in recipe.stages]
  assert [s.objective for s in stages][-3:] == ["lm", "indexer_warmup", "sparse"]
  longest = max(task.max_len for _, task in recipe.stages)
  assert all(s.topk >= longest for s in stages[:-1]) and stages[-1].topk is None
  assert recipe.task.max_len >= 8 * topk


# ---- the command ----------------------------------------------------------------------------

@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_train_command_writes_a_checkpoint(tmp_path, monkeypatch, capsys):
  smoke = recipes.smoke()
  (stage, task) = smoke.stages[-1]  # one sparse step: the command, not the training, is tested
  short = dataclasses.replace(smoke, stages=((dataclasses.replace(stage, steps=1), task),))
  monkeypatch.setitem(recipes.RECIPES, "smoke", lambda: short)
  assert cli.main(["train", "--recipe", "smoke", "--out", str(tmp_path), "--seed", "3",
                   "--quiet"]) == 0
  out = capsys.readouterr().out
  assert "recipe smoke" in out and "seed 3" in out and "final lookup accuracy" in out
  assert (tmp_path / "checkpoint" / "config.json").exists()
  with pytest.raises(SystemExit):
    cli.main(["train", "--recipe", "nope"])


# ---- progress bars --------------------------------------------------------------------------

def test_progress_bars_draw_on_stderr_only_when_enabled(capsys):
  from mla_jax.generation import generate
  from mla_jax.progress import progress_bar

  model = CausalLM(tiny_lm(moe=False), rngs=nnx.Rngs(0), backend="xla")
  generate(model, [[1, 2, 3]], 4, progress=True)
  captured = capsys.readouterr()
  assert "decode" in captured.err and "4/4" in captured.err and captured.out == ""
  generate(model, [[1, 2, 3]], 4, progress=False)
  with progress_bar(3, "quiet", unit="step", enabled=False) as bar:
    bar.update(3)
  assert capsys.readouterr().err == ""


# ---- the MTP head ---------------------------------------------------------------------------

def test_mtp_objective_trains_only_the_mtp_layer():
  """A tiny model grown by one MTP layer: the main weights are copied bitwise and stay so
  through an ``"mtp"`` stage, every MTP parameter learns, and its loss falls in a few steps."""
  base = CausalLM(tiny_lm(moe=False), rngs=nnx.Rngs(0), backend="xla")
  main = jax.tree.map(np.array, nnx.state(base, nnx.Param))
  model = recipes.with_mtp_layer(base, seed=1)
  assert model.config.num_mtp_layers == 1
  mtp = jax.tree.map(np.array, nnx.state(model.mtp, nnx.Param))
  task = CopyTask(max_copy=15)  # 32 tokens: past top-k 16, so the MTP layer routes sparsely
  held_out = _batches(task, 1, batch_size=8, seed=9)
  stage = Stage(name="mtp", objective="mtp", steps=8, learning_rate=1e-2, batch_size=8)
  trainer = Trainer(model, progress=False)
  trainer.run_stage(stage, _batches(task, 8, batch_size=8), held_out)
  first, last = trainer.evaluations[0], trainer.evaluations[-1]
  assert last["lm_loss"] < 0.9 * first["lm_loss"] and last["indexer_loss"] > 0
  same = jax.tree.map(np.array_equal, main, nnx.state(model, nnx.Param).filter(
      lambda path, _: path[0] != "mtp"))
  assert all(jax.tree.leaves(same))
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), mtp,
                         nnx.state(model.mtp, nnx.Param))
  assert all(jax.tree.leaves(changed))


def test_mtp_forward_train_matches_mtp_forward():
  """The training forward's row p is ``mtp_forward`` on (hidden at p, token p + 1)."""
  model = recipes.with_mtp_layer(CausalLM(tiny_lm(moe=False), rngs=nnx.Rngs(0), backend="xla"))
  batch = _batches(LookupTask(max_len=32), 1, batch_size=2)[0]
  ids, lens = jnp.asarray(batch.ids_BT), jnp.asarray(batch.lens_B)
  got, _ = model.mtp_forward_train(ids, lens)
  width = ids.shape[1]
  _, _, hidden = model(ids, model.init_cache(2, width), new_lens_B=lens, return_hidden=True)
  want, _, _ = model.mtp_forward(0, hidden[:, :-1], ids[:, 1:], model.init_mtp_cache(2, width),
                                 new_lens_B=lens - 1)
  for b, n in enumerate(batch.lens_B):
    np.testing.assert_allclose(got[b, :n - 1], want[b, :n - 1], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # generates its data: about 45 s on 2 shared cores
def test_mtp_recipe_reproduces_its_head_from_the_seed():
  """``run_mtp_recipe`` twice from the same seed: the same continuations, the same head bit
  for bit, and the main model untouched."""
  base = CausalLM(tiny_lm(moe=False), rngs=nnx.Rngs(0), backend="xla")
  recipe = recipes.MTPRecipe(
      stage=Stage(name="mtp", objective="mtp", steps=2, learning_rate=1e-3, batch_size=4),
      lookup=LookupTask(max_len=24), copy=CopyTask(max_copy=8), prompts=8, eval_prompts=4,
      new_tokens=6)
  runs = [recipes.run_mtp_recipe(recipe, base, progress=False).model for _ in range(2)]
  heads = [nnx.state(m.mtp, nnx.Param) for m in runs]
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, *heads)))
  main = jax.tree.map(np.array_equal, nnx.state(base, nnx.Param), nnx.state(runs[0], nnx.Param)
                      .filter(lambda path, _: path[0] != "mtp"))
  assert all(jax.tree.leaves(main))
