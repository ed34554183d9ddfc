"""The tool-call and reasoning parsers on generations in the models' own formats and on
adversarial ones: exact values parsed whole, and the same values streamed at every split
point (no tag ever reaches the content)."""

from __future__ import annotations

import itertools
import json

import pytest

from mla_jax.serving.reasoning import (ChatOutputParser, ReasoningParser, _merge,
                                       prompt_opens_think)
from mla_jax.serving.tool_parsers import DeepSeekV32ToolParser, Glm45ToolParser, string_typed

D = "｜DSML｜"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"type": ["string", "null"]},
                                         "filter": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "limit": {"type": "number"}}}}},
]


def _ids():
  counter = itertools.count()
  return lambda: f"call_{next(counter)}"


def _parser(kind, reasoning=None):
  tools = {"dsml": DeepSeekV32ToolParser, "glm": Glm45ToolParser}[kind](TOOLS, call_id=_ids())
  return ChatOutputParser(None if reasoning is None else ReasoningParser(reasoning), tools)


def _call(i, name, arguments):
  return {"id": f"call_{i}", "type": "function",
          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _whole(kind, text, reasoning=None):
  out = _parser(kind, reasoning).parse(text)
  return out.reasoning, out.content, out.tool_calls


def _streamed(kind, chunks, reasoning=None):
  """The chunks fed one by one: reasoning, content and the calls the deltas build up, with
  each delta checked against OpenAI's shape."""
  parser = _parser(kind, reasoning)
  reasoning_text = content = ""
  calls: list[dict] = []
  for i, chunk in enumerate(chunks):
    out = parser.feed(chunk, final=i == len(chunks) - 1)
    reasoning_text += out.reasoning
    content += out.content
    for d in out.tool_calls:
      assert set(d) <= {"index", "id", "type", "function"}
      if d["index"] == len(calls):  # a new call: its first delta names it
        assert d["id"] and d["type"] == "function" and d["function"]["name"]
      _merge(calls, json.loads(json.dumps(d)))
  if not chunks:
    out = parser.feed("", final=True)
    reasoning_text, content = out.reasoning, out.content
  calls = [{"id": c["id"], "type": c["type"], "function": c["function"]} for c in calls]
  return reasoning_text, content, calls


def _check_every_split(kind, text, want, reasoning=None):
  assert _whole(kind, text, reasoning) == want
  assert _streamed(kind, list(text), reasoning) == want  # one character at a time
  for i in range(len(text) + 1):
    assert _streamed(kind, [text[:i], text[i:]], reasoning) == want, i
  for i in range(0, len(text), 7):
    for j in range(i, len(text), 5):
      assert _streamed(kind, [text[:i], text[i:j], text[j:]], reasoning) == want, (i, j)


# ---- DeepSeek-V3.2 (DSML) -------------------------------------------------------------------

DSML_TWO_CALLS = (
    "I'll check both cities.\n\n"
    f"<{D}function_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">杭州</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f"</{D}invoke>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">北京 "Beijing"</{D}parameter>\n'
    f'<{D}parameter name="filter" string="false">{{"a": {{"b": [1, {{"c": "}}"}}]}}, '
    f'"emoji": "\\u00e9🙂"}}</{D}parameter>\n'
    f"</{D}invoke>\n"
    f"</{D}function_calls>")


def test_dsml_two_calls_nested_json_and_unicode_at_every_split():
  want = ("", "I'll check both cities.", [
      _call(0, "get_weather", {"city": "杭州", "days": 3}),
      _call(1, "get_weather", {"city": '北京 "Beijing"',
                               "filter": {"a": {"b": [1, {"c": "}"}]}, "emoji": "é🙂"}})])
  _check_every_split("dsml", DSML_TWO_CALLS, want)


def test_dsml_recorded_thinking_turn():
  # DeepSeek-V3.2 in thinking mode: the prompt ends with "<｜Assistant｜><think>", so the
  # generation starts inside reasoning; the calls come after "</think>".
  prompt = "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜><think>"
  assert prompt_opens_think(prompt)
  text = ("The user wants Paris weather. I should call get_weather.</think>"
          f"<{D}function_calls>\n<{D}invoke name=\"get_weather\">\n"
          f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
          f"</{D}invoke>\n</{D}function_calls>")
  want = ("The user wants Paris weather. I should call get_weather.", "",
          [_call(0, "get_weather", {"city": "Paris"})])
  _check_every_split("dsml", text, want, reasoning=True)


def test_dsml_string_false_that_is_not_json_stays_text_and_empty_invoke_is_an_empty_object():
  text = (f'<{D}function_calls><{D}invoke name="search">'
          f'<{D}parameter name="limit" string="false">ten</{D}parameter></{D}invoke>'
          f'<{D}invoke name="get_weather"></{D}invoke></{D}function_calls>')
  assert _whole("dsml", text) == ("", "", [_call(0, "search", {"limit": "ten"}),
                                           _call(1, "get_weather", {})])


def test_dsml_truncated_call_keeps_its_complete_parameters():
  text = (f'Let me look.<{D}function_calls>\n<{D}invoke name="search">\n'
          f'<{D}parameter name="query" string="true">mla</{D}parameter>\n'
          f'<{D}parameter name="limit" string="false">1')
  want = ("", "Let me look.", [_call(0, "search", {"query": "mla"})])
  _check_every_split("dsml", text, want)
  # cut inside the opening tag: that text is content; cut inside an invoke header: no call
  assert _whole("dsml", f"Hi <{D}function_ca") == ("", f"Hi <{D}function_ca", [])
  assert _whole("dsml", f'<{D}function_calls><{D}invoke name="sea') == ("", "", [])


def test_dsml_malformed_header_is_dropped_and_text_after_the_block_is_content():
  text = (f'<{D}function_calls><{D}invoke nam="x">junk<{D}invoke name="search">'
          f'<{D}parameter name="query">no string attr</{D}parameter>'
          f'<{D}parameter name="query" string="true">ok</{D}parameter></{D}invoke>'
          f"</{D}function_calls>\nDone.")
  # the parameter without string= is dropped, its value text with it
  want = ("", "Done.", [_call(0, "search", {"query": "ok"})])
  _check_every_split("dsml", text, want)


# ---- GLM-4.5 ... GLM-5 (<tool_call>) ----------------------------------------------------------

GLM_TWO_CALLS = (
    "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich\n"
    "</arg_value>\n<arg_key>days</arg_key>\n<arg_value> 2 </arg_value>\n"
    "<arg_key>filter</arg_key>\n<arg_value>{\"x\": {\"y\": [\"}\", {}]}, \"z\": \"ü\"}"
    "</arg_value>\n</tool_call>\n"
    "<tool_call>search<arg_key>query</arg_key><arg_value>{\"not\": \"parsed\"}</arg_value>"
    "<arg_key>limit</arg_key><arg_value>2.5</arg_value></tool_call>")


def test_glm_two_calls_schema_types_nested_json_and_unicode_at_every_split():
  # GLM-4.5's newline after the name and GLM-4.7/5's none; a string-typed value is kept
  # as written (its newline too), a non-string one is JSON-decoded.
  want = ("", "Checking.", [
      _call(0, "get_weather", {"city": "Zürich\n", "days": 2,
                               "filter": {"x": {"y": ["}", {}]}, "z": "ü"}}),
      _call(1, "search", {"query": '{"not": "parsed"}', "limit": 2.5})])
  _check_every_split("glm", GLM_TWO_CALLS, want)


def test_glm5_recorded_thinking_turn_with_a_tool_call_inside_reasoning():
  # GLM-5's template opens <think> after <|assistant|>; the model thinks about the call
  # (writing the tag) before closing </think>: only the call after it is a call.
  prompt = "[gMASK]<sop><|system|>...<|user|>Weather in Oslo?<|assistant|><think>"
  assert prompt_opens_think(prompt)
  assert not prompt_opens_think("<|assistant|><think></think>")
  text = ("I could emit <tool_call>get_weather<arg_key>city</arg_key>"
          "<arg_value>Oslo</arg_value></tool_call> now.</think>\n"
          "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
          "</tool_call>")
  want = ("I could emit <tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo"
          "</arg_value></tool_call> now.", "", [_call(0, "get_weather", {"city": "Oslo"})])
  _check_every_split("glm", text, want, reasoning=True)


def test_glm_truncated_call_and_unknown_function():
  text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
          "<arg_key>days</arg_key>\n<arg_value>1")
  _check_every_split("glm", text, ("", "", [_call(0, "get_weather", {"city": "Rome"})]))
  assert _whole("glm", "<tool_call>get_wea") == ("", "", [])  # no complete name: no call
  assert _whole("glm", "ok <tool_") == ("", "ok <tool_", [])
  # a function not among the tools: its values are strings (no schema says otherwise)
  assert _whole("glm", "<tool_call>other\n<arg_key>n</arg_key><arg_value>1</arg_value>"
                       "</tool_call>") == ("", "", [_call(0, "other", {"n": "1"})])


