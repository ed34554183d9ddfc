"""Generated text to ``reasoning_content`` and content: the ``<think>...</think>`` split of
DeepSeek-V3.2 and GLM-5, and the whole chat output (reasoning, then content parsed for tool
calls).

The rule is vLLM's ``deepseek_r1`` reasoning parser's: a ``<think>`` at the very start of the
generation is dropped, and everything up to the first ``</think>`` is reasoning (all of it when
no ``</think>`` comes: a generation cut short while thinking); the text after it is content.
Both templates may open ``<think>`` in the prompt (thinking mode), so a generation often
starts inside reasoning with only ``</think>`` appearing. Unlike ``deepseek_r1``, which calls a
generation without ``</think>`` reasoning whatever the prompt, a generation starts in
reasoning only when the prompt ends inside an open ``<think>`` (``prompt_opens_think``) or it
begins with ``<think>`` itself; otherwise (thinking off: the templates close ``</think>`` in
the prompt) it is all content, as vLLM's ``deepseek_v3`` parser does with thinking off.

Tool calls are parsed only from the content: a ``<tool_call>`` inside ``<think>`` stays
reasoning.
"""

from __future__ import annotations

import dataclasses

from mla_jax.serving.tool_parsers import TOOL_PARSERS, ToolParser, held_back

THINK, END_THINK = "<think>", "</think>"


def prompt_opens_think(prompt: str) -> bool:
  """Whether the rendered prompt ends inside a ``<think>`` block (the template opened it)."""
  return prompt.rfind(THINK) > prompt.rfind(END_THINK)


class ReasoningParser:
  """Splits text fed in pieces into reasoning and content (see the module docstring)."""

  def __init__(self, in_reasoning: bool = False):
    self._in_reasoning = in_reasoning
    self._state = "start"
    self._buf = ""

  def feed(self, text: str, final: bool = False) -> tuple[str, str]:
    """(reasoning, content) that ``text`` completed; ``final``: no more text comes."""
    self._buf += text
    reasoning = content = ""
    if self._state == "start":
      if self._buf.startswith(THINK):
        self._buf = self._buf[len(THINK):]
        self._state = "reasoning"
      elif THINK.startswith(self._buf) and not final:
        return "", ""  # may still become <think>
      else:
        self._state = "reasoning" if self._in_reasoning else "content"
    if self._state == "reasoning":
      at = self._buf.find(END_THINK)
      if at < 0:
        keep = 0 if final else held_back(self._buf, [END_THINK])
        reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return reasoning, ""
      reasoning, self._buf = self._buf[:at], self._buf[at + len(END_THINK):]
      self._state = "content"
    content, self._buf = self._buf, ""
    return reasoning, content

  def finish(self) -> tuple[str, str]:
    return self.feed("", final=True)


@dataclasses.dataclass
class ChatDelta:
  """What a piece of the generation gave a chat message."""

  reasoning: str = ""
  content: str = ""
  tool_calls: list[dict] = dataclasses.field(default_factory=list)


class ChatOutputParser:
  """The reasoning split, then the tool-call parser over the content (either may be None)."""

  def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
               max_calls: int | None = None):
    self.reasoning, self.tools, self.max_calls = reasoning, tools, max_calls

  @property
  def calls(self) -> list[dict]:
    """The calls parsed so far (the first ``max_calls``)."""
    return self.tools.calls[:self.max_calls] if self.tools is not None else []

  def feed(self, text: str, final: bool = False) -> ChatDelta:
    if self.reasoning is not None:
      reasoning, content = self.reasoning.feed(text, final)
    else:
      reasoning, content = "", text
    if self.tools is None:
      return ChatDelta(reasoning, content)
    parsed = self.tools.feed(content)
    if final:
      end = self.tools.finish()
      parsed.content += end.content
      for d in end.tool_calls:
        _merge(parsed.tool_calls, d)
    kept = [d for d in parsed.tool_calls
            if self.max_calls is None or d["index"] < self.max_calls]
    return ChatDelta(reasoning, parsed.content, kept)

  def parse(self, text: str) -> ChatDelta:
    """The whole generation at once."""
    out = self.feed(text, final=True)
    return ChatDelta(out.reasoning, out.content, [dict(c) for c in self.calls])


def _merge(deltas: list[dict], d: dict) -> None:
  """Adds tool-call delta ``d`` to ``deltas`` (one entry per call index)."""
  for old in deltas:
    if old["index"] == d["index"]:
      old.update({k: v for k, v in d.items() if k != "function"})
      function = old.setdefault("function", {})
      for k, v in d.get("function", {}).items():
        function[k] = function.get(k, "") + v if k == "arguments" else v
      return
  deltas.append(d)


REASONING_PARSERS = ("deepseek_v3", "glm45")  # vLLM's names; both are the <think> split here
# model_type (config.json) -> (tool-call parser, reasoning parser), as vLLM's recipes serve them
DEFAULT_PARSERS = {"deepseek_v32": ("deepseek_v32", "deepseek_v3"),
                   "deepseek_v4": ("deepseek_v4", "deepseek_v3"),
                   "glm_moe_dsa": ("glm45", "glm45")}


def default_parsers(model_type: str | None) -> tuple[str | None, str | None]:
  """The parsers a checkpoint of ``model_type`` gets without flags (none for others)."""
  return DEFAULT_PARSERS.get(model_type, (None, None))


def parser_tags(tool_parser: str | None, reasoning_parser: str | None) -> tuple[str, ...]:
  """The tags the parsers read: a tokenizer that spells one as a special token must keep it
  when decoding."""
  tags = [THINK, END_THINK] if reasoning_parser else []
  if tool_parser is not None:
    tags += TOOL_PARSERS[tool_parser].tags
  return tuple(tags)


def output_parser(tool_parser: str | None, reasoning_parser: str | None, tools, *,
                  opens_think: bool, max_calls: int | None = None) -> ChatOutputParser | None:
  """A fresh parser for one choice: ``tool_parser`` None (or ``tools`` None) parses no calls,
  ``reasoning_parser`` None splits no reasoning; None when neither applies. ``max_calls``:
  the calls returned (OpenAI's ``parallel_tool_calls: false``: 1; None: all)."""
  calls = TOOL_PARSERS[tool_parser](tools) if tool_parser and tools is not None else None
  thinking = ReasoningParser(opens_think) if reasoning_parser else None
  if calls is None and thinking is None:
    return None
  return ChatOutputParser(thinking, calls, max_calls)
