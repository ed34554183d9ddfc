"""Structured outputs in the engine, on the shipped recall model: constrained requests decode
valid answers (a forced GLM tool call here; JSON, regexes, choices and grammars through the
server in ``tests/test_server_structured.py``), a step that samples a constrained request runs
a masked program and is settled before the next is dispatched, other requests keep their
tokens beside them, and a dead end stops with its reason."""

from __future__ import annotations

import json

import jax.numpy as jnp
import jsonschema
import pytest

from mla_jax import presets
from mla_jax.checkpoints import load_pretrained
from mla_jax.serving import Engine, SamplingParams
from mla_jax.serving.constraints import DEAD_END, Constraint
from mla_jax.serving.forced_calls import call_constraint
from mla_jax.serving.tool_parsers import Glm45ToolParser
from mla_jax.tokenizer import ByteTokenizer
from tests.serving.test_constraints import WEATHER, CLOCK, _bpe

PROMPTS = ["aQ ..kX zB ...mP rT ..wE cV ?k", "zB ..mP ?z", "aQ cV ?c"]
SETTINGS = dict(num_pages=32, page_size=16, max_num_seqs=4, max_step_tokens=16,
                decode_steps=1, log_interval=None)  # few programs to compile


@pytest.fixture(scope="module")
def model():
  return load_pretrained(presets.RECALL_CHECKPOINT, dtype=jnp.float32, backend="xla")


@pytest.fixture(scope="module")
def engine(model):
  tok = ByteTokenizer()
  return Engine(model, tokenizer=tok, eos_token_ids=tok.eos_ids, structured_outputs=True,
                **SETTINGS)


def test_a_forced_glm_call_is_a_valid_call(engine):
  tools = [WEATHER, CLOCK]
  constraint = call_constraint("glm45", tools, name="get_weather")
  for sampling in (dict(temperature=0), dict(temperature=1, seed=1), dict(temperature=1, seed=2)):
    (out,) = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=320, constraint=constraint,
                                                        **sampling))
    assert out.finish_reason == "stop"
    content, calls = Glm45ToolParser(tools).parse(out.text)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]),
                        WEATHER["function"]["parameters"])


def test_constrained_steps_run_masked_and_settle_before_the_next(engine):
  """Beside unconstrained requests (whose tokens stay an engine's without constraints'), a
  constrained one: each step that samples it runs a masked program and is read before the
  next step is dispatched (its next mask needs its token; the next is built meanwhile); steps
  without it run ahead unmasked."""
  plain = SamplingParams(max_tokens=12)
  expected = [list(o.tokens) for o in engine.generate(PROMPTS, plain)]
  events = []
  dispatch = engine.runner.dispatch

  def recorded(shape, inputs):
    flight = dispatch(shape, inputs)
    n = len([e for e in events if e[0] == "dispatch"])
    allowed = inputs.inputs.allowed_SW
    events.append(("dispatch", n, shape.masked, None if allowed is None else allowed.copy()))
    read = flight.read
    flight.read = lambda: events.append(("read", n)) or read()
    return flight

  engine.runner.dispatch = recorded
  try:
    choice = SamplingParams(max_tokens=12, constraint=Constraint("choice", ("blue", "red")))
    outputs = engine.generate(PROMPTS, [plain, choice, plain])
  finally:
    del engine.runner.dispatch
  assert [list(outputs[i].tokens) for i in (0, 2)] == [expected[0], expected[2]]
  assert outputs[1].text in ("blue", "red") and outputs[1].finish_reason == "stop"
  order = {e[:2]: i for i, e in enumerate(events)}
  masked = [e[1] for e in events if e[0] == "dispatch" and e[2]]
  # One masked step per constrained token, and one more: built while the step of its last
  # token ran, it holds that request's row (wasted, as after a stop id).
  assert len(masked) == len(outputs[1].tokens) + 1
  assert masked == list(range(masked[0], masked[0] + len(masked)))
  for n in masked[1:]:
    assert order["read", n - 1] < order["dispatch", n]
  for n in masked[:-1]:
    allowed_SW = next(e[3] for e in events if e[:2] == ("dispatch", n))
    assert ((allowed_SW != -1).sum(axis=1) > 0).sum() == 1  # its row's mask; others all ones
  unmasked = [e[1] for e in events if e[0] == "dispatch" and not e[2]]
  assert any(order["dispatch", n + 1] < order["read", n] for n in unmasked
             if ("dispatch", n + 1) in order)


def test_a_dead_end_stops_with_its_reason(model, tmp_path):
  """A tokenizer without digits, and a regex that needs one after an "a": the request takes
  the "a" and stops there (``dead_end``), rather than sampling from an empty mask; a
  constraint whose first token no token can be is refused before it is queued."""
  tok = _bpe(tmp_path, alphabet="abcdefghijklmnopqrstuvwxyz ", vocab_size=60)
  engine = Engine(model, tokenizer=tok, eos_token_ids=tok.eos_ids, structured_outputs=True,
                  **SETTINGS)
  (out,) = engine.generate(["hello"], SamplingParams(
      max_tokens=8, temperature=1, seed=0, constraint=Constraint("regex", "a[0-9]")))
  assert out.finish_reason == DEAD_END and out.text == "a"
  with pytest.raises(ValueError, match="no token of the vocabulary continues"):
    engine.add_request("hello", SamplingParams(constraint=Constraint("regex", "[0-9]")))
  assert not engine.has_unfinished()


def test_constraints_need_an_engine_that_serves_them(model):
  engine = Engine(model, **SETTINGS)
  with pytest.raises(ValueError, match="serves no structured outputs"):
    engine.add_request([1, 2], SamplingParams(constraint=Constraint("regex", "a")))
  with pytest.raises(ValueError, match="needs the engine's tokenizer"):
    Engine(model, structured_outputs=True, **SETTINGS)
