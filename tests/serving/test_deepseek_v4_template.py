"""The DeepSeek-V4 chat template mla_jax ships (DeepSeek publishes its format as Python code,
``encoding/encoding_dsv4.py``, which vLLM vendors as ``deepseek_v4_encoding.py``), against
prompts written out from that code's rules as vLLM's ``deepseek_v4`` tokenizer calls it (the
request's tools on a system message placed first, ``drop_thinking`` on); its tool calls read
back by the ``deepseek_v4`` parsers; which template ``mla-jax serve`` picks for V4.

The rules, named in the tests by the encoder's function:
- ``render_message``: BOS, then each message; a user turn is ``<｜User｜>`` + its text, and one
  followed by an assistant turn or by nothing gets ``<｜Assistant｜>`` + ``</think>`` (chat
  mode) or ``<think>`` (thinking mode, on the last user turn, or on every one when thinking is
  kept); an assistant turn is [reasoning ``</think>``] content [``\\n\\n`` + the DSML
  ``tool_calls`` block] ``<｜end▁of▁sentence｜>``, with its reasoning only in thinking mode,
  after the last user turn (or always when thinking is kept).
- ``merge_tool_messages``: no tool role; consecutive tool and user messages are one user turn,
  its parts joined by a blank line, a result ``<tool_result>...</tool_result>``.
- ``sort_tool_results_by_call_order``: a turn's results in the order of the last assistant
  calls, by ``tool_call_id``.
- ``encode_messages`` / ``_drop_thinking_messages``: a message with tools keeps every turn's
  thinking; otherwise, in thinking mode, a developer message before the last user turn goes.
- ``render_tools`` (``TOOLS_TEMPLATE``): the tools block after the system text and a blank
  line, one JSON schema (the tool's ``function``) a line.
"""

import json

import pytest

from mla_jax.serving.chat import SHIPPED_TEMPLATES, ChatTemplate, TemplateError, serving_template
from mla_jax.serving.reasoning import output_parser, prompt_opens_think
from mla_jax.serving.tool_parsers import DeepSeekV4ToolParser
from tests.serving.test_deepseek_v32_template import CALLS, TOOLS, _checkpoint

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
TEMPLATE = ChatTemplate(SHIPPED_TEMPLATES["deepseek_v4"].read_text())
THINKING = {"thinking": True}
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
         {"role": "user", "content": "1+1?"}]
# render_message: the calls' DSML (strings as they are, other values as JSON, no arguments:
# an empty line), V3.2's invokes in a tool_calls block.
CALLS_DSML = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
              f'<{D}parameter name="city" string="true">Zürich</{D}parameter>\n'
              f'<{D}parameter name="days" string="false">[1, 2]</{D}parameter>\n'
              f'</{D}invoke>\n<{D}invoke name="now">\n\n</{D}invoke>\n</{D}tool_calls>')
# TOOLS_TEMPLATE, word for word, around the schemas.
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can "
    f'invoke tools by writing a "<{D}tool_calls>" block like the following:\n\n'
    f'<{D}tool_calls>\n<{D}invoke name="$TOOL_NAME">\n'
    f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>'
    f'\n...\n</{D}invoke>\n<{D}invoke name="$TOOL_NAME2">\n...\n</{D}invoke>\n'
    f"</{D}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output '
    "your complete reasoning inside <think>...</think> BEFORE any tool calls or final response."
    "\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")
TOOLS_TAIL = ("\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
              "invoke tool calls.\n")
TOOLS_BLOCK = (TOOLS_HEAD + "\n".join(json.dumps(t["function"], ensure_ascii=False)
                                      for t in TOOLS) + TOOLS_TAIL)


def test_chat_mode_closes_think_and_merges_consecutive_user_messages():
  """Chat mode (no ``thinking``): every user turn ends ``<｜Assistant｜></think>``, reasoning is
  never rendered; two user messages in a row are one turn (merge_tool_messages)."""
  prompt = TEMPLATE.render(TURNS)
  assert prompt == f"{BOS}Be brief.{U}hi{A}</think>Hello.{EOS}{U}1+1?{A}</think>"
  assert not prompt_opens_think(prompt)
  assert TEMPLATE.render([TURNS[1], {"role": "user", "content": "and?"}]) == (
      f"{BOS}{U}hi\n\nand?{A}</think>")


@pytest.mark.parametrize("switch", ["thinking", "enable_thinking"])
def test_thinking_mode_keeps_reasoning_only_after_the_last_user_turn(switch):
  """``thinking`` or ``enable_thinking`` (as vLLM's deepseek_v4 tokenizer reads them): the last
  user turn opens <think>, earlier assistant turns lose their reasoning and earlier developer
  messages go (_drop_thinking_messages); an assistant turn after the last user turn keeps its
  reasoning, and a developer message is a user turn of its own text."""
  thinking = {switch: True}
  prompt = TEMPLATE.render(TURNS, variables=thinking)
  assert prompt == f"{BOS}Be brief.{U}hi{A}</think>Hello.{EOS}{U}1+1?{A}<think>"
  assert prompt_opens_think(prompt)
  developer = {"role": "developer", "content": "Use SI units."}
  assert TEMPLATE.render([developer, *TURNS[1:]], variables=thinking) == (
      f"{BOS}{U}hi{A}</think>Hello.{EOS}{U}1+1?{A}<think>")
  assert TEMPLATE.render([*TURNS[1:3], developer], variables=thinking) == (
      f"{BOS}{U}hi{A}</think>Hello.{EOS}{U}Use SI units.{A}<think>")
  assert TEMPLATE.render(TURNS[1:3], variables=thinking) == (  # a prefilled answer: no prompt
      f"{BOS}{U}hi{A}<think>greet</think>Hello.{EOS}")


