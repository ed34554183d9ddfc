"""Generated text to OpenAI tool calls, for the two model families the server knows.

- ``deepseek_v32``: DeepSeek-V3.2's DSML (``encoding_dsv32.py`` of the checkpoint)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

  A parameter with ``string="true"`` is the text between the tags; ``string="false"`` is JSON
  (kept as the text when it does not decode).
- ``deepseek_v4``: DeepSeek-V4's DSML, V3.2's invokes and parameters in
  ``<｜DSML｜tool_calls>`` ... ``</｜DSML｜tool_calls>`` (vLLM's ``deepseek_v4`` parser).
- ``glm45``: the GLM-4.5 / 4.6 / 4.7 / GLM-5 chat templates' format, the name ended by a
  newline (4.5, 4.6) or directly by the first ``<arg_key>`` (4.7, 5)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

  A value is JSON-decoded (kept as text when it does not decode) where the tool's schema gives
  the argument a type other than ``string``; otherwise it is the text between the tags.

A parser is fed the text as it comes (``feed``, then ``finish`` once the generation has
ended) and answers with ``ToolDelta``s: the content outside calls, and OpenAI's tool-call
deltas (the first of a call with ``index``, ``id``, ``type`` and ``function.name``, then
``function.arguments`` pieces: ``{"city": "Paris"`` once a parameter's closing tag has come,
``, "days": 3`` for the next, ``}`` at the call's end). Text that could still become a tag is
held back until it is known, so a tag split across chunks never reaches the content; the
whole text parsed at once (``parse``) is the same as the concatenated deltas, since it is the
same machine fed once. Whitespace between content and a call (before its opening tag or
after its closing one) is dropped. Malformed text inside a call block is dropped.

A call cut short by the end of the generation (``max_tokens``) is still returned: with its
name and the parameters whose closing tags came, its arguments closed as a JSON object (a
parameter whose value was cut is left out); the request's finish reason says ``length``.
An opening tag cut short is returned as content.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Sequence


def new_call_id() -> str:
  return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class ToolDelta:
  """What a piece of text gave: content (outside calls) and tool-call deltas (OpenAI's
  ``delta.tool_calls`` entries, at most one per call index)."""

  content: str = ""
  tool_calls: list[dict] = dataclasses.field(default_factory=list)


def held_back(text: str, tags: Sequence[str]) -> int:
  """Characters at the end of ``text`` that begin one of ``tags`` (and may yet complete it)."""
  for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
    if any(t.startswith(text[-n:]) for t in tags):
      return n
  return 0


def _first(text: str, tags: Sequence[str]) -> tuple[int, str] | None:
  """The earliest of ``tags`` in ``text`` (the longest one there), or None."""
  found = [(i, -len(t), t) for t in tags if (i := text.find(t)) >= 0]
  if not found:
    return None
  i, _, tag = min(found)
  return i, tag


def string_typed(schema: dict | None) -> bool:
  """Whether a property's JSON schema lets it be a string (or says nothing of its type)."""
  if not isinstance(schema, dict) or "type" not in schema:
    return True
  kind = schema["type"]
  return "string" in kind if isinstance(kind, list) else kind == "string"


def _json_or_text(text: str):
  try:
    return json.loads(text)
  except ValueError:
    return text


