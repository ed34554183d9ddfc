"""Tool calling and reasoning through ``mla-jax serve`` (a subprocess, the ``openai`` client).

The recall model writes no tool calls, so the test steers what its tokens *say*, not what
they are: the checkpoint gets a byte-level ``tokenizer.json`` whose decoder spells the two
letters the model greedily answers this prompt with as pieces of a thinking turn (reasoning,
``</think>``, content, then a call split between the two tokens), the way a real tokenizer
spells ``<tool_call>`` or ``</think>`` as one token. The token ids, and so the generation, are
the model's own; a stop string at its third letter ends the turn. Two servers: a DeepSeek-V3.2
turn in DSML with the parsers of the checkpoint's ``model_type`` (deepseek_v32, no flags), and a
GLM-5 turn with ``--tool-call-parser glm45 --reasoning-parser glm45``.
"""

from __future__ import annotations

import json
import shutil

import httpx
import jax.numpy as jnp
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from mla_jax import presets
from mla_jax.checkpoints import load_pretrained
from mla_jax.generation.loop import generate
from mla_jax.tokenizer import ByteTokenizer
from tests.test_server import Server

MODEL = "recall-tools"
RECALL = "aQ ..kX zB ...mP rT ..wE cV ?k"
# DeepSeek-like in spirit: tools listed first, calls and tool results, then the assistant's
# turn opened in thinking mode, and the last user message at the very end (the lookup the
# recall model answers).
TEMPLATE = (
    "{{ bos_token }}{% if tools %}T:{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "{% endif %}{% for m in messages[:-1] %}"
    "{% if m.role == 'tool' %}R[{{ m.tool_call_id }}]:{{ m.content }};"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}C[{{ c.id }}]:{{ c.function.name }}"
    "{% for k, v in c.function.arguments.items() %},{{ k }}={{ v }}{% endfor %};{% endfor %}"
    "{% else %}{{ m.role }}:{{ m.content }};{% endif %}{% endfor %}"
    "<think>{{ messages[-1].content }}")
D = "｜DSML｜"
TURNS = {  # format: (server flags, the first token's text, the second's)
    "deepseek_v32": ([], f"Thinking it over.</think>Sure.<{D}function_calls>\n"
                         f'<{D}invoke name="get_weather">\n<{D}parameter name="city" '
                         'string="true">Par',
                     f'is</{D}parameter>\n<{D}parameter name="days" string="false">3'
                     f"</{D}parameter>\n</{D}invoke>\n</{D}function_calls>"),
    "glm45": (["--tool-call-parser", "glm45", "--reasoning-parser", "glm45"],
              "Thinking it over.</think>Sure.<tool_call>get_weather<arg_key>city</arg_key>"
              "<arg_value>Par",
              "is</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": RECALL}]


