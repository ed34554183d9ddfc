"""Constraints to token masks (``serving.constraints``) and forced tool calls
(``serving.forced_calls``), without a model: the masks against llguidance's own matcher on
random token walks over both of the project's tokenizers, the device's unpacking of them
against NumPy, the checks' errors, dead ends, and forced calls in DSML and GLM that parse back
as valid calls."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from mla_jax.decoding.logits import allowed_rows
from mla_jax.serving.constraints import (DEAD_END, MAX_CONSTRAINT_CHARS, Constraint,
                                         ConstraintError, Grammars)
from mla_jax.serving.forced_calls import call_constraint
from mla_jax.serving.scheduler import Chunk
from mla_jax.serving.sequence import SamplingParams, Sequence
from mla_jax.serving.step_inputs import Buckets, StepShape
from mla_jax.serving.tool_parsers import TOOL_PARSERS
from mla_jax.tokenizer import ByteTokenizer, HFTokenizer

VOCAB = 300  # the model's: more ids than either tokenizer has (they are never allowed)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["x", "yz"]}}}, "required": ["name"]}
CONSTRAINTS = [Constraint.json_schema(SCHEMA), Constraint("json_object"),
               Constraint("regex", r"(ab|cd)+[0-9]{2,4}"),
               Constraint("choice", ("hello world", "the quick", "brown fox")),
               Constraint("grammar", 'start: "f(" ARG ("," ARG)* ")"\nARG: /[a-z]+/'),
               Constraint("grammar", 'root ::= "v" [0-9]+')]  # GBNF, converted


def _bpe(path, alphabet=None, vocab_size=200) -> HFTokenizer:
  """A byte-level BPE ``tokenizer.json`` trained here (multi-byte tokens, special tokens),
  with ``alphabet`` its only bytes when given."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  initial = pre_tokenizers.ByteLevel.alphabet() if alphabet is None else list(alphabet)
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=initial,
                                special_tokens=["<bos>", "<eos>", "<tool_call>"],
                                limit_alphabet=len(initial))
  text = ['{"name": "abc", "n": 12, "tags": ["x", "yz"]}', "hello world the quick brown fox"]
  tok.train_from_iterator(text * 50, trainer)
  tok.add_special_tokens([AddedToken("<bos>", special=True), AddedToken("<eos>", special=True)])
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
  return HFTokenizer(path)


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def grammars(request, tmp_path_factory):
  tok = ByteTokenizer() if request.param == "bytes" else _bpe(tmp_path_factory.mktemp("bpe"))
  return Grammars(tok, VOCAB, tok.eos_ids)


def _allowed(mask_W) -> np.ndarray:
  return np.unpackbits(np.asarray(mask_W).view(np.uint8), bitorder="little")[:VOCAB]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_masks_equal_the_library_matcher_on_random_walks(grammars, constraint):
  """At every token of random walks, the guide's mask allows exactly the tokens llguidance's
  own matcher (fed the same tokens) validates, no id past the tokenizer's, and the step
  program's unpacking of it (``allowed_rows``) is the same bits."""
  rng = np.random.default_rng(0)
  grammar = grammars.check(constraint)
  size = grammars.tokenizer.vocab_size
  for _ in range(3):
    guide = grammars.guide(constraint)
    reference = llguidance.LLMatcher(grammars.tokenizer, grammar)
    reason = None
    for _ in range(12):
      allowed = _allowed(guide.mask_W)
      expected = [t < size and reference.validate_tokens([t]) == 1 for t in range(VOCAB)]
      np.testing.assert_array_equal(allowed, expected)
      np.testing.assert_array_equal(
          np.asarray(allowed_rows(guide.mask_W[None], VOCAB))[0], allowed)
      token = int(rng.choice(np.flatnonzero(allowed)))
      reason = guide.advance(token)
      assert reference.consume_token(token)
      if reason is not None:
        break
    assert reason in (None, "stop") and guide.error is None


