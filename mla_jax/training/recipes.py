"""Named training recipes and ``run_recipe``, which reproduces one from its seed.

Every recipe runs DeepSeek-V3.2's three stages on the key-value lookup task: a dense LM stage
(top-k raised to the longest sequence, so attention is dense), the indexer warm-up (dense KL,
only the indexer learns) and sparse training at the model's real top-k. ``recall`` starts
with a short dense copy stage that forms the retrieval circuit (see ``training.data``).

``run_recipe(backend=...)`` trains on any backend: ``"xla"`` differentiates the jnp
references, ``"pallas"`` runs the Pallas-Triton kernels and their backward kernels (in interpret
mode off an NVIDIA GPU), ``"auto"`` picks the kernels on an NVIDIA GPU.

``recall_mtp`` / ``run_mtp_recipe`` train an MTP head for a trained model with the model
frozen (the ``"mtp"`` objective) on the model's own greedy continuations: those are the tokens
a speculative decoder's draft must guess (``benchmarks/train_mtp.py`` ships the recall head).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from mla_jax.backends import Backend, get_backend
from mla_jax.config import IndexerConfig, MLAConfig, RopeConfig
from mla_jax.models.config import ModelConfig, tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.tokenizer import ByteTokenizer
from mla_jax.training.data import (Batch, CopyTask, LookupTask, continuation_prompts,
                                   greedy_continuations)
from mla_jax.training.train import Stage, Trainer

tokenizer = ByteTokenizer()  # the lookup task's vocabulary: UTF-8 bytes and BOS/EOS/PAD


Task = LookupTask | CopyTask


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A model and its stages, each with the task it trains on; ``seed`` fixes weights and data.

  ``task`` is the lookup task the evaluations (and the shipped model) are about.
  """

  name: str
  description: str
  model: ModelConfig
  task: LookupTask
  stages: tuple[tuple[Stage, Task], ...]
  seed: int = 0
  eval_batch_size: int = 32
  eval_batches_per_width: int = 2

  def __post_init__(self):
    if not self.stages or not all(
        isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], Stage)
        and isinstance(s[1], (LookupTask, CopyTask)) for s in self.stages):
      raise ValueError(f"recipe {self.name!r}: stages must be a non-empty tuple of "
                       "(Stage, LookupTask | CopyTask) pairs")
    limit = self.model.mla.max_position_embeddings
    for stage, task in self.stages:
      if task.max_len > limit:
        raise ValueError(f"recipe {self.name!r}, stage {stage.name!r}: sequences of up to "
                         f"{task.max_len} tokens exceed the model's max_position_embeddings "
                         f"{limit}")
    if self.task.max_len > limit:
      raise ValueError(f"recipe {self.name!r}: the task's sequences of up to "
                       f"{self.task.max_len} tokens exceed the model's "
                       f"max_position_embeddings {limit}")
    if self.model.vocab_size < tokenizer.VOCAB_SIZE:
      raise ValueError(f"recipe {self.name!r}: the byte tokenizer needs vocab_size >= "
                       f"{tokenizer.VOCAB_SIZE}, got {self.model.vocab_size}")

  def eval_batches(self, seed: int):
    """The fixed evaluation set: ``eval_batches_per_width`` lookup batches at every width."""
    rng = np.random.default_rng([seed, 0])
    return [self.task.batch(rng, self.eval_batch_size, width=w)
            for w in self.task.widths for _ in range(self.eval_batches_per_width)]


