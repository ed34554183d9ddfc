"""Training data over the byte vocabulary: an associative-recall (key-value lookup) task and a
copy task that teaches the circuit the lookup needs.

One lookup example reads ``<bos>aQ ..kX zB ?kX ?aQ``: pairs of a key (lowercase letters) and
its value (one uppercase letter), runs of ``.`` filler glued before some pairs, then queries
``?key`` whose next token is that key's value. Keys are distinct within an example; queries
may repeat. Answering needs the pair the query names, wherever it lies, so a model with top-k
attention answers only if its indexer selects that pair.

The format is chosen for learnability (measured with the MLA model and a plain transformer):
the value directly follows its key, as the answer directly follows the queried key, so the
two-layer "induction" circuit (match the current token against each position's previous
token, copy that position's token) solves it. A separator between key and value
(``ka=3 ... ka?3``) needs position-offset features on both sides of the match and stayed near
chance for thousands of steps; ten digit values let "copy any value in context" hold a
sticky plateau, 26 letter values do not; and many queries per example give many answers per
step. Even so, lookups alone reach the circuit only after a long, seed-dependent plateau,
while the copy task (``<bos>xYzw|xYzw``, every copied token after the first a target)
forms it in about 150 steps; a short copy stage first makes the lookup learnable in a few
hundred steps.

Examples have exact token lengths (BOS included). A lookup batch takes its lengths from one
bucket ``(prev_width, width]`` of power-of-two widths, so it pads to at most twice its
shortest sequence and the train step compiles once per width.

Loss targets are the answers only (``loss_on="answers"``): keys and values are uniform
random, so their next-token loss is irreducible noise (about ln 26 each) that would outweigh
the retrieval signal. ``loss_on="all"`` trains on every token instead.
"""

from __future__ import annotations

import dataclasses
import string
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from mla_jax.tokenizer import ByteTokenizer

tokenizer = ByteTokenizer()  # the lookup task's vocabulary: UTF-8 bytes and BOS/EOS/PAD

_LETTERS = string.ascii_lowercase
_VALUES = string.ascii_uppercase
_COPY_SEPARATOR = "|"
LOSS_TARGETS = ("answers", "all")


class Batch(NamedTuple):
  """Right-padded int32 ids and their masks; a pytree, so it passes straight into ``jit``."""

  ids_BT: np.ndarray           # int32, padded with tokenizer.PAD_ID
  lens_B: np.ndarray           # int32 real tokens per sequence, BOS included
  loss_mask_BT: np.ndarray     # float32: 1 where token t is a training target
  answer_mask_BT: np.ndarray   # bool: token t is an answer (for accuracy)


@dataclasses.dataclass(frozen=True)
class Example:
  text: str                    # without BOS
  answers: tuple[int, ...]     # character offsets of the answers in ``text``

  @property
  def num_tokens(self) -> int:
    return len(self.text) + 1  # BOS

  def prompt(self) -> tuple[str, str]:
    """The text up to the last query's key and that query's expected answer."""
    last = self.answers[-1]
    return self.text[:last], self.text[last]