def test_a_complete_constraint_stops():
  grammars = Grammars(ByteTokenizer(), 260, (ByteTokenizer.EOS_ID,))
  guide = grammars.guide(Constraint("choice", ("yes", "no")))
  assert np.flatnonzero(_allowed(guide.mask_W)).tolist() == [ord("n"), ord("y")]
  assert [guide.advance(t) for t in b"yes"] == [None, None, "stop"]
  guide = grammars.guide(Constraint("regex", "ab?"))  # may end after "a": EOS allowed
  assert guide.advance(ord("a")) is None
  assert np.flatnonzero(_allowed(guide.mask_W)).tolist() == [ord("b"), ByteTokenizer.EOS_ID]
  assert guide.advance(ByteTokenizer.EOS_ID) == "stop"


def test_a_constraint_no_token_continues_is_a_dead_end(tmp_path):
  """A tokenizer without digits: a constraint that needs one first is refused when checked;
  one that needs it later stops there (``DEAD_END``, saying why) instead of sampling from an
  empty mask."""
  tok = _bpe(tmp_path, alphabet="abcdefghijklmnopqrstuvwxyz ", vocab_size=60)
  grammars = Grammars(tok, 64, tok.eos_ids)
  with pytest.raises(ConstraintError, match="no token of the vocabulary continues"):
    grammars.check(Constraint("regex", "[0-9]+"))
  guide = grammars.guide(Constraint("regex", "a[0-9]"))
  assert guide.advance(tok.encode("a", add_special_tokens=False)[0]) == DEAD_END
  assert "no token of the vocabulary continues" in guide.error
  guide = grammars.guide(Constraint("regex", "a[0-9]"))
  assert guide.advance(tok.encode("b", add_special_tokens=False)[0]) == DEAD_END  # refused
  assert guide.error


@pytest.mark.parametrize("constraint, words", [
    (Constraint.json_schema({"type": "foo"}, "response_format"), "response_format: Invalid type"),
    (Constraint.json_schema({"properties": {"a": {"$ref": "#/nope"}}}), "/nope"),
    (Constraint("regex", "a(b", "guided_regex"), "guided_regex: .*unclosed group"),
    (Constraint("grammar", "start: x y"), 'unknown name: "x"'),
    (Constraint("grammar", 'root ::= "a" b'), "Rule 'b' not found"),
], ids=["schema", "ref", "regex", "lark", "gbnf"])
def test_bad_constraints_are_refused_naming_the_problem(constraint, words):
  with pytest.raises(ConstraintError, match=words):
    Grammars(ByteTokenizer(), 260, (257,)).check(constraint)


def test_constraints_past_the_limits_are_refused_naming_them():
  with pytest.raises(ValueError, match=f"over the limit of {MAX_CONSTRAINT_CHARS}"):
    Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1))
  with pytest.raises(ValueError, match="over the limit of 1024"):
    Constraint("choice", tuple(map(str, range(1025))))
  with pytest.raises(ValueError, match="non-empty list"):
    Constraint("choice", ())
  with pytest.raises(ValueError, match="kind must be one of"):
    Constraint("xml", "<a/>")
  with pytest.raises(ValueError, match="schema is not JSON"):
    Constraint.json_schema("{nope")
  with pytest.raises(ValueError, match="drafts no tokens"):
    SamplingParams(constraint=Constraint("regex", "a"), speculative_tokens=1)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["c", "f"]},
        "extra": {"type": "object", "properties": {"x": {"type": "boolean"}},
                  "required": ["x"], "additionalProperties": False}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


def _walk(guide, rng, prefix=b"", steps=800) -> tuple[str, str | None]:
  """Random allowed tokens after ``prefix`` (spelled), until the guide stops."""
  tokens, pending, reason = [], list(prefix), None
  while reason is None and len(tokens) < steps:
    token = pending.pop(0) if pending else int(rng.choice(np.flatnonzero(_allowed(
        guide.mask_W))))
    tokens.append(token)
    reason = guide.advance(token)
  return ByteTokenizer().decode(tokens), reason


