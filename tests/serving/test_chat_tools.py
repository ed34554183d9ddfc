"""Tools in chat requests without a model: the request fields (bad ones name the field), what
a chat template receives, the tokenizer keeping a parser's tags, and the response and chunk
bodies built from parsed output."""

from __future__ import annotations

import json

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from mla_jax.serving import responses
from mla_jax.serving.chat import ChatTemplate
from mla_jax.serving.protocol import APIError, ChatCompletionRequest, parse
from mla_jax.serving.reasoning import default_parsers, output_parser, parser_tags
from mla_jax.serving.sequence import RequestOutput
from mla_jax.tokenizer import HFTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
USER = [{"role": "user", "content": "hi"}]


def _parse(**body):
  return parse(ChatCompletionRequest, json.dumps({"model": "m", **body}).encode())


def _refused(**body):
  with pytest.raises(APIError) as e:
    request = _parse(**body)
    request.check_tools()
  assert e.value.status == 400
  return e.value


@pytest.mark.parametrize("body, param, words", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]), "tools.0.function.parameters", "schema must be of an object"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}]), "tools.0.function.parameters", "not a JSON Schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}]),
     "tools.0.function.parameters", "not a JSON Schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools.0.function.parameters", "should be an object"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strict": True}}]),
     "tools.0.function.strict", "tool_choice \"required\" or a named function"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]),
     "tools.0.function.name", "pattern"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type", "'function'"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name", "'nope' is not among the tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tool_choice="sometimes"), "tool_choice", "'none', 'auto' or 'required'"),
    (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name", "defined twice"),
    (dict(tools=[]), "tools", "at least 1 item"),  # as OpenAI
])
def test_bad_tools_name_the_field(body, param, words):
  error = _refused(messages=USER, **body)
  assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize("message, param, words", [
    ({"role": "tool", "content": "x"}, "messages.1", "needs tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "a"}, "messages.1", "needs tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "messages.1", "only an assistant"),
    ({"role": "tool", "tool_call_id": "a"}, "messages.1", "content: missing"),
    ({"role": "user", "content": None}, "messages.1", "content: missing"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{'a': 1}"}}]},
     "messages.1.tool_calls.0.function.arguments", "not JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
     "messages.1.tool_calls.0.function.arguments", "not a JSON object"),
])
def test_bad_tool_messages_name_the_field(message, param, words):
  error = _refused(messages=[*USER, message])
  assert error.param == param and words in error.message, error.message


def test_tool_choice_and_what_is_parsed():
  assert not _parse(messages=USER).parses_tools
  assert _parse(messages=USER, tools=[WEATHER]).parses_tools  # no tool_choice: auto
  assert not _parse(messages=USER, tools=[WEATHER], tool_choice="none").parses_tools
  for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
    request = _parse(messages=USER, tools=[WEATHER], tool_choice=choice)
    request.check_tools()
    assert request.parses_tools


# A GLM-5-like template: tools listed, an assistant's calls with their arguments' items, tool
# results inside <tool_response>.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'tool' %}<tool_response id={{ m.tool_call_id }}>{{ m.content }}"
    "</tool_response>{% else %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content or '' }}{% endif %}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>"
    "{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|><think>{% endif %}")