@dataclasses.dataclass(frozen=True)
class LookupTask:
  """The lookup task's shape.

  Attributes:
    min_len, max_len: example lengths in tokens, BOS included.
    key_len: letters per key.
    max_pairs: pairs per example (fewer when the length does not fit them).
    max_queries: queries per example (fewer when the length does not fit them).
    loss_on: ``"answers"`` or ``"all"`` (see the module docstring).
  """

  min_len: int = 8
  max_len: int = 128
  key_len: int = 1
  max_pairs: int = 16
  max_queries: int = 16
  loss_on: str = "answers"

  def __post_init__(self):
    for name in ("min_len", "max_len", "key_len", "max_pairs", "max_queries"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.min_len < self.shortest:
      raise ValueError(f"min_len must be >= {self.shortest} (BOS, one pair and one query with "
                       f"key_len {self.key_len}), got {self.min_len}")
    if self.max_len < self.min_len:
      raise ValueError(f"max_len must be >= min_len ({self.min_len}), got {self.max_len}")
    if self.loss_on not in LOSS_TARGETS:
      raise ValueError(f"loss_on must be one of {LOSS_TARGETS}, got {self.loss_on!r}")
    if self.max_pairs > len(_LETTERS) ** self.key_len:
      raise ValueError(f"max_pairs {self.max_pairs} exceeds the {len(_LETTERS) ** self.key_len}"
                       f" distinct keys of {self.key_len} letter(s)")

  @property
  def shortest(self) -> int:
    """BOS + one pair ("aQ") + " " + one query ("?aQ")."""
    return 1 + (self.key_len + 1) + 1 + (self.key_len + 2)

  @property
  def widths(self) -> tuple[int, ...]:
    """Batch widths: powers of two from 16 up, the last one ``max_len``."""
    widths = [w for w in (2 ** i for i in range(4, 32)) if self.min_len <= w < self.max_len]
    return (*widths, self.max_len)

  def example(self, rng: np.random.Generator, num_tokens: int) -> Example:
    """One example of exactly ``num_tokens`` tokens (BOS included)."""
    if not self.shortest <= num_tokens:
      raise ValueError(f"num_tokens must be >= {self.shortest}, got {num_tokens}")
    room = num_tokens  # characters + 1: the last item has no trailing space
    pair, query = self.key_len + 2, self.key_len + 3  # with their separating space
    pairs = int(rng.integers(1, min(self.max_pairs, (room - query) // pair) + 1))
    most = min(self.max_queries, (room - pairs * pair) // query)
    queries = int(rng.integers((most + 1) // 2, most + 1))  # many answers per example
    keys = _distinct_keys(rng, pairs, self.key_len)
    values = rng.integers(0, len(_VALUES), size=pairs)
    filler = rng.multinomial(room - pairs * pair - queries * query, np.ones(pairs) / pairs)
    text = " ".join("." * int(f) + k + _VALUES[v] for f, k, v in zip(filler, keys, values))
    answers = []
    for i in rng.choice(pairs, size=queries, replace=queries > pairs):
      text += f" ?{keys[i]}"
      answers.append(len(text))
      text += _VALUES[values[i]]
    return Example(text, tuple(answers))

  def batch(self, rng: np.random.Generator, batch_size: int, *,
            width: int | None = None) -> Batch:
    """``batch_size`` examples padded to ``width`` (default: a random bucket, weighted by how
    many lengths it holds, so lengths are uniform over ``[min_len, max_len]`` overall)."""
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    widths = self.widths
    if width is None:
      sizes = np.diff([self.min_len - 1, *widths])
      width = widths[int(rng.choice(len(widths), p=sizes / sizes.sum()))]
    if width not in widths:
      raise ValueError(f"width must be one of {widths}, got {width}")
    i = widths.index(width)
    low = self.min_len if i == 0 else widths[i - 1] + 1
    lengths = rng.integers(low, width + 1, size=batch_size)
    return encode([self.example(rng, int(n)) for n in lengths], width, loss_on=self.loss_on)


@dataclasses.dataclass(frozen=True)
class CopyTask:
  """``<bos>xYzw|xYzw``: random letters, a separator, the same letters again.

  The targets are the copied tokens after the first (the first cannot be inferred from its
  predecessor, the separator). Batches have the one width ``2 * max_copy + 2``.
  """

  min_copy: int = 4
  max_copy: int = 15

  def __post_init__(self):
    if not isinstance(self.min_copy, int) or self.min_copy < 2:
      raise ValueError(f"min_copy must be an int >= 2, got {self.min_copy!r}")
    if not isinstance(self.max_copy, int) or self.max_copy < self.min_copy:
      raise ValueError(f"max_copy must be an int >= min_copy ({self.min_copy}), got "
                       f"{self.max_copy!r}")

  @property
  def max_len(self) -> int:
    return 2 * self.max_copy + 2

  @property
  def widths(self) -> tuple[int, ...]:
    return (self.max_len,)

  def example(self, rng: np.random.Generator, length: int) -> Example:
    letters = "".join(rng.choice(list(_LETTERS + _VALUES), size=length))
    return Example(letters + _COPY_SEPARATOR + letters, tuple(range(length + 2, 2 * length + 1)))

  def batch(self, rng: np.random.Generator, batch_size: int, *,
            width: int | None = None) -> Batch:
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if width not in (None, self.max_len):
      raise ValueError(f"width must be {self.max_len}, got {width}")
    lengths = rng.integers(self.min_copy, self.max_copy + 1, size=batch_size)
    return encode([self.example(rng, int(n)) for n in lengths], self.max_len)


def encode(examples: list[Example], width: int, *, loss_on: str = "answers") -> Batch:
  """Token ids, lengths and masks of ``examples`` padded to ``width``."""
  if not examples:
    raise ValueError("examples is empty")
  if loss_on not in LOSS_TARGETS:
    raise ValueError(f"loss_on must be one of {LOSS_TARGETS}, got {loss_on!r}")
  longest = max(e.num_tokens for e in examples)
  if longest > width:
    raise ValueError(f"an example of {longest} tokens does not fit width {width}")
  ids = np.full((len(examples), width), tokenizer.PAD_ID, np.int32)
  answer = np.zeros((len(examples), width), bool)
  lens = np.zeros((len(examples),), np.int32)
  for row, e in enumerate(examples):
    tokens = tokenizer.encode(e.text)
    ids[row, :len(tokens)] = tokens
    lens[row] = len(tokens)
    answer[row, np.asarray(e.answers, int) + 1] = True  # +1: BOS
  if loss_on == "answers":
    loss = answer.astype(np.float32)
  else:
    loss = (np.arange(width)[None, :] < lens[:, None]).astype(np.float32)
    loss[:, 0] = 0.0  # nothing predicts BOS
  return Batch(ids, lens, loss, answer)


def _distinct_keys(rng: np.random.Generator, count: int, key_len: int) -> list[str]:
  codes = rng.choice(len(_LETTERS) ** key_len, size=count, replace=False)
  keys = []
  for code in codes:
    letters = []
    for _ in range(key_len):
      code, r = divmod(int(code), len(_LETTERS))
      letters.append(_LETTERS[r])
    keys.append("".join(letters))
  return keys


def answer_hits(logits_BTV, batch: Batch):
  """Teacher-forced exact match: bool [B, T], True where the answer at t is the argmax of the
  logits at t - 1 (False off the answer positions)."""
  predicted_BT = jnp.argmax(logits_BTV[:, :-1], axis=-1)
  hits_BT = (predicted_BT == batch.ids_BT[:, 1:]) & batch.answer_mask_BT[:, 1:]
  return jnp.pad(hits_BT, ((0, 0), (1, 0)))


def generation_accuracy(model, examples: list[Example], *, batch_size: int = 32) -> float:
  """Exact match of the last query's answer, decoded greedily by ``mla_jax.generate`` from
  the prompt that ends at its key (the model's inference path, prefill routes included)."""
  from mla_jax.generation import generate

  if not examples:
    raise ValueError("examples is empty")
  correct = 0
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    prompts = [e.prompt() for e in chunk]
    result = generate(model, [tokenizer.encode(p) for p, _ in prompts], 1)
    correct += sum(tokenizer.decode(t[:1]) == answer
                   for t, (_, answer) in zip(result.tokens, prompts))
  return correct / len(examples)


def continuation_prompts(rng: np.random.Generator, count: int, *, lookup: LookupTask,
                         copy: CopyTask, copy_fraction: float = 0.5) -> list[list[int]]:
  """Token ids (BOS first) of ``count`` prompts for a model to continue: lookups cut after
  their last query's key (``Example.prompt``) and copy examples cut after the separator and
  one to all but the last of the copied letters, mixed at ``copy_fraction``."""
  prompts = []
  for _ in range(count):
    if rng.random() < copy_fraction:
      n = int(rng.integers(copy.min_copy, copy.max_copy + 1))
      e = copy.example(rng, n)
      prompts.append(tokenizer.encode(e.text[:n + 1 + int(rng.integers(1, n))]))
    else:
      e = lookup.example(rng, int(rng.integers(lookup.min_len, lookup.max_len + 1)))
      prompts.append(tokenizer.encode(e.prompt()[0]))
  return prompts


def greedy_continuations(model, prompts: list[list[int]], new_tokens: int, *,
                         batch_size: int = 256) -> Batch:
  """The prompts followed by ``model``'s greedy continuations (``mla_jax.generate``), padded
  to the longest prompt plus ``new_tokens``; the loss and answer masks mark the generated
  tokens. A model's own continuations are what a draft head for it must predict (MTP)."""
  from mla_jax.generation import generate

  if not prompts:
    raise ValueError("prompts is empty")
  width = max(len(p) for p in prompts) + new_tokens
  ids = np.full((len(prompts), width), tokenizer.PAD_ID, np.int32)
  generated = np.zeros((len(prompts), width), bool)
  lens = np.zeros((len(prompts),), np.int32)
  for start in range(0, len(prompts), batch_size):
    chunk = prompts[start:start + batch_size]
    result = generate(model, chunk, new_tokens)
    for row, (prompt, tokens) in enumerate(zip(chunk, result.tokens), start):
      sequence = [*prompt, *tokens]
      ids[row, :len(sequence)] = sequence
      generated[row, len(prompt):len(sequence)] = True
      lens[row] = len(sequence)
  return Batch(ids, lens, generated.astype(np.float32), generated)


def draft_acceptance(model, batch: Batch) -> tuple[int, int]:
  """Teacher-forced acceptance of MTP layer 0 on a batch of the model's own continuations
  (``greedy_continuations``): ``(accepted, proposed)`` over the positions p whose token at
  p + 1 is generated and p + 2 < length; accepted where the MTP layer's argmax for p + 2 (from
  the hidden state at p and the token at p + 1) is the main model's argmax at p + 1. That is
  the acceptance rate of greedy speculative decoding with one draft token (k = 1)."""
  from flax import nnx

  @nnx.jit
  def predictions(model, ids_BT, lens_B):
    main_BTV, _ = model.forward_train(ids_BT, lens_B)
    draft_BTV, _ = model.mtp_forward_train(ids_BT, lens_B)
    return jnp.argmax(main_BTV[:, 1:], -1), jnp.argmax(draft_BTV, -1)

  main_BT, draft_BT = map(np.asarray, predictions(model, jnp.asarray(batch.ids_BT),
                                                    jnp.asarray(batch.lens_B)))
  t_T = np.arange(draft_BT.shape[1])
  counted_BT = np.asarray(batch.answer_mask_BT)[:, 1:] & (t_T + 2 < batch.lens_B[:, None])
  return int((counted_BT & (main_BT == draft_BT)).sum()), int(counted_BT.sum())