def _stage(name, objective, steps, lr, batch_size, *, topk=None, eval_every=0, warmup=None):
  warmup = min(steps // 10, 50) if warmup is None else warmup
  return Stage(name=name, objective=objective, steps=steps, learning_rate=lr,
               batch_size=batch_size, warmup_steps=warmup, topk=topk, eval_every=eval_every)


def smoke() -> Recipe:
  """The tiny preset (top-k 16) on lookups of 17-32 tokens (one compiled width, longer than
  top-k, so the last stage is really sparse), 20 steps in all: for tests and CI."""
  task = LookupTask(min_len=17, max_len=32, max_pairs=6)
  dense = task.max_len  # top-k >= every sequence: the routes attend densely
  return Recipe(
      name="smoke", description="tiny preset, 20 steps: a machinery check",
      model=tiny_lm(), task=task,
      stages=((_stage("dense_lm", "lm", 8, 1e-2, 8, topk=dense, warmup=2), task),
              (_stage("indexer_warmup", "indexer_warmup", 6, 1e-2, 8, topk=dense), task),
              (_stage("sparse", "sparse", 6, 1e-3, 8), task)),
      eval_batch_size=8, eval_batches_per_width=1)


def recall_model() -> ModelConfig:
  """A small DSA model for the lookup task: 2 layers, 128 wide, top-k 16."""
  mla = MLAConfig(hidden_size=128, num_heads=4, q_lora_rank=64, kv_lora_rank=64,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  rope=RopeConfig(theta=10000.0), max_position_embeddings=1024,
                  indexer=IndexerConfig(num_heads=4, head_dim=32, topk=16))
  return ModelConfig(mla=mla, vocab_size=260, num_layers=2, intermediate_size=256,
                     attention="dense-capable")


def recall() -> Recipe:
  """Lookups of 8 to 128 tokens (8 x top-k) on ``recall_model``: copy warm-up, dense LM,
  indexer warm-up, sparse training."""
  task = LookupTask(max_len=128)
  dense = task.max_len
  return Recipe(
      name="recall", description="key-value lookups of 8-128 tokens, top-k 16",
      model=recall_model(), task=task,
      stages=((_stage("copy", "lm", 300, 3e-3, 32, topk=dense, eval_every=300), CopyTask()),
              (_stage("dense_lm", "lm", 400, 3e-3, 32, topk=dense, eval_every=400), task),
              (_stage("indexer_warmup", "indexer_warmup", 150, 3e-3, 32, topk=dense,
                      eval_every=150), task),
              (_stage("sparse", "sparse", 200, 1e-3, 32, eval_every=200), task)))


RECIPES = {"smoke": smoke, "recall": recall}


def get_recipe(name: str) -> Recipe:
  if name not in RECIPES:
    raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {name!r}")
  return RECIPES[name]()


def run_recipe(recipe: Recipe, *, out_dir=None, seed: int | None = None,
               progress: bool = True, backend: str | Backend = "auto") -> Trainer:
  """Builds the recipe's model from ``seed`` (default the recipe's) and trains every stage.

  Weights and data derive from the seed alone, so a run reproduces on the same software
  stack and backend. ``backend``: the attention kernels the forward and backward run
  (``mla_jax.backends.get_backend``). Returns the trainer: its model, per-step history and
  evaluations.
  """
  if not isinstance(recipe, Recipe):
    raise TypeError(f"recipe must be a Recipe, got {type(recipe).__name__}")
  seed = recipe.seed if seed is None else seed
  model = CausalLM(recipe.model, rngs=nnx.Rngs(seed), backend=get_backend(backend))
  trainer = Trainer(model, out_dir=out_dir, progress=progress)
  eval_batches = recipe.eval_batches(seed)
  for i, (stage, task) in enumerate(recipe.stages):
    rng = np.random.default_rng([seed, i + 1])
    batches = (task.batch(rng, stage.batch_size) for _ in range(stage.steps))
    trainer.run_stage(stage, batches, eval_batches)
  trainer.write_history()
  return trainer


def with_mtp_layer(model: CausalLM, *, seed: int = 0) -> CausalLM:
  """``model`` (without MTP layers) plus one MTP layer initialised from ``seed``; the main
  parameters are ``model``'s own arrays, so they stay bitwise identical."""
  if model.config.num_mtp_layers:
    raise ValueError(f"the model already has {model.config.num_mtp_layers} MTP layer(s)")
  config = dataclasses.replace(model.config, num_mtp_layers=1)
  grown = CausalLM(config, rngs=nnx.Rngs(seed), backend=model.backend)
  nnx.update(grown, nnx.state(model))
  return grown


@dataclasses.dataclass(frozen=True)
class MTPRecipe:
  """An MTP head for a frozen trained model, trained on the model's own greedy continuations.

  ``prompts`` prompts (lookups and copy examples, ``continuation_prompts``) are continued by
  ``new_tokens`` greedy tokens; the ``"mtp"`` stage learns to predict each generated token two
  ahead. ``eval_prompts`` held-out prompts (another seed stream) measure it.
  """

  stage: Stage
  lookup: LookupTask = LookupTask()
  copy: CopyTask = CopyTask()
  copy_fraction: float = 0.5
  prompts: int = 1024
  eval_prompts: int = 128
  new_tokens: int = 32
  seed: int = 0


def recall_mtp() -> MTPRecipe:
  """The shipped ``recall`` model's MTP head."""
  return MTPRecipe(stage=_stage("mtp", "mtp", 300, 3e-3, 32, warmup=20, eval_every=100))


def mtp_data(recipe: MTPRecipe, model: CausalLM, seed: int, *, eval: bool = False) -> Batch:
  """The recipe's continuations by ``model``: training (``eval=False``) or held-out."""
  rng = np.random.default_rng([seed, 2 if eval else 1])
  prompts = continuation_prompts(rng, recipe.eval_prompts if eval else recipe.prompts,
                                 lookup=recipe.lookup, copy=recipe.copy,
                                 copy_fraction=recipe.copy_fraction)
  return greedy_continuations(model, prompts, recipe.new_tokens)


def run_mtp_recipe(recipe: MTPRecipe, model: CausalLM, *, out_dir=None, seed: int | None = None,
                   progress: bool = True) -> Trainer:
  """Adds an MTP layer to the trained ``model`` (``with_mtp_layer``) and trains only it.

  The data are ``model``'s continuations of seeded prompts; the stage draws batches from them
  in seeded random order (epochs). Returns the trainer; its model is ``model`` plus the head.
  """
  seed = recipe.seed if seed is None else seed
  data = mtp_data(recipe, model, seed)
  held_out = mtp_data(recipe, model, seed, eval=True)
  size = recipe.stage.batch_size
  eval_batches = [_rows(held_out, np.arange(i, min(i + size, recipe.eval_prompts)))
                  for i in range(0, recipe.eval_prompts, size)]
  rng = np.random.default_rng([seed, 3])

  def batches():
    while True:
      order = rng.permutation(recipe.prompts)
      for i in range(0, recipe.prompts - size + 1, size):
        yield _rows(data, order[i:i + size])

  trainer = Trainer(with_mtp_layer(model, seed=seed), out_dir=out_dir, progress=progress)
  trainer.run_stage(recipe.stage, batches(), eval_batches)
  trainer.write_history()
  return trainer


def _rows(batch: Batch, rows) -> Batch:
  return Batch(*(np.asarray(a)[rows] for a in batch))
