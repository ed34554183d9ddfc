"""Structured outputs through ``mla-jax serve`` (one subprocess, the ``openai`` client): OpenAI's
``response_format``, vLLM's ``structured_outputs`` and ``guided_*`` (through ``extra_body``),
forced tool calls in DSML, ``parallel_tool_calls`` and ``chat_template_kwargs``.

The shipped recall model knows no JSON: unconstrained, it answers with letters (checked here,
so that the constrained answers' validity is the constraint's doing), and every constrained
answer is valid, streamed or not, greedy or sampled over several seeds.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from mla_jax.serving.tool_parsers import DeepSeekV32ToolParser
from tests.test_server import Server, recall_checkpoint

MODEL = "recall-structured"
# Tools listed, the messages, then <think> opened when the client sets ``thinking``
# (chat_template_kwargs).
TEMPLATE = ("{{ bos_token }}{% if tools %}T:{% for t in tools %}{{ t.function.name }};"
            "{% endfor %}{% endif %}{% for m in messages %}{{ m.role }}:{{ m.content }};"
            "{% endfor %}{% if thinking %}<think>{% endif %}")
ASK = [{"role": "user", "content": "aQ ..kX zB ...mP rT ..wE cV ?k"}]
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["id", "ok", "color"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma"]
GRAMMAR = 'start: "x=" NUM ("," NUM)?\nNUM: /[1-9][0-9]?/'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
SAMPLINGS = [dict(temperature=0)] + [dict(temperature=1, seed=s) for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = Server(recall_checkpoint(tmp_path_factory, MODEL, TEMPLATE), "--no-warmup")  # the default deepseek_v32 parsers (the model_type's)
  yield s
  code, _, err = s.stop()
  assert code == 0, err


def _texts(client, chat: bool, stream: bool, **args) -> list[tuple[str, str]]:
  """(text, finish reason) of each choice, streamed or not, through chat or completions."""
  if chat:
    out = client.chat.completions.create(model=MODEL, messages=ASK, stream=stream, **args)
  else:  # the client's completions take response_format as an extra field (vLLM's too)
    if "response_format" in args:
      args["extra_body"] = {**args.get("extra_body", {}),
                            "response_format": args.pop("response_format")}
    out = client.completions.create(model=MODEL, prompt=ASK[0]["content"], stream=stream,
                                    **args)
  if not stream:
    return [((c.message.content if chat else c.text), c.finish_reason) for c in out.choices]
  texts, reasons = {}, {}
  for chunk in out:
    for c in chunk.choices:
      piece = (c.delta.content if chat else c.text) or ""
      texts[c.index] = texts.get(c.index, "") + piece
      reasons[c.index] = c.finish_reason or reasons.get(c.index)
  return [(texts[i], reasons[i]) for i in sorted(texts)]


def _valid_json(text: str) -> bool:
  try:
    jsonschema.validate(json.loads(text), SCHEMA)
  except (ValueError, jsonschema.ValidationError):
    return False
  return True


def test_unconstrained_answers_are_not_valid(server):
  """The control: the same requests without a constraint match none of them."""
  client = server.client()
  for sampling in SAMPLINGS[:2]:
    for chat in (True, False):
      (text, _), = _texts(client, chat, False, max_tokens=24, **sampling)
      assert text and not _valid_json(text) and not re.fullmatch(REGEX, text), text
      assert text not in CHOICES and not text.startswith("x=")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_response_format_json_schema_and_json_object(server, stream):
  client = server.client()
  for sampling in SAMPLINGS:
    for chat in (True, False):
      for text, reason in _texts(client, chat, stream, max_tokens=64,
                                 response_format=RESPONSE_FORMAT, n=2, **sampling):
        assert reason == "stop" and _valid_json(text), (text, reason, sampling)
      (text, reason), = _texts(client, chat, stream, max_tokens=64,
                               response_format={"type": "json_object"}, **sampling)
      assert reason in ("stop", "length") and text.startswith("{"), text
      if reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_and_guided_names_through_extra_body(server):
  client = server.client()
  cases = [({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
           ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
           ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
           ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
           ({"structured_outputs": {"grammar": GRAMMAR}},
            lambda t: re.fullmatch(r"x=[1-9][0-9]?(,[1-9][0-9]?)?", t)),
           ({"guided_grammar": GRAMMAR},
            lambda t: re.fullmatch(r"x=[1-9][0-9]?(,[1-9][0-9]?)?", t)),
           ({"structured_outputs": {"json": SCHEMA}}, _valid_json),
           ({"guided_json": json.dumps(SCHEMA)}, _valid_json)]
  for extra, valid in cases:
    for sampling, stream in zip(SAMPLINGS, (False, True, False, True)):
      for text, reason in _texts(client, True, stream, max_tokens=64, extra_body=extra,
                                 **sampling):
        assert reason == "stop" and valid(text), (extra, sampling, text, reason)


def _call_args(call, tool) -> dict:
  args = json.loads(call.function.arguments)
  jsonschema.validate(args, tool["function"]["parameters"])
  return args


def test_forced_tool_calls_in_dsml(server):
  """``tool_choice`` "required" and a named function: a valid call of an offered tool
  (arguments valid under its schema) in DeepSeek-V3.2's DSML, parsed back as a tool call;
  ``parallel_tool_calls: false`` keeps one; streamed, the deltas add up to the same call."""
  client = server.client()
  base = dict(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=400)
  for sampling in SAMPLINGS:
    named = client.chat.completions.create(
        **base, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **sampling)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and _call_args(call, WEATHER)
    required = client.chat.completions.create(**base, tool_choice="required",
                                              parallel_tool_calls=False, **sampling)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _call_args(call, WEATHER if call.function.name == "get_weather" else CLOCK)
  chunks = list(client.chat.completions.create(
      **base, tool_choice={"type": "function", "function": {"name": "get_weather"}},
      temperature=0, stream=True))
  deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
  assert deltas[0].function.name == "get_weather"
  args = json.loads("".join(d.function.arguments or "" for d in deltas))
  jsonschema.validate(args, WEATHER["function"]["parameters"])
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
  # Unforced (auto), the model writes no call.
  auto = client.chat.completions.create(**base, temperature=0)
  assert not auto.choices[0].message.tool_calls
  assert DeepSeekV32ToolParser.start_tag not in (auto.choices[0].message.content or "")


def test_chat_template_kwargs_reach_the_template(server):
  plain = httpx.post(f"{server.url}/tokenize", json={"messages": ASK}, timeout=30).json()
  thinking = httpx.post(f"{server.url}/tokenize", json={
      "messages": ASK, "chat_template_kwargs": {"thinking": True}}, timeout=30).json()
  assert thinking["count"] == plain["count"] + len("<think>")
  out = server.client().chat.completions.create(
      model=MODEL, messages=ASK, max_tokens=4, temperature=0,
      extra_body={"chat_template_kwargs": {"thinking": True}})
  message = out.choices[0].message  # the prompt opened <think>: the answer is reasoning
  assert message.model_extra["reasoning_content"] and not message.content


CHAT = "/v1/chat/completions"
MSG = {"model": MODEL, "messages": ASK, "max_tokens": 4}
BAD = [
    ({**MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema",
     "Invalid type: foo"),
    ({**MSG, "guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({**MSG, "structured_outputs": {"grammar": "start: x y"}}, "structured_outputs.grammar",
     "unknown name"),
    ({**MSG, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({**MSG, "guided_choice": ["x" * 40_000, "y" * 30_000]}, "guided_choice",
     "over the limit of 65536 (constraints.MAX_CONSTRAINT_CHARS)"),
    ({**MSG, "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "give one constraint"),
    ({**MSG, "tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "give one"),
    ({**MSG, "response_format": {"type": "xml"}}, "response_format", "xml"),
    ({**MSG, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
     "may not set messages"),
]


@pytest.mark.parametrize("body, param, words", BAD, ids=[b[1] for b in BAD])
def test_bad_constraints_are_400s_naming_the_problem(server, body, param, words):
  response = httpx.post(f"{server.url}{CHAT}", json=body, timeout=30)
  assert response.status_code == 400, response.text
  error = response.json()["error"]
  assert words in error["message"] and error["param"].startswith(param), error