def _byte_tokenizer(replace: dict[str, str]) -> tokenizers.Tokenizer:
  """Ids 0-255 the UTF-8 bytes (as the recall model's), 256-258 BOS / EOS / PAD; decoding
  spells each key of ``replace`` as its value."""
  alphabet = {}  # GPT-2's byte -> printable character map, byte order
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  extra = 0
  for b in range(256):
    alphabet[b] = chr(b) if b in printable else chr(256 + extra)
    extra += b not in printable
  tok = tokenizers.Tokenizer(models.BPE(vocab={c: b for b, c in alphabet.items()}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  # each key to a private-use character first, so that no value is rewritten by a later key
  marks = {k: chr(0xE000 + i) for i, k in enumerate(replace)}
  tok.decoder = decoders.Sequence([decoders.ByteLevel(),
                                   *(decoders.Replace(k, marks[k]) for k in replace),
                                   *(decoders.Replace(marks[k], v) for k, v in replace.items())])
  tok.add_special_tokens([AddedToken(t, special=True) for t in ("<bos>", "<eos>", "<pad>")])
  return tok


@pytest.fixture(scope="module", params=sorted(TURNS))
def steered(request, tmp_path_factory):
  """The checkpoint, the three letters the model answers the tools request with, the turn
  they spell and the server's flags."""
  flags, first, second = TURNS[request.param]
  prompt = "T:get_weather;<think>" + RECALL
  model = load_pretrained(presets.RECALL_CHECKPOINT, dtype=jnp.float32, backend="xla")
  ids = [ByteTokenizer.BOS_ID, *ByteTokenizer().encode(prompt, add_special_tokens=False)]
  letters = ByteTokenizer().decode(generate(model, [ids], 3).tokens[0])
  assert len(set(letters)) == 3 and letters.isalpha(), letters  # three distinct letters
  assert letters[2] not in first + second  # the stop string
  path = tmp_path_factory.mktemp("ckpt") / MODEL
  shutil.copytree(presets.RECALL_CHECKPOINT, path)
  _byte_tokenizer({letters[0]: first, letters[1]: second}).save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": TEMPLATE, "bos_token": "<bos>", "eos_token": "<eos>"}))
  assert json.loads((path / "config.json").read_text())["model_type"] == "deepseek_v32"
  return path, letters, first + second, flags


@pytest.fixture(scope="module")
def server(steered):
  # one token per step: each token's text comes in a chunk of its own
  s = Server(steered[0], "--no-warmup", "--decode-steps", "1", *steered[3])
  yield s
  code, out, err = s.stop()
  assert code == 0, err
  parsers = "glm45, reasoning parser glm45" if steered[3] else \
      "deepseek_v32, reasoning parser deepseek_v3"
  assert f"tool-call parser {parsers}" in out


def test_a_steered_tool_call_full_and_streamed(server, steered):
  letters = steered[1]
  client = server.client()
  args = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=8,
              stop=[letters[2]])
  out = client.chat.completions.create(**args)
  choice = out.choices[0]
  assert choice.finish_reason == "tool_calls"
  message = choice.message
  assert message.content == "Sure."
  assert message.model_extra["reasoning_content"] == "Thinking it over."
  (call,) = message.tool_calls
  assert call.id.startswith("call_") and call.type == "function"
  assert call.function.name == "get_weather"
  assert call.function.arguments == '{"city": "Paris", "days": 3}'
  assert out.usage.completion_tokens == 3  # the third letter stopped it

  chunks = list(client.chat.completions.create(**args, stream=True))
  reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                      for c in chunks if c.choices)
  content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
  assert reasoning == "Thinking it over." and content == "Sure."
  assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
  assert {d.index for d in deltas} == {0}
  # the call's name came with the first token, its arguments with the second
  assert len(deltas) == 2 and deltas[0].function.arguments == ""
  assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
  assert chunks[-1].choices[0].finish_reason == "tool_calls"

  # an agent's next turn: the answer sent back as it came (content null, reasoning_content,
  # tool_calls), the tool's result after it
  follow = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, messages=[
      *ASK, message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}, *ASK],
      tools=[WEATHER])
  rendered = (f"T:get_weather;user:{RECALL};C[{call.id}]:get_weather,city=Paris,days=3;"
              f"R[{call.id}]:sunny;<think>{RECALL}")
  assert follow.usage.prompt_tokens == 1 + len(rendered.encode())


def test_tool_choice_none_leaves_the_call_as_text(server, steered):
  letters = steered[1]
  out = server.client().chat.completions.create(
      model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0,
      max_tokens=8, stop=[letters[2]])
  message = out.choices[0].message
  assert message.tool_calls is None and out.choices[0].finish_reason == "stop"
  assert message.model_extra["reasoning_content"] == "Thinking it over."
  assert message.content == steered[2].split("</think>")[1]


def test_tool_messages_reach_the_template(server):
  """The prompt the template renders is counted in usage (one token per byte, BOS one)."""
  messages = [
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "c1", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "cold"},
      {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "very "},
                                                          {"type": "text", "text": "cold"}]},
      {"role": "user", "content": RECALL}]
  out = server.client().chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                max_tokens=1, temperature=0)
  rendered = ("T:get_weather;user:Weather?;C[c1]:get_weather,city=Oslo,days=2;R[c1]:cold;"
              "R[c2]:very cold;<think>" + RECALL)
  assert out.usage.prompt_tokens == 1 + len(rendered.encode())


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
     "tools.0.function.parameters"),
])
def test_bad_tools_are_400_naming_the_field(server, body, param):
  response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
      "model": MODEL, "messages": ASK, "tools": [WEATHER], **body})
  assert response.status_code == 400 and response.json()["error"]["param"] == param
  assert httpx.get(f"{server.url}/health").status_code == 200
