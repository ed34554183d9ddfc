"""Training stages and the loop: a jit-compiled step with donated state, evaluation, checkpoints.

A stage trains one objective of DeepSeek-V3.2's recipe:

* ``"lm"``: the next-token loss; every parameter but the indexer's learns (top-k indices
  carry no gradient, so the indexer would get none anyway).
* ``"indexer_warmup"``: the dense indexer KL only; only the indexer learns.
* ``"sparse"``: the next-token loss plus the sparse indexer KL; everything learns, and the
  two never mix: the attention detaches the indexer's inputs, so the indexer learns only from
  its KL and the rest only from the next-token loss.
* ``"mtp"``: only the multi-token-prediction layer 0 learns (``CausalLM.mtp``; the main model
  is frozen): the cross entropy of its logits at p predicting the token at p + 2, from the main
  model's hidden state at p and the true token at p + 1, over the batch's loss mask, plus the
  dense KL of its own indexer (summed, as in the warm-up; the indexer's inputs are detached, so
  it learns only from its KL). The layer runs at the model's top-k, as it does in speculative
  decoding, and its indexer learns from the first step.

A stage may override the indexer's top-k for its whole run. Parameter shapes do not depend on
top-k, and a top-k of at least the longest sequence selects every causal key, so the routing
rules then attend densely: that is how the "dense" stages run inside the routing contract.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path
from typing import Iterable, Sequence

import jax
import numpy as np
import optax
from flax import nnx

from mla_jax.models.config import ModelConfig
from mla_jax.models.lm import CausalLM
from mla_jax.progress import progress_bar
from mla_jax.training.data import Batch, answer_hits
from mla_jax.losses import next_token_loss

# objective -> the indexer loss its forward computes
OBJECTIVES = {"lm": None, "indexer_warmup": "dense", "sparse": "sparse", "mtp": "dense"}


class TrainingDiverged(FloatingPointError):
  """A step produced a non-finite loss or gradient; the last good checkpoint is kept."""


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of a recipe.

  Attributes:
    name: shown in the progress bar, logs and checkpoints.
    objective: ``"lm" | "indexer_warmup" | "sparse" | "mtp"`` (module docstring).
    steps: optimizer steps.
    learning_rate: peak learning rate (linear warm-up, then cosine decay).
    batch_size: sequences per step.
    warmup_steps: linear warm-up steps (< steps).
    final_lr_fraction: the cosine decay ends at this fraction of the peak.
    clip_norm: global gradient-norm clipping.
    weight_decay: AdamW's decoupled weight decay.
    topk: the indexer's top-k during this stage; None keeps the model's.
    eval_every: evaluate (and checkpoint) every this many steps; 0 only at the stage's end.
  """

  name: str
  objective: str
  steps: int
  learning_rate: float
  batch_size: int
  warmup_steps: int = 0
  final_lr_fraction: float = 0.1
  clip_norm: float = 1.0
  weight_decay: float = 0.0
  topk: int | None = None
  eval_every: int = 0

  def __post_init__(self):
    def positive_int(field):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"stage {self.name!r}: {field} must be a positive int, got {value!r}")

    if self.objective not in OBJECTIVES:
      raise ValueError(f"stage {self.name!r}: objective must be one of {tuple(OBJECTIVES)}, "
                       f"got {self.objective!r}")
    positive_int("steps")
    positive_int("batch_size")
    lr = self.learning_rate
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) \
        or lr <= 0:
      raise ValueError(f"stage {self.name!r}: learning_rate must be a finite number > 0, "
                       f"got {lr!r}")
    if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"stage {self.name!r}: warmup_steps must be an int in [0, steps="
                       f"{self.steps}), got {self.warmup_steps!r}")
    if not 0 <= self.final_lr_fraction <= 1:
      raise ValueError(f"stage {self.name!r}: final_lr_fraction must lie in [0, 1], got "
                       f"{self.final_lr_fraction!r}")
    if not self.clip_norm > 0:
      raise ValueError(f"stage {self.name!r}: clip_norm must be > 0, got {self.clip_norm!r}")
    if not self.weight_decay >= 0:
      raise ValueError(f"stage {self.name!r}: weight_decay must be >= 0, got "
                       f"{self.weight_decay!r}")
    if self.topk is not None:
      positive_int("topk")
    if not isinstance(self.eval_every, int) or self.eval_every < 0:
      raise ValueError(f"stage {self.name!r}: eval_every must be an int >= 0, got "
                       f"{self.eval_every!r}")

  def schedule(self) -> optax.Schedule:
    lr = float(self.learning_rate)
    return optax.warmup_cosine_decay_schedule(
        lr / (self.warmup_steps + 1), lr, self.warmup_steps, self.steps,
        lr * self.final_lr_fraction)

  def optimizer(self) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(self.clip_norm),
                       optax.adamw(self.schedule(), b1=0.9, b2=0.95,
                                   weight_decay=self.weight_decay))


