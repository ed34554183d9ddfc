"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a choice
among strings, or a grammar) as the set of tokens it allows next, through llguidance.

llguidance (a Rust core with Python bindings and no Python dependencies; one of vLLM's two
backends, and what OpenAI's own JSON-schema outputs run on) compiles a constraint to a grammar,
and a matcher per request walks it token by token over the engine's tokenizer (a checkpoint's
``tokenizer.json``, or the byte tokenizer of the shipped models). ``Grammars`` compiles and
checks constraints for one engine (once each: a cache); ``Guide`` is one request's matcher and
the bitmask of the tokens it allows next (bit ``t % 32`` of word ``t // 32``, as llguidance
writes it), which the step program applies to the request's logits before sampling
(``decoding.logits.Adjustments``). Every token the request takes advances its guide
(``Guide.advance``), which computes the next mask at once: a request whose constraint is
complete stops (``"stop"``), and one that no token can continue stops with
``DEAD_END`` rather than sampling from an empty mask.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading

import numpy as np

from mla_jax import checks

logger = logging.getLogger("mla_jax")

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 65_536  # a schema's JSON text, a regex, a grammar, or the choices
MAX_CHOICES = 1024
DEAD_END = "dead_end"  # the finish reason of a request no token can continue
# JSON as ``json.dumps`` writes it: no free whitespace, which a weak model can repeat until
# max_tokens (vLLM's ``disable_any_whitespace``).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's resource limits, set here (its defaults but for the grammar size): a constraint
# past one is refused when checked, naming it; one met while decoding ends the request
# (``DEAD_END``).
LIMITS = dict(max_grammar_size=200_000, max_lexer_states=250_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_items_in_row=2000, verbose_errors=False)
NO_TOKEN = "no token of the vocabulary continues the constraint"


class ConstraintError(ValueError):
  """A constraint the library refuses (bad schema, regex or grammar), or one past a limit."""


@dataclasses.dataclass(frozen=True)
class Constraint:
  """What a request's output must match (``SamplingParams.constraint``).

  ``kind``: one of ``KINDS``; ``value``: the JSON schema's text (``json_schema``; the class
  method takes a dict), the regex, the choices (a tuple of strings), the grammar (llguidance's
  Lark, or GBNF), or nothing (``json_object``). ``field``: what an error calls it (the
  server's request field).
  """

  kind: str
  value: str | tuple[str, ...] = ""
  field: str = "constraint"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"{self.field}: the kind must be one of {', '.join(KINDS)}, got "
                       f"{self.kind!r}")
    if self.kind == "choice":
      choices = self.value
      if (isinstance(choices, str) or not isinstance(choices, (tuple, list)) or not choices
          or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"{self.field}: the choices must be a non-empty list of non-empty "
                         f"strings, got {_short(choices)}")
      if len(choices) > MAX_CHOICES:
        raise ValueError(f"{self.field}: {len(choices)} choices, over the limit of "
                         f"{MAX_CHOICES} (constraints.MAX_CHOICES)")
      object.__setattr__(self, "value", tuple(choices))
    elif not isinstance(self.value, str) or (not self.value and self.kind != "json_object"):
      raise ValueError(f"{self.field}: a {self.kind} constraint needs a non-empty string, got "
                       f"{_short(self.value)}")
    size = (sum(map(len, self.value)) if isinstance(self.value, tuple) else len(self.value))
    if size > MAX_CONSTRAINT_CHARS:
      raise ValueError(f"{self.field}: the constraint holds {size} characters, over the limit "
                       f"of {MAX_CONSTRAINT_CHARS} (constraints.MAX_CONSTRAINT_CHARS)")

  @classmethod
  def json_schema(cls, schema: dict | str, field: str = "constraint") -> Constraint:
    """A JSON schema (a dict, or its JSON text)."""
    if isinstance(schema, str):
      try:
        schema = json.loads(schema)
      except ValueError as e:
        raise ValueError(f"{field}: the schema is not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
      raise ValueError(f"{field}: a JSON schema must be an object, got {_short(schema)}")
    return cls("json_schema", json.dumps(schema, ensure_ascii=False), field)

  def grammar(self) -> str:
    """llguidance's grammar of the constraint (not checked yet: ``Grammars.check``)."""
    import llguidance

    matcher = llguidance.LLMatcher
    if self.kind in ("json_schema", "json_object"):
      schema = self.value if self.kind == "json_schema" else '{"type": "object"}'
      try:
        return matcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
      except ValueError as e:
        raise ConstraintError(f"{self.field}: {e}") from None
    if self.kind == "regex":
      return matcher.grammar_from_regex(self.value)
    if self.kind == "choice":
      return matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, self.value)))
    try:  # Lark as llguidance takes it, or GBNF (llama.cpp's), converted to it
      return llguidance.grammar_from("grammar", self.value)
    except ValueError as e:
      raise ConstraintError(f"{self.field}: {e}") from None