def test_tools_and_tool_messages_reach_the_template_unchanged():
  messages = [
      {"role": "user", "content": "Weather in Oslo?"},
      {"role": "assistant", "content": None, "reasoning_content": "Call it.", "tool_calls": [
          {"id": "call_1", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
      {"role": "tool", "tool_call_id": "call_2",
       "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}]},
  ]
  request = _parse(messages=messages, tools=[WEATHER])
  tools = [t.as_dict() for t in request.tools]
  assert tools == [WEATHER]  # as the client sent it
  rendered = ChatTemplate(TEMPLATE).render([m.for_template() for m in request.messages], tools)
  assert rendered == (
      f"<tools>{json.dumps(tools[0])}\n</tools>"  # HF's tojson: json.dumps, keys in order
      "<|user|>Weather in Oslo?"
      "<|assistant|><think>Call it.</think><tool_call>get_weather<arg_key>city</arg_key>"
      "<arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
      '<|tool|><tool_response id=call_1>{"temp": -3}</tool_response>'
      "<|tool|><tool_response id=call_2>part one, two</tool_response>"
      "<|assistant|><think>")
  # without tools the template gets tools=None
  assert ChatTemplate("{{ tools is none }}").render([], None) == "True"


def _tag_tokenizer(tmp_path):
  """A byte-level tokenizer with GLM's tags as special tokens, as GLM-5's tokenizer spells them."""
  tok = tokenizers.Tokenizer(models.BPE(
      vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True) for t in
                          ["<eos>", "<tool_call>", "</tool_call>", "<think>", "</think>"]])
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
  return HFTokenizer(tmp_path)


def test_the_decoder_keeps_the_parsers_special_tags_only(tmp_path):
  tok = _tag_tokenizer(tmp_path)
  ids = tok.encode("<think>r</think><tool_call>f\n</tool_call><eos>", add_special_tokens=False)
  assert tok.decode(ids) == "rf\n"  # special tokens dropped
  keep = tok.decoder_keeping(parser_tags("glm45", "glm45"))
  assert keep(ids) == "<think>r</think><tool_call>f\n</tool_call>"  # EOS still dropped
  assert tok.decoder_keeping(parser_tags("glm45", None))(ids) == "r<tool_call>f\n</tool_call>"
  assert tok.decoder_keeping(()) == tok.decode


def test_default_parsers_follow_the_model_type():
  assert default_parsers("deepseek_v32") == ("deepseek_v32", "deepseek_v3")
  assert default_parsers("glm_moe_dsa") == ("glm45", "glm45")
  assert default_parsers("deepseek_v3") == default_parsers(None) == (None, None)
  from mla_jax import cli
  from mla_jax.serving.reasoning import REASONING_PARSERS
  from mla_jax.serving.tool_parsers import TOOL_PARSERS
  assert cli.TOOL_CALL_PARSERS == tuple(TOOL_PARSERS)
  assert cli.REASONING_PARSERS == REASONING_PARSERS


# ---- response bodies ----------------------------------------------------------------------

GLM_OUT = ("Let me think.</think>Checking.<tool_call>get_weather<arg_key>city</arg_key>"
           "<arg_value>Oslo</arg_value></tool_call>")


def _choice(reason="stop", *, tools=(WEATHER,), reasoning="glm45"):
  parser = output_parser("glm45", reasoning, list(tools) if tools is not None else None,
                         opens_think=True)
  choice = responses.Choice(0, [1], text=None, parser=parser)
  choice.last = RequestOutput(
      request_id="r", prompt_tokens=(1,), tokens=(1,), new_tokens=(1,), finished=True,
      finish_reason=reason, text="", arrival_time=0.0, first_token_time=0.0, finish_time=0.0,
      num_cached_prompt_tokens=0, num_preemptions=0)
  return choice


def test_a_full_message_carries_reasoning_and_calls():
  choice = _choice()
  message = responses._message(choice, GLM_OUT)
  call = message["tool_calls"][0]
  assert call["id"].startswith("call_") and len(call["id"]) == 29
  assert message == {"role": "assistant", "content": "Checking.",
                     "reasoning_content": "Let me think.", "tool_calls": [
                         {"id": call["id"], "type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
  assert responses._chat_finish_reason(choice) == "tool_calls"
  assert responses._chat_finish_reason(_choice("length")) == "length"  # a call may be cut
  plain = _choice(tools=None)  # tool_choice none: no calls parsed, reasoning still split
  assert responses._message(plain, GLM_OUT) == {
      "role": "assistant", "reasoning_content": "Let me think.",
      "content": GLM_OUT.split("</think>")[1]}
  assert responses._chat_finish_reason(plain) == "stop"
  assert responses._message(_choice(reasoning=None), "hi") == {"role": "assistant",
                                                            "content": "hi"}


def test_streamed_deltas_add_up_to_the_full_message():
  choice = _choice()
  deltas = [responses._delta(choice, GLM_OUT[i:i + 3], i + 3 >= len(GLM_OUT))
            for i in range(0, len(GLM_OUT), 3)]
  assert all(d for d in deltas)  # every chunk has a delta (content "" when nothing else)
  assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think."
  assert "".join(d.get("content", "") for d in deltas) == "Checking."
  calls = [c for d in deltas for c in d.get("tool_calls", [])]
  assert calls[0]["function"]["name"] == "get_weather" and calls[0]["type"] == "function"
  assert "".join(c["function"].get("arguments", "") for c in calls) == '{"city": "Oslo"}'
  assert {c["index"] for c in calls} == {0} and sum("id" in c for c in calls) == 1
  assert responses._chat_finish_reason(choice) == "tool_calls"