def test_glm_without_a_call_is_content_and_a_nameless_call_is_dropped():
  text = "Plain answer with <b>tags</b>, a < sign and a trailing space "
  _check_every_split("glm", text, ("", text, []))
  assert _whole("glm", "a<tool_call>\n<arg_key>k</arg_key></tool_call> b") == ("", "ab", [])
  # no arguments: an empty object, with GLM-4.5's newline or without
  _check_every_split("glm", "<tool_call>search\n</tool_call><tool_call>search</tool_call>",
                     ("", "", [_call(0, "search", {}), _call(1, "search", {})]))


# ---- reasoning ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, in_reasoning, want", [
    ("<think>plan</think>answer", False, ("plan", "answer")),
    ("plan</think>\nanswer", True, ("plan", "\nanswer")),
    ("<think>plan</think>answer", True, ("plan", "answer")),   # a redundant <think> dropped
    ("plan cut short", True, ("plan cut short", "")),          # no </think>: all reasoning
    ("plain answer", False, ("", "plain answer")),              # thinking off
    ("plain </think> answer", False, ("", "plain </think> answer")),
    ("<thin", False, ("", "<thin")),
    ("", True, ("", "")),
    ("a<think>b</think>c", False, ("", "a<think>b</think>c")),  # <think> only at the start
])
def test_reasoning_split_at_every_split(text, in_reasoning, want):
  _check_every_split("glm", text, (*want, []), reasoning=in_reasoning)


def test_reasoning_parser_alone_and_schema_types():
  parser = ReasoningParser(in_reasoning=True)
  got = [parser.feed(c) for c in ["a</", "thi", "nk", ">b"]] + [parser.finish()]
  assert got == [("a", ""), ("", ""), ("", ""), ("", "b"), ("", "")]
  assert string_typed({"type": "string"}) and string_typed({}) and string_typed(None)
  assert string_typed({"type": ["null", "string"]})
  assert not string_typed({"type": "integer"}) and not string_typed({"type": ["null", "object"]})