class Guide:
  """One request's matcher and ``mask_W``, the bitmask of the tokens it allows next (int32
  words over the model's vocabulary; ids the tokenizer lacks are never allowed)."""

  def __init__(self, matcher, words: int, tokenizer_words: int):
    self.matcher = matcher
    self.mask_W = np.zeros(words, np.int32)
    self._scratch = self.mask_W[:tokenizer_words]  # what llguidance writes (a view)
    self.error: str | None = None
    self._refresh()

  def _refresh(self) -> bool:
    """Computes the next mask; False (``error`` set) when the matcher failed or allows no
    token."""
    self.matcher.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
    if self.matcher.is_error():
      message = self.matcher.get_error().strip().split("\n")[0]
      self.error = (f"{NO_TOKEN} (llguidance: {message})" if message.startswith("NoExtension")
                    else f"llguidance: {message}")
    elif not self._scratch.any():
      self.error = NO_TOKEN
    return self.error is None

  def advance(self, token: int) -> str | None:
    """Takes the request's new token: "stop" once the constraint is complete, ``DEAD_END``
    when it cannot continue (``error`` says why), else None (``mask_W`` is the next one)."""
    if not self.matcher.consume_token(int(token)):
      message = self.matcher.get_error().strip().split("\n")[0]
      self.error = f"token {token} is outside the constraint (llguidance: {message})"
    elif self.matcher.is_stopped():
      return "stop"
    elif self._refresh():
      return None
    return DEAD_END


class Grammars:
  """Constraints compiled for one tokenizer and vocabulary: ``check`` (once per constraint,
  cached; any thread) and ``guide`` (a new request's ``Guide``).

  ``tokenizer``: the engine's (``HFTokenizer`` or ``ByteTokenizer``); ``eos_ids``: the ids
  that end a request, which a constraint allows once it may end.
  """

  CACHE_SIZE = 256

  def __init__(self, tokenizer, vocab_size: int, eos_ids):
    self.vocab_size = checks.static_int(vocab_size, "vocab_size", minimum=1)
    self.tokenizer = _ll_tokenizer(tokenizer, vocab_size, tuple(eos_ids))
    self.words = -(-vocab_size // 32)
    self._tokenizer_words = min(self.words, -(-self.tokenizer.vocab_size // 32))
    self._lock = threading.Lock()
    self._checked: dict[tuple[str, str | tuple[str, ...]], str] = {}

  @functools.cached_property
  def _limits(self):
    import llguidance

    return llguidance.LLParserLimits(**LIMITS)

  def check(self, constraint: Constraint) -> str:
    """The constraint's grammar, checked: a ``ConstraintError`` naming its field and the
    problem (what llguidance says: a bad schema, regex or grammar, a limit met, or no first
    token in this vocabulary)."""
    import llguidance

    key = (constraint.kind, constraint.value)
    with self._lock:
      if key in self._checked:
        return self._checked[key]
    grammar = constraint.grammar()
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, self.tokenizer, limits=self._limits)
    if failed:
      raise ConstraintError(f"{constraint.field}: {_one_line(messages[0])}")
    guide = self._guide(grammar)
    if guide.error is not None:
      raise ConstraintError(f"{constraint.field}: {guide.error}")
    with self._lock:
      if len(self._checked) >= self.CACHE_SIZE:
        self._checked.pop(next(iter(self._checked)))
      self._checked[key] = grammar
    return grammar

  def guide(self, constraint: Constraint) -> Guide:
    """A new request's guide (its constraint checked first, if it was not)."""
    return self._guide(self.check(constraint))

  def _guide(self, grammar: str) -> Guide:
    import llguidance

    matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
    return Guide(matcher, self.words, self._tokenizer_words)


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
  """llguidance's view of the engine's tokenizer: a ``tokenizer.json`` as it is, the byte
  tokenizer as its 256 bytes and three special tokens."""
  import llguidance

  from mla_jax.tokenizer import ByteTokenizer, HFTokenizer

  eos = list(eos_ids or getattr(tokenizer, "eos_ids", ()))
  if not eos:
    raise ValueError("structured outputs need an end-of-sequence id (the engine's "
                     "eos_token_ids, or the tokenizer's): a constraint allows it once complete")
  if isinstance(tokenizer, HFTokenizer):
    return llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size,
                                  eos_token=eos)
  if isinstance(tokenizer, ByteTokenizer):
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(eos[0])),
                                  eos_token=eos)
  raise TypeError(f"structured outputs need an HFTokenizer or a ByteTokenizer "
                  f"(mla_jax.tokenizer), got {type(tokenizer).__name__}")


class _ByteTokens:
  """The byte tokenizer as llguidance's ``TokenizerWrapper`` reads one."""

  def __init__(self, eos_id: int):
    from mla_jax.tokenizer import ByteTokenizer

    self.eos_token_id, self.bos_token_id = eos_id, ByteTokenizer.BOS_ID
    self.tokens = [bytes([b]) for b in range(256)] + [b"<s>", b"</s>", b"<pad>"]
    self.special_token_ids = [ByteTokenizer.BOS_ID, ByteTokenizer.EOS_ID, ByteTokenizer.PAD_ID]

  def __call__(self, text: bytes | str) -> list[int]:
    return list(text.encode() if isinstance(text, str) else text)


def _one_line(message: str, limit: int = 400) -> str:
  """llguidance's message (several lines: the grammar quoted, a caret) on one line."""
  text = " ".join(message.split()) or "invalid constraint"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def fill_masks(chunks, allowed_SW: np.ndarray) -> None:
  """A masked step's bitmasks: step slot s takes its chunk's request's next mask where the
  chunk samples under a constraint (the other rows keep every bit set, as does the wasted row
  of a request that finished in the step before)."""
  for s, chunk in enumerate(chunks):
    if chunk.samples and chunk.seq.guide is not None and chunk.seq.finish_reason is None:
      allowed_SW[s] = chunk.seq.guide.mask_W
