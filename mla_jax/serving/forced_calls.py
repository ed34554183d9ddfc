"""``tool_choice: "required"`` or a named function, enforced: a grammar (llguidance's Lark) of a
valid call of the offered tools in the tool parser's format, which the request then decodes
under (``constraints.Constraint``).

A call is the parser's tags around the function's name and its arguments: the properties of
its ``parameters`` schema in their declared order, the required ones always and the others
optionally (no others). A value the parser reads as text (``tool_parsers.string_typed``: the
property may be a string) is free text up to its closing tag (one of the schema's ``enum`` /
``const`` strings where it gives them); any other value is JSON under the property's schema
(llguidance's inline ``%json``). So the parsed call is a call of an offered function with
arguments valid under its schema, save for string keywords a text value cannot carry
(``pattern``, ``minLength``, ``maxLength``, ``format``), which are not enforced. After the calls
the generation must end (the grammar is complete: the request stops, ``finish_reason``
``"tool_calls"``). A prompt that opens ``<think>`` first allows free reasoning up to
``</think>``.

A tag that is one special token of the tokenizer (GLM-5's ``<tool_call>``) is required as that
token (``<[id]>``), as the model writes it; otherwise as its text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from mla_jax.serving.constraints import JSON_OPTIONS, Constraint
from mla_jax.serving.reasoning import END_THINK
from mla_jax.serving.tool_parsers import DeepSeekV32ToolParser as Dsml
from mla_jax.serving.tool_parsers import Glm45ToolParser as Glm
from mla_jax.serving.tool_parsers import TOOL_PARSERS, string_typed

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


class _Grammar:
  """Lark rules under construction, and how to spell a tag."""

  def __init__(self, special: Mapping[str, int]):
    self.special = special
    self.rules: list[str] = []
    self._count = 0

  def tag(self, text: str) -> str:
    token = self.special.get(text)
    return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)

  def rule(self, body: str, options: str = "") -> str:
    """A new rule of ``body``; its name."""
    self._count += 1
    name = f"r{self._count}"
    self.rules.append(f"{name}{options}: {body}")
    return name

  def text_until(self, end: str) -> str:
    """Any text, then the tag ``end`` (the text never holds it)."""
    if end in self.special:
      return f"/(?s:.*)/ {self.tag(end)}"
    escaped = "".join("\\" + c if c in _REGEX_META else c for c in end)
    return self.rule(f"/(?s:.*){escaped}/", "[lazy]")  # the shortest text that ends in it

  def value(self, schema: dict, end: str, defs: dict) -> str:
    """A parameter's value (text or JSON, as the parser reads it), then the tag ``end``."""
    if string_typed(schema):
      options = ([schema["const"]] if "const" in schema else schema.get("enum"))
      if options and all(isinstance(o, str) for o in options):
        choices = " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
        return f"({choices}) {self.tag(end)}"
      return self.text_until(end)
    inline = {**defs, **schema, "x-guidance": JSON_OPTIONS}
    return f"{self.rule('%json ' + json.dumps(inline, ensure_ascii=False))} {self.tag(end)}"


def _parameters(tool: dict) -> tuple[list[tuple[str, dict, bool]], dict]:
  """A tool's properties as ``(name, schema, required)`` in declared order, and its schema's
  definitions (which a property's ``$ref`` may point into)."""
  schema = tool["function"].get("parameters") or {}
  required = set(schema.get("required") or ())
  properties = schema.get("properties") or {}
  defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
  return [(k, v if isinstance(v, dict) else {}, k in required)
          for k, v in properties.items()], defs


def _glm_call(g: _Grammar, tool: dict) -> str:
  parameters, defs = _parameters(tool)
  parts = [g.tag(Glm.start_tag), json.dumps(tool["function"]["name"]), '"\\n"?']
  for key, schema, required in parameters:
    pair = g.rule(f'{g.tag(Glm.key)} {json.dumps(key, ensure_ascii=False)} {g.tag(Glm.key_end)}'
                  f' "\\n"? {g.tag(Glm.value)} {g.value(schema, Glm.value_end, defs)} "\\n"?')
    parts.append(pair if required else pair + "?")
  parts.append(g.tag(Glm.end_tag))
  return g.rule(" ".join(parts))


def _dsml_call(g: _Grammar, tool: dict) -> str:
  parameters, defs = _parameters(tool)
  name = json.dumps(tool["function"]["name"], ensure_ascii=False)[1:-1]
  parts = [json.dumps(f'{Dsml.invoke} name="{name}">\n', ensure_ascii=False)]
  for key, schema, required in parameters:
    kind = "true" if string_typed(schema) else "false"
    head = json.dumps(f'{Dsml.parameter} name="{key}" string="{kind}">', ensure_ascii=False)
    pair = g.rule(f'{head} {g.value(schema, Dsml.parameter_end, defs)} "\\n"')
    parts.append(pair if required else pair + "?")
  parts.append(json.dumps(f"{Dsml.invoke_end}\n", ensure_ascii=False))
  return g.rule(" ".join(parts))


FORMATS = {"glm45": _glm_call, "deepseek_v32": _dsml_call, "deepseek_v4": _dsml_call}


def call_constraint(parser: str, tools: Sequence[dict], *, name: str | None = None,
                    parallel: bool = True, special: Mapping[str, int] | None = None,
                    reasoning: bool = False, field: str = "tool_choice") -> Constraint:
  """The constraint of a valid call in ``parser``'s format (``FORMATS``): of the function
  ``name`` (one call), or of any of ``tools`` (one, or several when ``parallel``).
  ``special``: the tokenizer's special tokens by text; ``reasoning``: free text up to
  ``</think>`` first (the prompt opened ``<think>``)."""
  if parser not in FORMATS:
    raise ValueError(f"{field}: no forced calls in the {parser!r} format")
  g = _Grammar(special or {})
  offered = [t for t in tools if name is None or t["function"]["name"] == name]
  if not offered:
    raise ValueError(f"{field}: function {name!r} is not among the tools")
  call = g.rule(" | ".join(FORMATS[parser](g, tool) for tool in offered))
  single = name is not None or not parallel
  if parser == "glm45":
    body = call if single else f'{call} ("\\n"? {call})*'
  else:
    tags = TOOL_PARSERS[parser]  # V3.2's and V4's DSML differ in their outer tags only
    body = f'{g.tag(tags.start_tag)} "\\n" {call if single else call + "+"} {g.tag(tags.end_tag)}'
  head = f"{g.text_until(END_THINK)} " if reasoning else ""
  return Constraint("grammar", "\n".join([f"start: {head}{body}", *g.rules]), field)