@pytest.mark.parametrize("parser", ["deepseek_v32", "deepseek_v4", "glm45"])
def test_forced_calls_parse_as_valid_calls(parser):
  """Random walks under a forced call's grammar end (the grammar complete) in text that the
  parser reads as calls of the offered tools with arguments valid under their schemas: one
  of the named function; one or more under "required" (one without parallel calls); after
  free reasoning when the prompt opened <think>. A free-text argument ends at its closing
  tag."""
  grammars = Grammars(ByteTokenizer(), 260, (257,))
  rng = np.random.default_rng(1)
  tools = [WEATHER, CLOCK]
  seen = set()
  for options, prefix in [({"name": "get_weather"}, b""), ({}, b""), ({"parallel": False}, b""),
                          ({"reasoning": True}, b"hmm, a tool</think>")]:
    for _ in range(4):
      text, reason = _walk(grammars.guide(call_constraint(parser, tools, **options)), rng,
                           prefix)
      assert reason == "stop", text
      content, calls = TOOL_PARSERS[parser](tools).parse(text.split("</think>")[-1])
      assert content == "" and calls, text
      if "name" in options or "parallel" in options:
        assert len(calls) == 1
      for call in calls:
        name = call["function"]["name"]
        assert name == options.get("name", name)
        tool = WEATHER if name == "get_weather" else CLOCK
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            tool["function"]["parameters"])
        seen.add((name, len(calls)))
  assert {"get_weather", "now"} <= {name for name, _ in seen}
  # A free-text value: anything up to the closing tag.
  spelled = {"glm45": b"<tool_call>note<arg_key>text</arg_key><arg_value>a <b> c",
             "deepseek_v32": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="note">\n'
                             '<｜DSML｜parameter name="text" string="true">a <b> c'.encode(),
             "deepseek_v4": '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="note">\n'
                            '<｜DSML｜parameter name="text" string="true">a <b> c'.encode()}
  guide = grammars.guide(call_constraint(parser, [NOTE], name="note"))
  text, reason = _walk(guide, rng, spelled[parser], steps=len(spelled[parser]))
  assert reason is None  # the value goes on until its tag comes
  end = {"glm45": "</arg_value></tool_call>",
         "deepseek_v32": "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
         "deepseek_v4": "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"}
  assert [guide.advance(t) for t in end[parser].encode()][-1] == "stop"
  _, calls = TOOL_PARSERS[parser]([NOTE]).parse(text + end[parser])
  assert json.loads(calls[0]["function"]["arguments"]) == {"text": "a <b> c"}


def test_a_tag_spelled_as_a_special_token_is_required_as_that_token(tmp_path):
  """GLM-5's tokenizer has ``<tool_call>`` as one special token: the grammar asks for that
  token (the model's own spelling), not for its text."""
  tok = _bpe(tmp_path)
  grammars = Grammars(tok, VOCAB, tok.eos_ids)
  special = tok.special_ids()
  guide = grammars.guide(call_constraint("glm45", [CLOCK], special=special))
  assert np.flatnonzero(_allowed(guide.mask_W)).tolist() == [special["<tool_call>"]]


def test_every_masked_step_has_a_warmed_program():
  """A step that samples a constrained request runs a masked FULL program of the warm-up's,
  also when it scores a prompt beside it; a step without one runs no masked program; the
  shape travels in a step's header (several processes)."""
  buckets = Buckets(64, 4, 8, 16, scores=True, masked=True)
  warmed = set(buckets.all_shapes())

  def chunk(params):
    return Chunk.of(Sequence("r", [1, 2, 3], 3, params, 0), 3)

  constrained = chunk(SamplingParams(constraint=Constraint("regex", "a")))
  scored, plain = chunk(SamplingParams(prompt_logprobs=1)), chunk(SamplingParams())
  for chunks, masked in [([constrained], True), ([plain, constrained, scored], True),
                         ([plain], False), ([plain, scored], True)]:
    shape = buckets.shape(chunks)
    assert shape.masked == masked and shape in warmed
    assert StepShape.from_header(shape.header()) == shape
  assert not any(s.masked for s in Buckets(64, 4, 8, 16, scores=True).all_shapes())