def test_tool_results_are_a_user_turn_in_the_calls_order():
  """Without tools in the request, tool results are the last user turn (merge_tool_messages):
  the calling turn before them loses its reasoning even in thinking mode (unlike V3.2), and
  the results, given out of order, come in the order of the calls
  (sort_tool_results_by_call_order), a user message after them in the same turn."""
  conversation = [
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": None, "reasoning_content": "look it up",
       "tool_calls": CALLS},
      {"role": "tool", "tool_call_id": "b", "content": "noon"},
      {"role": "tool", "tool_call_id": "a", "content": "sunny"},
      {"role": "user", "content": "Thanks."}]
  results = f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>\n\nThanks."
  assert TEMPLATE.render(conversation, variables=THINKING) == (
      f"{BOS}{U}Weather?{A}</think>{CALLS_DSML}{EOS}{results}{A}<think>")
  assert TEMPLATE.render(conversation) == (
      f"{BOS}{U}Weather?{A}</think>{CALLS_DSML}{EOS}{results}{A}</think>")


def test_tools_block_and_thinking_kept_with_tools():
  """The request's tools as a system message placed first (vLLM's deepseek_v4 tokenizer), so
  the block opens the prompt and the client's system text follows it; with tools, thinking
  mode keeps every turn's reasoning and opens <think> after every user turn (encode_messages
  turns drop_thinking off); ``reasoning_effort: "max"`` prefixes the effort instruction."""
  conversation = [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "look it up",
       "tool_calls": CALLS},
      {"role": "tool", "tool_call_id": "a", "content": "sunny"},
      {"role": "tool", "tool_call_id": "b", "content": "noon"},
      {"role": "assistant", "content": "Sunny.", "reasoning_content": "got it"},
      {"role": "user", "content": "Tomorrow?"}]
  turns = (f"Be brief.{U}Weather?{A}<think>look it up</think>Checking.{CALLS_DSML}{EOS}"
           f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>{A}<think>"
           f"got it</think>Sunny.{EOS}{U}Tomorrow?{A}<think>")
  assert TEMPLATE.render(conversation, TOOLS, THINKING) == f"{BOS}\n\n{TOOLS_BLOCK}{turns}"
  effort = TEMPLATE.render(conversation, TOOLS, {**THINKING, "reasoning_effort": "max"})
  assert effort.startswith(f"{BOS}Reasoning Effort: Absolute maximum with no shortcuts "
                           "permitted.\nYou MUST be very thorough")
  assert effort.endswith(f"is left unchecked.\n\n\n\n{TOOLS_BLOCK}{turns}")
  chat = TEMPLATE.render(conversation, TOOLS, {"reasoning_effort": "max"})  # chat mode: none
  assert chat == (f"{BOS}\n\n{TOOLS_BLOCK}Be brief.{U}Weather?{A}</think>Checking.{CALLS_DSML}"
                  f"{EOS}{U}<tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>"
                  f"{A}</think>Sunny.{EOS}{U}Tomorrow?{A}</think>")


def test_rendered_calls_parse_back_with_the_v4_parsers():
  """Round trip: an assistant turn the template renders, read as a generation by the server's
  parsers for V4 (``deepseek_v4`` calls, ``deepseek_v3`` reasoning, the prompt opening
  <think>), gives back its reasoning, content and calls."""
  turn = {"role": "assistant", "content": "Checking.", "reasoning_content": "look it up",
          "tool_calls": CALLS}
  prompt = TEMPLATE.render([{"role": "user", "content": "Weather?"}, turn], TOOLS, THINKING)
  head = f"{U}Weather?{A}<think>"
  generation = prompt[prompt.index(head) + len(head):].removesuffix(EOS)
  parser = output_parser("deepseek_v4", "deepseek_v3", TOOLS, opens_think=True)
  out = parser.parse(generation)
  assert (out.reasoning, out.content) == ("look it up", "Checking.")
  assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
          for c in out.tool_calls] == [(c["function"]["name"], c["function"]["arguments"])
                                       for c in CALLS]
  content, calls = DeepSeekV4ToolParser(TOOLS).parse(CALLS_DSML)
  assert content == "" and len(calls) == 2


def test_serve_picks_the_shipped_v4_template(tmp_path):
  """A ``deepseek_v4`` checkpoint with a ``tokenizer.json`` and no template of its own gets
  the shipped one; without a tokenizer.json (byte-level) the plain format."""
  v4 = _checkpoint(tmp_path / "v4", "deepseek_v4")
  assert serving_template(v4, None, "deepseek_v4")[1] == "plain"
  (v4 / "tokenizer.json").write_text("{}")
  template, source = serving_template(v4, None, "deepseek_v4")
  assert source == "deepseek_v4.jinja, shipped with mla_jax"
  assert template.render(TURNS) == TEMPLATE.render(TURNS)


def test_unknown_roles_and_empty_developer_messages_are_refused():
  with pytest.raises(TemplateError, match="no role function"):
    TEMPLATE.render([{"role": "function", "content": "x"}])
  with pytest.raises(TemplateError, match="no empty developer message"):
    TEMPLATE.render([{"role": "developer", "content": ""}])