class ToolParser:
  """The machinery both formats share: content outside calls, call deltas, hold-back."""

  start_tag: str = ""
  tags: tuple[str, ...] = ()  # what a tokenizer must not drop as special tokens

  def __init__(self, tools: Sequence[dict] = (), *, call_id: Callable[[], str] = new_call_id):
    # tools: OpenAI function tools as dicts ({"type": "function", "function": {...}})
    self.properties = {t["function"]["name"]: (t["function"].get("parameters") or {})
                       .get("properties") or {} for t in tools}
    self._call_id = call_id
    self._buf = ""
    self._state = "outside"
    self._after_call = False  # whitespace right after a call's end is not content
    self._out: ToolDelta = ToolDelta()
    self.calls: list[dict] = []  # every call so far: {"id", "type", "function": {name, args}}
    self._open = False           # a call's arguments are open
    self._has_args = False

  # ---- the public face --------------------------------------------------------------------

  def feed(self, text: str) -> ToolDelta:
    self._buf += text
    self._run(final=False)
    return self._take()

  def finish(self) -> ToolDelta:
    """The end of the generation: held-back text is content, an open call is closed."""
    self._run(final=True)
    if self._state == "outside":
      self._content(self._buf)
    self._buf = ""
    if self._open:
      self._end_call()
    self._state = "outside"
    return self._take()

  def parse(self, text: str) -> tuple[str, list[dict]]:
    """The whole text at once: its content and its calls."""
    content = self.feed(text).content + self.finish().content
    return content, self.calls

  # ---- for the formats ----------------------------------------------------------------------

  def _take(self) -> ToolDelta:
    out, self._out = self._out, ToolDelta()
    return out

  def _content(self, text: str) -> None:
    if self._after_call:
      stripped = text.lstrip()
      if not stripped:
        return
      text, self._after_call = stripped, False
    self._out.content += text

  def _delta(self, index: int) -> dict:
    for d in self._out.tool_calls:
      if d["index"] == index:
        return d
    d = {"index": index, "function": {}}
    self._out.tool_calls.append(d)
    return d

  def _start_call(self, name: str) -> None:
    call = {"id": self._call_id(), "type": "function",
            "function": {"name": name, "arguments": ""}}
    self.calls.append(call)
    d = self._delta(len(self.calls) - 1)
    d.update(id=call["id"], type="function")
    d["function"].update(name=name, arguments="")
    self._open, self._has_args = True, False

  def _arguments(self, text: str) -> None:
    self.calls[-1]["function"]["arguments"] += text
    d = self._delta(len(self.calls) - 1)["function"]
    d["arguments"] = d.get("arguments", "") + text

  def _argument(self, key: str, value) -> None:
    """One parameter, appended to the open call's JSON object."""
    piece = json.dumps({key: value}, ensure_ascii=False)[1:-1]
    self._arguments(("{" if not self._has_args else ", ") + piece)
    self._has_args = True

  def _end_call(self) -> None:
    self._arguments("}" if self._has_args else "{}")
    self._open = False
    self._after_call = True

  def _outside(self, final: bool) -> bool:
    """Content up to the start tag (whitespace before it dropped). True: the tag was found."""
    hit = _first(self._buf, [self.start_tag])
    if hit is None:
      keep = 0
      if not final:  # what may begin the tag, and the whitespace before it
        keep = held_back(self._buf, [self.start_tag])
        rest = self._buf[:len(self._buf) - keep]
        keep += len(rest) - len(rest.rstrip())
      self._content(self._buf[:len(self._buf) - keep])
      self._buf = self._buf[len(self._buf) - keep:]
      return False
    self._content(self._buf[:hit[0]].rstrip())
    self._after_call = False
    self._buf = self._buf[hit[0] + len(self.start_tag):]
    return True

  def _run(self, final: bool) -> None:
    raise NotImplementedError


_DSML = "｜DSML｜"


class DeepSeekV32ToolParser(ToolParser):
  """DeepSeek-V3.2's DSML function calls (see the module docstring)."""

  start_tag = f"<{_DSML}function_calls>"
  end_tag = f"</{_DSML}function_calls>"
  tags = (start_tag, end_tag)
  invoke = f"<{_DSML}invoke"
  invoke_end = f"</{_DSML}invoke>"
  parameter = f"<{_DSML}parameter"
  parameter_end = f"</{_DSML}parameter>"
  _invoke_re = re.compile(r'\s+name="([^"]*)"\s*>$')
  _parameter_re = re.compile(r'\s+name="([^"]*)"\s+string="(true|false)"\s*>$')

  def _header(self, opener: str, pattern: re.Pattern, ends: Sequence[str]):
    """Inside a block: the next ``opener ...>`` header's match (its text consumed), an end
    tag of ``ends`` (consumed; returned as a string), or None when more text is needed.
    Anything else before them is dropped."""
    hit = _first(self._buf, [opener, *ends])
    if hit is None:
      keep = held_back(self._buf, [opener, *ends])
      self._buf = self._buf[len(self._buf) - keep:]
      return None
    at, tag = hit
    if tag != opener:
      self._buf = self._buf[at + len(tag):]
      return tag
    close = self._buf.find(">", at)
    if close < 0:
      self._buf = self._buf[at:]
      return None
    match = pattern.match(self._buf[at + len(opener):close + 1])
    self._buf = self._buf[close + 1:]
    return match if match else False  # False: a malformed header, dropped

  def _run(self, final: bool) -> None:
    while True:
      if self._state == "outside":
        if not self._outside(final):
          return
        self._state = "block"
      elif self._state == "block":  # between invokes
        got = self._header(self.invoke, self._invoke_re, [self.end_tag])
        if got is None:
          return
        if got == self.end_tag:
          self._state = "outside"
          self._after_call = True
        elif got:
          self._start_call(got.group(1))
          self._state = "invoke"
      elif self._state == "invoke":  # between parameters
        got = self._header(self.parameter, self._parameter_re, [self.invoke_end, self.end_tag])
        if got is None:
          return
        if isinstance(got, str):
          self._end_call()
          self._state = "block" if got == self.invoke_end else "outside"
        elif got:
          self._key, self._is_string = got.group(1), got.group(2) == "true"
          self._state = "value"
      elif self._state == "value":
        at = self._buf.find(self.parameter_end)
        if at < 0:
          return
        value = self._buf[:at]
        self._argument(self._key, value if self._is_string else _json_or_text(value))
        self._buf = self._buf[at + len(self.parameter_end):]
        self._state = "invoke"