def trainable_filter(objective: str):
  """The parameters a stage of this objective trains (an NNX filter)."""
  indexer, mtp = nnx.PathContains("indexer"), nnx.PathContains("mtp")
  return {"lm": nnx.All(nnx.Param, nnx.Not(indexer), nnx.Not(mtp)),
          "indexer_warmup": nnx.All(nnx.Param, indexer, nnx.Not(mtp)),
          "sparse": nnx.All(nnx.Param, nnx.Not(mtp)),
          "mtp": nnx.All(nnx.Param, mtp)}[objective]


def with_topk(config: ModelConfig, topk: int | None) -> ModelConfig:
  """``config`` with the indexer's top-k replaced (None: unchanged)."""
  if topk is None:
    return config
  if config.mla.indexer is None:
    raise ValueError("a stage topk needs a model with an indexer")
  indexer = dataclasses.replace(config.mla.indexer, topk=topk)
  return dataclasses.replace(config, mla=dataclasses.replace(config.mla, indexer=indexer))


def _forward_losses(graphdef, states, batch: Batch, indexer_loss, objective: str):
  model = nnx.merge(graphdef, *states)
  if objective == "mtp":  # row p predicts token p + 2: the loss of a batch shifted by one
    logits_BTV, kl = model.mtp_forward_train(batch.ids_BT, batch.lens_B,
                                             indexer_loss=indexer_loss)
    batch = Batch(batch.ids_BT[:, 1:], batch.lens_B - 1, batch.loss_mask_BT[:, 1:],
                  batch.answer_mask_BT[:, 1:])
  else:
    logits_BTV, kl = model.forward_train(batch.ids_BT, batch.lens_B, indexer_loss=indexer_loss)
  lm, _ = next_token_loss(logits_BTV, batch.ids_BT, batch.lens_B, batch.loss_mask_BT)
  return lm, kl, answer_hits(logits_BTV, batch).sum()


def make_train_step(graphdef, tx: optax.GradientTransformation, objective: str):
  """``step(trainable, opt_state, frozen, batch) -> (trainable, opt_state, metrics)``, jitted
  with the trainable parameters and the optimizer state donated (updated in place)."""
  indexer_loss = OBJECTIVES[objective]

  def loss_fn(trainable, frozen, batch):
    lm, kl, hits = _forward_losses(graphdef, (trainable, frozen), batch, indexer_loss,
                                   objective)
    loss = kl if objective == "indexer_warmup" else lm + kl
    return loss, {"lm_loss": lm, "indexer_loss": kl, "answer_hits": hits}

  def step(trainable, opt_state, frozen, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, batch)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}
    return optax.apply_updates(trainable, updates), opt_state, metrics

  return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(graphdef, objective: str):
  """``evaluate(params, batch) -> metrics``; the indexer KL is the sparse one in the sparse
  stage and the dense one before it (how well the indexer imitates full attention); an
  ``"mtp"`` stage evaluates the MTP layer (its loss, its indexer's dense KL, its hits)."""
  indexer_loss = "sparse" if objective == "sparse" else "dense"

  def evaluate(params, batch):
    lm, kl, hits = _forward_losses(graphdef, (params,), batch, indexer_loss, objective)
    return {"lm_loss": lm, "indexer_loss": kl, "answer_hits": hits}

  return jax.jit(evaluate)


def _finite(x) -> bool:
  return bool(np.isfinite(x))


