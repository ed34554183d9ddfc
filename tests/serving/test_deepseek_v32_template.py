"""The DeepSeek-V3.2 chat template mla_jax ships (DeepSeek publishes its format as Python code,
``encoding_dsv32.py``), against prompts written out from that code's rules; which template
``mla-jax serve`` picks, and its warning when none is left but the plain format."""

import argparse
import json
import logging

import pytest

from mla_jax import cli
from mla_jax.serving.chat import (SHIPPED_TEMPLATES, ChatTemplate, TemplateError,
                                  serving_template)
from mla_jax.serving.reasoning import prompt_opens_think

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
TEMPLATE = ChatTemplate(SHIPPED_TEMPLATES["deepseek_v32"].read_text())
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
         {"role": "user", "content": "1+1?"}]


def test_chat_mode_closes_think_after_every_user_turn():
  """Chat mode (the default): each user turn ends ``<｜Assistant｜></think>``, reasoning is
  never rendered, and the reasoning parser reads the answer as content."""
  prompt = TEMPLATE.render(TURNS)
  assert prompt == (f"{BOS}Be brief.{U}hi{A}</think>Hello.{EOS}{U}1+1?{A}</think>")
  assert not prompt_opens_think(prompt)


def test_thinking_mode_opens_think_on_the_last_user_turn():
  """With ``thinking`` set (vLLM's chat_template_kwargs), the last user turn opens <think>; an
  assistant turn after it (a tool call) keeps its reasoning, earlier ones lose it."""
  source = "{% set thinking = true %}" + SHIPPED_TEMPLATES["deepseek_v32"].read_text()
  thinking = ChatTemplate(source)
  prompt = thinking.render(TURNS)
  assert prompt == f"{BOS}Be brief.{U}hi{A}</think>Hello.{EOS}{U}1+1?{A}<think>"
  assert prompt_opens_think(prompt)
  call = {"role": "assistant", "content": None, "reasoning_content": "look it up",
          "tool_calls": [{"id": "a", "type": "function",
                          "function": {"name": "f", "arguments": {"x": 1}}}]}
  after = thinking.render([TURNS[1], call, {"role": "tool", "tool_call_id": "a", "content": "2"}])
  assert after == (f"{BOS}{U}hi{A}<think>look it up</think>\n\n<{D}function_calls>\n"
                   f'<{D}invoke name="f">\n<{D}parameter name="x" string="false">1'
                   f"</{D}parameter>\n</{D}invoke>\n</{D}function_calls>{EOS}\n\n"
                   "<function_results>\n<result>2</result>\n</function_results>\n\n<think>")


# A conversation's tools and one assistant turn's calls (test_deepseek_v4_template.py's too).
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now", "description": "Zeit, jetzt"}}]
CALLS = [{"id": "a", "type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}},
         {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}}]


def test_tools_calls_and_results_in_dsml():
  """The tools as a system block first (their JSON one a line), an assistant's calls in DSML
  (strings as they are, other values as JSON, no arguments: an empty line), then the results
  of all its calls in one block, closed by </think>."""
  prompt = TEMPLATE.render([
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "Checking.", "tool_calls": CALLS},
      {"role": "tool", "tool_call_id": "a", "content": "sunny"},
      {"role": "tool", "tool_call_id": "b", "content": "noon"}], TOOLS)
  head, _, rest = prompt.partition("<functions>\n")
  assert head.startswith(f"{BOS}\n\n## Tools\n\nYou have access to a set of tools")
  assert f'<{D}parameter name="$PARAMETER_NAME" string="true|false">' in head
  schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in TOOLS)
  assert rest == (
      f"{schemas}\n</functions>\n{U}Weather?{A}</think>Checking.\n\n<{D}function_calls>\n"
      f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Zürich'
      f'</{D}parameter>\n<{D}parameter name="days" string="false">[1, 2]</{D}parameter>\n'
      f'</{D}invoke>\n<{D}invoke name="now">\n\n</{D}invoke>\n</{D}function_calls>{EOS}'
      "\n\n<function_results>\n<result>sunny</result>\n<result>noon</result>\n"
      "</function_results>\n\n</think>")


def _checkpoint(path, model_type, tokenizer_config=None):
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"model_type": model_type}))
  if tokenizer_config is not None:
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
  return path


def test_serve_picks_the_checkpoints_template_then_the_shipped_one_then_warns(tmp_path,
                                                                             caplog):
  """A checkpoint's own template (tokenizer_config.json, or HF's chat_template.jinja) wins;
  a DeepSeek-V3.2 checkpoint without one gets the shipped one (with a tokenizer.json to spell
  its special tokens); any other gets the plain format and a warning at start."""
  own = _checkpoint(tmp_path / "own", "deepseek_v32",
                    {"chat_template": "X{{ messages[0].content }}"})
  assert serving_template(own, None, "deepseek_v32")[0].render(TURNS) == "XBe brief."
  hf_file = _checkpoint(tmp_path / "file", "glm_moe_dsa")
  (hf_file / "chat_template.jinja").write_text("Y")
  assert serving_template(hf_file, None, "glm_moe_dsa")[0].render(TURNS) == "Y"
  v32 = _checkpoint(tmp_path / "v32", "deepseek_v32")
  assert serving_template(v32, None, "deepseek_v32")[1] == "plain"  # byte-level: no tokens
  (v32 / "tokenizer.json").write_text("{}")
  args = argparse.Namespace(checkpoint=str(v32), chat_template=None, preset="recall")
  with caplog.at_level(logging.WARNING, logger="mla_jax"):
    template, source = cli._chat_template(args)
    assert template.render(TURNS) == TEMPLATE.render(TURNS) and "shipped with mla_jax" in source
    assert not caplog.records
    args.checkpoint = str(_checkpoint(tmp_path / "other", "deepseek_v3"))
    template, source = cli._chat_template(args)
  assert template.is_plain and source == "plain"
  assert [r.getMessage() for r in caplog.records] == [
      f"{args.checkpoint} has no chat template: chat requests are rendered in the plain "
      "'role: content' format, which the model was likely not trained on; give "
      "--chat-template FILE"]


def test_an_unknown_role_is_refused_by_the_template():
  with pytest.raises(TemplateError, match="no role function"):
    TEMPLATE.render([{"role": "function", "content": "x"}])


def test_tojson_is_hfs():
  """HF's filter (json.dumps, keys in order, no HTML escapes, ``ensure_ascii`` taken), which
  checkpoint templates such as GLM-5's call with ``ensure_ascii=False``."""
  template = ChatTemplate("{{ messages[0] | tojson(ensure_ascii=False) }}|"
                          "{{ messages[0] | tojson }}")
  message = {"role": "user", "content": "Zürich <b>"}
  assert template.render([message]) == (
      '{"role": "user", "content": "Zürich <b>"}|{"role": "user", "content": "Zürich <b>"}')