class Glm45ToolParser(ToolParser):
  """GLM-4.5 / 4.6 / 4.7 / 5's ``<tool_call>`` format (see the module docstring)."""

  start_tag = "<tool_call>"
  end_tag = "</tool_call>"
  key, key_end = "<arg_key>", "</arg_key>"
  value, value_end = "<arg_value>", "</arg_value>"
  tags = (start_tag, end_tag, key, key_end, value, value_end)

  def _until(self, tags: Sequence[str]):
    """The text before the first of ``tags`` and the tag (both consumed), or None."""
    hit = _first(self._buf, tags)
    if hit is None:
      return None
    text, self._buf = self._buf[:hit[0]], self._buf[hit[0] + len(hit[1]):]
    return text, hit[1]

  def _skip_to(self, tags: Sequence[str]):
    """Drops text up to the first of ``tags`` and returns that tag, or None (keeping what
    could begin one)."""
    got = self._until(tags)
    if got is None:
      keep = held_back(self._buf, tags)
      self._buf = self._buf[len(self._buf) - keep:]
      return None
    return got[1]

  def _run(self, final: bool) -> None:
    while True:
      if self._state == "outside":
        if not self._outside(final):
          return
        self._state = "name"
      elif self._state == "name":
        got = self._until(["\n", self.key, self.end_tag])
        if got is None:
          return
        name, tag = got[0].strip(), got[1]
        if not name:  # no name: the call is dropped
          self._state = "outside" if tag == self.end_tag else "skip"
          self._after_call = True
          continue
        self._start_call(name)
        if tag == self.end_tag:
          self._end_call()
          self._state = "outside"
        else:
          self._state = "key" if tag == self.key else "args"
      elif self._state == "skip":
        if self._skip_to([self.end_tag]) is None:
          return
        self._state = "outside"
      elif self._state == "args":
        tag = self._skip_to([self.key, self.end_tag])
        if tag is None:
          return
        if tag == self.end_tag:
          self._end_call()
          self._state = "outside"
        else:
          self._state = "key"
      elif self._state == "key":
        got = self._until([self.key_end, self.end_tag])
        if got is None:
          return
        if got[1] == self.end_tag:
          self._end_call()
          self._state = "outside"
        else:
          self._key = got[0].strip()
          self._state = "before_value"
      elif self._state == "before_value":
        tag = self._skip_to([self.value, self.end_tag])
        if tag is None:
          return
        if tag == self.end_tag:  # a key without a value: dropped
          self._end_call()
          self._state = "outside"
        else:
          self._state = "value"
      elif self._state == "value":
        got = self._until([self.value_end])
        if got is None:
          return
        function = self.calls[-1]["function"]["name"]
        schema = self.properties.get(function, {}).get(self._key)
        text = got[0]
        self._argument(self._key, text if string_typed(schema) else _json_or_text(text.strip()))
        self._state = "args"


class DeepSeekV4ToolParser(DeepSeekV32ToolParser):
  """DeepSeek-V4's DSML tool calls: V3.2's grammar in ``tool_calls`` tags."""

  start_tag = f"<{_DSML}tool_calls>"
  end_tag = f"</{_DSML}tool_calls>"
  tags = (start_tag, end_tag)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v32": DeepSeekV32ToolParser,
    "deepseek_v4": DeepSeekV4ToolParser,
    "glm45": Glm45ToolParser,
}