class Trainer:
  """Runs stages on one model, keeping its history and the last good checkpoint.

  The model's parameters are donated to the train step and written back at the end of each
  stage. With ``out_dir``, ``out_dir/checkpoint`` (``save_pretrained`` format, plus
  ``trainer_state.json``) is replaced only by a complete newer one, and ``history.json``
  holds every step's metrics and every evaluation.
  """

  def __init__(self, model: CausalLM, *, out_dir=None, progress: bool = True):
    if not isinstance(model, CausalLM):
      raise TypeError(f"model must be a CausalLM, got {type(model).__name__}")
    self.model = model
    self.params = nnx.state(model)
    self.out_dir = Path(out_dir) if out_dir is not None else None
    self.progress = progress
    self.history: list[dict] = []
    self.evaluations: list[dict] = []
    self.checkpoint: dict | None = None

  # ---- inputs -----------------------------------------------------------------------------

  def _check_batch(self, batch, stage: Stage, index: int) -> None:
    where = f"stage {stage.name!r}, batch {index}"
    if not isinstance(batch, Batch):
      raise TypeError(f"{where}: expected a Batch, got {type(batch).__name__}")
    ids, lens = np.asarray(batch.ids_BT), np.asarray(batch.lens_B)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
      raise ValueError(f"{where}: ids must be a non-empty int array [batch, tokens], got "
                       f"{ids.dtype} {ids.shape}")
    limit = self.model.config.mla.max_position_embeddings
    if ids.shape[1] > limit:
      raise ValueError(f"{where}: sequences of {ids.shape[1]} tokens exceed the model's "
                       f"max_position_embeddings {limit}")
    vocab = self.model.config.vocab_size
    if ids.min() < 0 or ids.max() >= vocab:
      raise ValueError(f"{where}: token ids must lie in [0, {vocab}), got "
                       f"[{ids.min()}, {ids.max()}]")
    if lens.shape != ids.shape[:1] or (lens < 1).any() or (lens > ids.shape[1]).any():
      raise ValueError(f"{where}: lens must be [{ids.shape[0]}] ints in [1, {ids.shape[1]}], "
                       f"got {lens.tolist()}")
    t_T = np.arange(ids.shape[1])
    targets = (np.asarray(batch.loss_mask_BT) > 0) & (t_T > 0) & (t_T < lens[:, None])
    if not targets.any():
      raise ValueError(f"{where}: the batch has no loss targets")

  # ---- the loop ---------------------------------------------------------------------------

  def run_stage(self, stage: Stage, batches: Iterable[Batch],
                eval_batches: Sequence[Batch] = ()) -> dict:
    """Trains ``stage.steps`` steps on ``batches`` (at least that many); returns the final
    evaluation (an empty dict without ``eval_batches``), which also runs before step 1."""
    if not isinstance(stage, Stage):
      raise TypeError(f"stage must be a Stage, got {type(stage).__name__}")
    for i, batch in enumerate(eval_batches):
      self._check_batch(batch, stage, f"eval {i}")
    config = with_topk(self.model.config, stage.topk)
    graphdef = nnx.graphdef(nnx.eval_shape(
        lambda: CausalLM(config, rngs=nnx.Rngs(0), backend=self.model.backend,
                         mesh=self.model.mesh, grouped_matmul=self.model.grouped_matmul)))
    trainable, frozen = nnx.split_state(self.params, trainable_filter(stage.objective), ...)
    tx = stage.optimizer()
    opt_state = tx.init(trainable)
    train_step = make_train_step(graphdef, tx, stage.objective)
    eval_step = make_eval_step(graphdef, stage.objective)
    schedule = stage.schedule()
    result = {}
    rates = collections.deque(maxlen=20)
    batches = iter(batches)
    try:
      with progress_bar(stage.steps, stage.name, unit="step", enabled=self.progress) as bar:
        if eval_batches:  # the starting point, e.g. top-k accuracy before sparse training
          bar.write(_describe(self._evaluate(eval_step, eval_batches, stage, 0)))
        for step in range(1, stage.steps + 1):
          batch = next(batches, None)
          if batch is None:
            raise ValueError(f"stage {stage.name!r}: the data is empty" if step == 1 else
                             f"stage {stage.name!r}: the data ran out after {step - 1} batches "
                             f"({stage.steps} steps need as many)")
          self._check_batch(batch, stage, step)
          start = time.perf_counter()
          trainable, opt_state, metrics = train_step(trainable, opt_state, frozen, batch)
          row = self._record_step(stage, step, batch, jax.device_get(metrics),
                                  time.perf_counter() - start, schedule(step - 1))
          rates.append((row["tokens"], row["seconds"]))
          bar.set_postfix(loss=f"{row['loss']:.4f}",
                          tok_s=f"{sum(n for n, _ in rates) / sum(s for _, s in rates):.0f}")
          bar.update(1)
          if step == stage.steps or (stage.eval_every and step % stage.eval_every == 0):
            self.params = nnx.merge_state(trainable, frozen)
            if eval_batches:
              result = self._evaluate(eval_step, eval_batches, stage, step)
              bar.write(_describe(result))
            self._save_checkpoint(stage, step)
    finally:  # donation deleted the arrays the stage started from: keep the newest
      self.params = nnx.merge_state(trainable, frozen)
    nnx.update(self.model, self.params)
    return result

  def _record_step(self, stage: Stage, step: int, batch: Batch, metrics, seconds: float,
                   learning_rate) -> dict:
    """Appends one step to the history; a non-finite loss or gradient stops training."""
    metrics = {k: float(v) for k, v in metrics.items()}
    if not (_finite(metrics["loss"]) and _finite(metrics["grad_norm"])):
      raise TrainingDiverged(self._divergence_message(stage, step, metrics))
    row = {"stage": stage.name, "step": step, "seconds": seconds,
           "width": int(batch.ids_BT.shape[1]), "tokens": int(np.asarray(batch.lens_B).sum()),
           "answers": int(np.asarray(batch.answer_mask_BT).sum()),
           "learning_rate": float(learning_rate), **metrics}
    self.history.append(row)
    return row

  def _evaluate(self, eval_step, eval_batches, stage, step) -> dict:
    by_width = collections.defaultdict(lambda: [0, 0])
    lm, kl = [], []
    for batch in eval_batches:
      metrics = jax.device_get(eval_step(self.params, batch))
      lm.append(float(metrics["lm_loss"]))
      kl.append(float(metrics["indexer_loss"]))
      counts = by_width[int(batch.ids_BT.shape[1])]
      counts[0] += int(metrics["answer_hits"])
      counts[1] += int(np.asarray(batch.answer_mask_BT).sum())
    hits, answers = (sum(c[i] for c in by_width.values()) for i in (0, 1))
    result = {"stage": stage.name, "step": step, "lm_loss": float(np.mean(lm)),
              "indexer_loss": float(np.mean(kl)), "accuracy": hits / max(answers, 1),
              "accuracy_by_width": {w: h / max(a, 1) for w, (h, a) in sorted(by_width.items())}}
    self.evaluations.append(result)
    return result

  # ---- checkpoints ------------------------------------------------------------------------

  def _save_checkpoint(self, stage: Stage, step: int) -> None:
    if self.out_dir is None:
      return
    from mla_jax.checkpoints import save_pretrained

    final, tmp, old = (self.out_dir / name for name in ("checkpoint", "checkpoint.tmp",
                                                         "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    nnx.update(self.model, self.params)
    save_pretrained(self.model, tmp)
    state = {"stage": stage.name, "step": step,
             "evaluation": self.evaluations[-1] if self.evaluations else None}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    # Swap only once the new checkpoint is complete: a crash never leaves none behind.
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
      final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    self.checkpoint = {"path": str(final), "stage": stage.name, "step": step}
    self.write_history()

  def write_history(self) -> None:
    if self.out_dir is not None:
      self.out_dir.mkdir(parents=True, exist_ok=True)
      (self.out_dir / "history.json").write_text(json.dumps(
          {"steps": self.history, "evaluations": self.evaluations}, indent=1) + "\n")

  def _divergence_message(self, stage: Stage, step: int, metrics: dict) -> str:
    kept = ("no checkpoint was saved yet" if self.checkpoint is None else
            f"the last good checkpoint ({self.checkpoint['stage']!r} step "
            f"{self.checkpoint['step']}) is kept at {self.checkpoint['path']}")
    return (f"stage {stage.name!r} step {step}: loss {metrics['loss']} / gradient norm "
            f"{metrics['grad_norm']} is not finite; training stopped and {kept}")


def _describe(evaluation: dict) -> str:
  widths = ", ".join(f"<={w}: {a:.2f}" for w, a in evaluation["accuracy_by_width"].items())
  return (f"[{evaluation['stage']} step {evaluation['step']}] lm {evaluation['lm_loss']:.4f} "
          f"indexer KL {evaluation['indexer_loss']:.4f} answer accuracy "
          f"{evaluation['accuracy']:.3f} ({widths})")
