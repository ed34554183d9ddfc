"""A request's settings (``SamplingParams``), its running state (``Sequence``) and what the engine
reports of it (``RequestOutput``). Plain Python: the scheduler and the server use them too."""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import math
import numbers
import time

from mla_jax import checks
from mla_jax.decoding.text import IncrementalText
from mla_jax.decoding.sampling import SamplingConfig
from mla_jax.decoding.speculative import MAX_SPECULATIVE_TOKENS
from mla_jax.serving.constraints import Constraint, Guide

MAX_SEED = 2**31 - 1
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's limit)
MAX_TOP_K = 2**31 - 1  # a step's int32 array holds it (a larger k keeps every token anyway)
MAX_LOGIT_BIAS = 128  # biased tokens per request (a step's arrays hold this many per sequence)
MAX_BIAS = 100.0      # |bias| at most, OpenAI's range


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request samples and when it stops.

  ``temperature`` 0 is greedy; ``top_p`` keeps the smallest set of tokens reaching that mass;
  ``seed`` fixes the request's random draws (None: the engine draws one), so its tokens do not
  depend on what else shares its steps. It stops after ``max_tokens`` new tokens (``"length"``),
  or at a token of ``stop_token_ids`` or a string of ``stop`` in the decoded text
  (``"stop"``; strings need the engine's tokenizer). The stopping token stays in the output.
  ``top_k`` (0: off) and ``min_p`` (0: off) cut the distribution it samples from to the k
  most likely tokens and to those at least ``min_p`` times as likely as the most likely one
  (vLLM's; with temperature 0 they change nothing). ``min_tokens``: stop ids (its own and the
  engine's eos ids) cannot be drawn before that many tokens (stop strings still apply, unlike
  vLLM's).
  ``ignore_eos``: the engine's end-of-sequence ids do not stop it (a benchmark's fixed output
  lengths; ``stop_token_ids`` still do). ``include_stop_str_in_output``: a server's text keeps
  the stop string that ended it (by default it ends before it). ``logit_bias``: ``{token id:
  bias}`` (or pairs), at most ``MAX_LOGIT_BIAS`` ids, each bias in [-100, 100], added to the
  logits before anything else (the stop ids' hold-back, temperature and the cuts; greedy takes
  the argmax of the biased logits); the reported log-probabilities stay the model's.
  ``repetition_penalty`` (> 0, 1: off), ``frequency_penalty`` and ``presence_penalty`` ([-2, 2],
  0: off): vLLM's penalties, after the bias (``mla_jax.decoding.penalties``); not with
  ``speculative_tokens``.
  ``logprobs``: None, or report each output token's log-probability and that many of the most
  likely tokens' (0 to ``MAX_LOGPROBS``), from the model's distribution before temperature
  and top_p. ``prompt_logprobs``: the same for every prompt token after the first (scoring:
  the engine must be built with ``prompt_logprobs=True``); ``max_tokens`` 0 then scores the
  prompt without generating. ``speculative_tokens``: draft tokens per step from the model's MTP layers (0: plain
  decoding; at most the engine's ``max_speculative_tokens``); the tokens keep the model's
  distribution (greedy: the same tokens), only their cost changes.
  ``constraint``: what the output must match (``constraints.Constraint``: a JSON schema, any
  JSON object, a regex, a choice, a grammar), enforced by a token mask inside the step program
  (the engine needs ``structured_outputs=True``); the request stops (``"stop"``) once it is
  complete. A constrained request drafts no tokens (``speculative_tokens`` 0).
  """

  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  stop: tuple[str, ...] = ()
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  speculative_tokens: int = 0
  ignore_eos: bool = False
  include_stop_str_in_output: bool = False
  top_k: int = 0
  min_p: float = 0.0
  min_tokens: int = 0
  logit_bias: tuple[tuple[int, float], ...] = ()
  repetition_penalty: float = 1.0
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  constraint: Constraint | None = None

  @property
  def penalized(self) -> bool:
    """Whether it asks for a repetition, frequency or presence penalty."""
    return self.repetition_penalty != 1 or bool(self.frequency_penalty or self.presence_penalty)

  def __post_init__(self):
    checks.static_int(self.max_tokens, "max_tokens", minimum=0, wrong_type=TypeError)
    for name in ("ignore_eos", "include_stop_str_in_output"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
    SamplingConfig(self.temperature, self.top_p)  # the same checks as generate's
    if self.seed is not None:
      checks.static_int(self.seed, "seed", minimum=0, maximum=MAX_SEED)
    stop_ids = _as_tuple(self.stop_token_ids, "stop_token_ids")
    for token in stop_ids:
      checks.static_int(token, "stop_token_ids entry", minimum=0)
    stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
    if any(not isinstance(s, str) or not s for s in stop):
      raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
    for name in ("logprobs", "prompt_logprobs"):
      if getattr(self, name) is not None:
        checks.static_int(getattr(self, name), name, minimum=0, maximum=MAX_LOGPROBS)
    checks.static_int(self.speculative_tokens, "speculative_tokens", minimum=0,
                      maximum=MAX_SPECULATIVE_TOKENS)
    checks.static_int(self.top_k, "top_k", minimum=0, maximum=MAX_TOP_K)
    if isinstance(self.min_p, bool) or not isinstance(self.min_p, numbers.Real):
      raise TypeError(f"min_p must be a float, got {type(self.min_p).__name__} {self.min_p!r}")
    if not 0 <= self.min_p <= 1:
      raise ValueError(f"min_p must be a float in [0, 1], got {self.min_p!r}")
    checks.static_int(self.min_tokens, "min_tokens", minimum=0, maximum=self.max_tokens)
    object.__setattr__(self, "min_p", float(self.min_p))
    object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))
    for name, valid, where in (("repetition_penalty", lambda v: 0 < v < math.inf, "> 0"),
                               ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
                               ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
      if not valid(value):
        raise ValueError(f"{name} must be a finite float {where}, got {value!r}")
      object.__setattr__(self, name, float(value))
    if self.constraint is not None:
      if not isinstance(self.constraint, Constraint):
        raise TypeError(f"constraint must be a constraints.Constraint, got "
                        f"{type(self.constraint).__name__}")
      if self.speculative_tokens:
        raise ValueError("a constrained request drafts no tokens: speculative_tokens must be "
                         "0 with a constraint")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
    object.__setattr__(self, "stop", stop)
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))


def _checked_bias(bias) -> tuple[tuple[int, float], ...]:
  """``{token id: bias}`` or ``(id, bias)`` pairs as sorted pairs of an int and a float."""
  pairs = tuple(bias.items()) if isinstance(bias, dict) else _as_tuple(bias, "logit_bias")
  if len(pairs) > MAX_LOGIT_BIAS:
    raise ValueError(f"logit_bias holds {len(pairs)} tokens, at most {MAX_LOGIT_BIAS}")
  checked = {}
  for pair in pairs:
    if not isinstance(pair, tuple) or len(pair) != 2:
      raise TypeError(f"logit_bias must map token ids to biases, got entry {pair!r}")
    token, value = pair
    checks.static_int(token, "logit_bias token id", minimum=0)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
        -MAX_BIAS <= value <= MAX_BIAS):
      raise ValueError(f"logit_bias of token {token} must be a number in [-100, 100], got "
                       f"{value!r}")
    if token in checked:
      raise ValueError(f"logit_bias names token {token} twice")
    checked[int(token)] = float(value)
  return tuple(sorted(checked.items()))


def _as_tuple(values, name: str) -> tuple:
  """``values`` (any iterable) as a tuple; a single value or None is a ``TypeError`` naming
  ``name`` rather than Python's anonymous "object is not iterable"."""
  try:
    return tuple(values)
  except TypeError:
    raise TypeError(f"{name} must be a sequence, got {type(values).__name__} {values!r}") from None


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """A token's log-probability and the ``SamplingParams.logprobs`` (or ``prompt_logprobs``)
  most likely tokens' (``top``: ``(token id, log-probability)`` pairs, most likely first);
  ``rank``: 1 + how many tokens are more likely (a prompt token's; None for an output
  token's)."""

  token: int
  logprob: float
  top: tuple[tuple[int, float], ...]
  rank: int | None = None


class Status(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # compared by identity: the scheduler's queues hold them
class Sequence:
  """A request inside the engine. ``tokens`` is prompt + output so far; the cache holds the
  rows of ``tokens[:num_cached]`` in ``pages`` (logical page i at physical ``pages[i]``)."""

  request_id: str
  tokens: list[int]
  num_prompt: int
  params: SamplingParams
  seed: int
  stop_ids: tuple[int, ...] = ()  # the distinct ids that end it (``Engine`` adds its eos ids)
  arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
  status: Status = Status.WAITING
  pages: list[int] = dataclasses.field(default_factory=list)
  page_keys: list = dataclasses.field(default_factory=list)  # chain keys of registered pages
  num_cached: int = 0
  num_cached_prompt: int = 0      # prompt tokens a prefix-cache hit spared on admission
  num_preemptions: int = 0
  finish_reason: str | None = None
  first_token_time: float | None = None
  finish_time: float | None = None
  text: str = ""
  logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # if asked, per output
  # if asked: per prompt token (None for the first, and for those not yet computed)
  prompt_logprobs: list[TokenLogprobs | None] = dataclasses.field(default_factory=list)
  num_scored: int = 0             # prompt rows [0, num_scored) have their next token's entry
  drafts: list[int] = dataclasses.field(default_factory=list)  # the next step verifies these
  detok: IncrementalText | None = None  # its output's text as it grows (with a tokenizer)
  num_drafted: int = 0            # draft tokens verified so far
  num_accepted: int = 0           # of which accepted

  slot: int | None = None         # its persistent slot while running (step inputs, last token)
  state_src: int | None = None    # a prefix hit's snapshot its next step reads its state from
  admissions: int = 0             # times admitted (a preempted one returns with new pages)
  num_pending: int = 0            # tokens sampled by a step in flight, not read yet
  guide: Guide | None = None      # its constraint's matcher and next mask (``constraints``)

  @property
  def output(self) -> list[int]:
    return self.tokens[self.num_prompt:]

  @property
  def num_output(self) -> int:
    """Tokens generated, those in flight included."""
    return len(self.tokens) + self.num_pending - self.num_prompt

  @property
  def num_uncomputed(self) -> int:
    return len(self.tokens) + self.num_pending - self.num_cached


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """One request as the engine reports it: after a step (``new_tokens`` of that step) or at the
  end. Times are ``time.perf_counter`` seconds; ``ttft`` is time to first token."""

  request_id: str
  prompt_tokens: tuple[int, ...]
  tokens: tuple[int, ...]
  new_tokens: tuple[int, ...]
  finished: bool
  finish_reason: str | None
  text: str
  arrival_time: float
  first_token_time: float | None
  finish_time: float | None
  num_cached_prompt_tokens: int
  num_preemptions: int
  logprobs: tuple[TokenLogprobs, ...] | None = None  # per output token, when asked
  # per prompt token, when asked (None for the first)
  prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
  num_draft_tokens: int = 0       # speculative decoding: draft tokens verified
  num_accepted_tokens: int = 0    # and accepted

  @property
  def acceptance_rate(self) -> float | None:
    """Accepted draft tokens / verified ones (None when none was drafted)."""
    return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

  @property
  def ttft(self) -> float | None:
    return None if self.first_token_time is None else self.first_token_time - self.arrival_time

  @classmethod
  def of(cls, seq: Sequence, num_new: int = 0) -> RequestOutput:
    """``seq`` as it is now, its last ``num_new`` tokens new. Its token and log-probability
    lists are taken as ``Snapshot`` views (they only ever grow), so an update costs the same
    however long the request has run (and its fields are set in one go: a frozen dataclass's
    ``__init__`` sets them one by one, four times slower, once per request and step)."""
    end = len(seq.tokens)
    params = seq.params
    out = object.__new__(cls)
    out.__dict__.update(
        request_id=seq.request_id, prompt_tokens=Snapshot(seq.tokens, 0, seq.num_prompt),
        tokens=Snapshot(seq.tokens, seq.num_prompt, end),
        new_tokens=tuple(seq.tokens[end - num_new:end]), finished=seq.status is Status.FINISHED,
        finish_reason=seq.finish_reason, text=seq.text, arrival_time=seq.arrival_time,
        first_token_time=seq.first_token_time, finish_time=seq.finish_time,
        num_cached_prompt_tokens=seq.num_cached_prompt, num_preemptions=seq.num_preemptions,
        logprobs=None if params.logprobs is None else Snapshot(seq.logprobs, 0,
                                                              len(seq.logprobs)),
        prompt_logprobs=(None if params.prompt_logprobs is None else
                         tuple(seq.prompt_logprobs)),
        num_draft_tokens=seq.num_drafted, num_accepted_tokens=seq.num_accepted)
    return out


class Snapshot(collections.abc.Sequence):
  """``items[start:stop]`` of a list that only grows, without copying it: a read-only sequence
  equal to the tuple it stands for."""

  __slots__ = ("_items", "_start", "_stop")

  def __init__(self, items: list, start: int, stop: int):
    self._items, self._start, self._stop = items, start, stop

  def __len__(self) -> int:
    return self._stop - self._start

  def __getitem__(self, index):
    return tuple(self)[index] if isinstance(index, slice) else self._items[
        self._start + range(len(self))[index]]

  def __iter__(self):
    return iter(self._items[self._start:self._stop])

  def __eq__(self, other) -> bool:
    if isinstance(other, (tuple, list, Snapshot)):
      return tuple(self) == tuple(other)
    return NotImplemented

  __hash__ = None

  def __add__(self, other):
    return tuple(self) + tuple(other)

  def __radd__(self, other):
    return other + (list if isinstance(other, list) else tuple)(self)

  def __repr__(self) -> str:
    return repr(tuple(self))
