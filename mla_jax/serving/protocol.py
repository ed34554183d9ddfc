"""The OpenAI API as the server speaks it: request bodies (pydantic, every field checked, an
unsupported one refused by name), error objects, and the response and stream-chunk bodies.

Only what ``docs/serving.md`` lists is accepted. A body is validated from its JSON text in
strict mode (``"5"`` is not a number, ``NaN`` is not a temperature), and the first problem
becomes a 400 naming its field.
"""

from __future__ import annotations

import collections
import json
from typing import Annotated, Any, Literal

import jsonschema
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from mla_jax.serving.constraints import Constraint
from mla_jax.serving.sequence import (MAX_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED,
                                     MAX_TOP_K)


MAX_CHOICES = 16  # n: samples of one prompt a request may ask for


class APIError(Exception):
  """An error the client gets as OpenAI's error object, with its HTTP status."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               type: str = "invalid_request_error", code: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.type, self.code, self.headers = type, code, headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


class _Request(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


PositiveInt = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]  # OpenAI's range
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
StopString = Annotated[str, Field(min_length=1)]
Stop = StopString | Annotated[list[StopString], Field(max_length=4)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(_Request):
  include_usage: bool = False
  continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class TextFormat(_Request):
  type: Literal["text"]


class JsonObjectFormat(_Request):
  type: Literal["json_object"]


class JsonSchema(_Request):
  """OpenAI's ``response_format.json_schema``. ``strict`` true or false: enforced alike."""

  name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
  description: str | None = None
  schema_: dict | bool | None = Field(default=None, alias="schema")  # None: any JSON value
  strict: bool | None = None


class JsonSchemaFormat(_Request):
  type: Literal["json_schema"]
  json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class StructuredOutputs(_Request):
  """vLLM's ``structured_outputs``: exactly one of its constraints."""

  json_: dict | bool | str | None = Field(default=None, alias="json")
  regex: str | None = None
  choice: Annotated[list[str], Field(min_length=1)] | None = None
  grammar: str | None = None
  json_object: bool | None = None

  @pydantic.model_validator(mode="after")
  def _one_constraint(self):
    given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
             if getattr(self, "json_" if name == "json" else name) not in (None, False)]
    if len(given) != 1:
      raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got "
                       f"{', '.join(given) or 'none'})")
    return self


class _Sampling(_Request):
  """The fields both endpoints share."""

  model: str
  max_tokens: PositiveInt | None = None
  temperature: Temperature | None = None
  top_p: TopP | None = None
  seed: Seed | None = None
  stop: Stop | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # choices per prompt
  # vLLM's extra parameters (clients built for vLLM send them; docs/serving.md)
  ignore_eos: bool = False
  stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=256)] | None = None
  include_stop_str_in_output: bool = False
  top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] = 0  # -1 or 0: off (vLLM's old, new default)
  min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
  min_tokens: Annotated[int, Field(ge=0)] = 0
  # vLLM's: each prompt token's log-probability and that many of the most likely tokens'
  prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
  # OpenAI's presence and frequency penalties and vLLM's repetition penalty (docs/serving.md)
  presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
  frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
  repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
  # OpenAI's: {"token id": bias}, added to the logits
  logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]],
                        Field(max_length=MAX_LOGIT_BIAS)] | None = None
  # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
  # guided_* names (docs/serving.md)
  response_format: ResponseFormat | None = None
  structured_outputs: StructuredOutputs | None = None
  guided_json: dict | bool | str | None = None
  guided_regex: str | None = None
  guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
  guided_grammar: str | None = None

  @pydantic.field_validator("logit_bias")
  @classmethod
  def _token_id_keys(cls, bias):
    for key in bias or {}:
      if not key.isdigit() or not key.isascii():
        raise ValueError(f"keys must be token ids, got {key!r}")
    return bias

  def constraint(self) -> Constraint | None:
    """The one constraint the request gives (None: none), or a 400 naming the fields when it
    gives several, or the field whose value cannot be one (``constraints.Constraint``'s
    checks; the library's own come when the engine checks it)."""
    found = []
    fmt = self.response_format
    if isinstance(fmt, JsonObjectFormat):
      found.append(("response_format", lambda f: Constraint("json_object", "", f)))
    elif isinstance(fmt, JsonSchemaFormat):
      schema = {} if fmt.json_schema.schema_ is None else fmt.json_schema.schema_
      found.append(("response_format.json_schema.schema",
                    lambda f: Constraint.json_schema(schema, f)))
    so = self.structured_outputs
    if so is not None:
      for name, kind, value in (("json", "json_schema", so.json_), ("regex", "regex", so.regex),
                                ("choice", "choice", so.choice),
                                ("grammar", "grammar", so.grammar),
                                ("json_object", "json_object", so.json_object or None)):
        if value is not None:
          found.append((f"structured_outputs.{name}", _maker(kind, value)))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
      if getattr(self, name) is not None:
        found.append((name, _maker(kind, getattr(self, name))))
    if len(found) > 1:
      raise APIError(400, f"{' and '.join(f for f, _ in found)}: give one constraint",
                     param=found[1][0])
    if not found:
      return None
    field, make = found[0]
    try:
      return make(field)
    except ValueError as e:
      raise APIError(400, str(e), param=field) from None

  @property
  def bias(self) -> dict[int, float]:
    return {int(key): value for key, value in (self.logit_bias or {}).items()}

  @property
  def stop_strings(self) -> tuple[str, ...]:
    if self.stop is None:
      return ()
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

  @property
  def include_usage(self) -> bool:
    return self.stream_options is not None and self.stream_options.include_usage

  @property
  def continuous_usage(self) -> bool:
    return self.stream_options is not None and self.stream_options.continuous_usage_stats


def _maker(kind: str, value):
  """A constraint of ``kind`` from a request's value, named by the field it came in."""
  if kind == "json_schema":
    return lambda field: Constraint.json_schema(value, field)
  return lambda field: Constraint(kind, "" if kind == "json_object" else value, field)


class CompletionRequest(_Sampling):
  prompt: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
           | TokenIds | Annotated[list[TokenIds], Field(min_length=1)])
  max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: score the prompt only (echo)
  logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
  echo: bool = False  # the prompt before the completion, in text and logprobs

  @property
  def prompts(self) -> list[str | list[int]]:
    """The prompts, one per choice: a string, a list of strings, ids, or lists of ids."""
    if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
      return [self.prompt]
    return list(self.prompt)


class TextPart(_Request):
  type: Literal["text"]
  text: str


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class CalledFunction(_Request):
  name: FunctionName
  arguments: str  # JSON text, as OpenAI sends it

  @pydantic.field_validator("arguments")
  @classmethod
  def _json_object(cls, arguments: str) -> str:
    try:
      value = json.loads(arguments)
    except ValueError as e:
      raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
      raise ValueError("not a JSON object")
    return arguments


class ToolCall(_Request):
  """A call of an earlier assistant turn, sent back in ``messages``."""

  id: Annotated[str, Field(min_length=1)]
  type: Literal["function"]
  function: CalledFunction


class Message(_Request):
  """One message. ``tool_calls`` and ``reasoning_content`` only on an assistant's, whose
  ``content`` may be null (as this server's own answers have it beside them); a ``tool``
  message answers ``tool_call_id``."""

  role: Literal["system", "user", "assistant", "developer", "tool"]
  content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
  name: str | None = None
  tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None
  tool_call_id: Annotated[str, Field(min_length=1)] | None = None
  reasoning_content: str | None = None

  @pydantic.model_validator(mode="after")
  def _fields_of_its_role(self):
    if self.role != "assistant" and self.tool_calls is not None:
      raise ValueError("tool_calls: only an assistant message has them")
    if self.role != "assistant" and self.reasoning_content is not None:
      raise ValueError("reasoning_content: only an assistant message has it")
    if (self.role == "tool") != (self.tool_call_id is not None):
      raise ValueError("a tool message needs tool_call_id (and only a tool message has one)")
    if self.content is None and self.role != "assistant":
      raise ValueError("content: missing (only an assistant message may leave it out: one "
                       "with tool_calls, or only reasoning_content, as this server answers)")
    return self

  @property
  def text(self) -> str | None:
    if self.content is None or isinstance(self.content, str):
      return self.content
    return "".join(part.text for part in self.content)

  def for_template(self) -> dict:
    """The message as a chat template gets it (HF's and vLLM's convention): content as text,
    a tool call's arguments as a dict, the other fields given passed as they are."""
    out = {"role": self.role, "content": self.text}
    for key in ("name", "tool_call_id", "reasoning_content"):
      if getattr(self, key) is not None:
        out[key] = getattr(self, key)
    if self.tool_calls is not None:
      out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
          "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
          for c in self.tool_calls]
    return out


class FunctionDefinition(_Request):
  name: FunctionName
  description: str | None = None
  parameters: dict | None = None  # a JSON Schema of an object
  strict: bool | None = None

  @pydantic.field_validator("parameters")
  @classmethod
  def _object_schema(cls, parameters: dict | None) -> dict | None:
    if parameters is None:
      return None
    try:
      jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
      raise ValueError(f"not a JSON Schema: {e.message}") from None
    if parameters.get("type", "object") != "object":
      raise ValueError(f"the schema must be of an object (\"type\": \"object\"), got "
                       f"{_short(parameters.get('type'))}")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
      raise ValueError("properties must be an object")
    return parameters

  @pydantic.field_validator("strict")
  @classmethod
  def _not_strict(cls, strict: bool | None) -> bool | None:
    if strict:
      raise ValueError("strict: true is not enforced under tool_choice \"auto\" here; "
                       "tool_choice \"required\" or a named function decodes a valid call")
    return strict


class Tool(_Request):
  type: Literal["function"]
  function: FunctionDefinition

  def as_dict(self) -> dict:
    """The tool as a chat template and a parser get it (fields not given left out)."""
    return self.model_dump(exclude_none=True)


class FunctionChoice(_Request):
  name: FunctionName


class NamedToolChoice(_Request):
  type: Literal["function"]
  function: FunctionChoice


class ChatCompletionRequest(_Sampling):
  messages: Annotated[list[Message], Field(min_length=1)]
  max_completion_tokens: PositiveInt | None = None
  logprobs: bool = False
  top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
  tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
  parallel_tool_calls: bool | None = None  # false: at most one call (None: OpenAI's true)
  chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template

  @pydantic.model_validator(mode="after")
  def _one_token_limit(self):
    if self.max_tokens is not None and self.max_completion_tokens is not None:
      raise ValueError("give max_tokens or max_completion_tokens, not both")
    if self.top_logprobs is not None and not self.logprobs:
      raise ValueError("top_logprobs needs logprobs: true")
    return self

  def check_tools(self) -> None:
    """A 400 naming the field for a function defined twice, or a ``tool_choice`` that
    needs tools or names a function not among them."""
    names = [t.function.name for t in self.tools or ()]
    for i, name in enumerate(names):
      if name in names[:i]:
        raise APIError(400, f"tools.{i}.function.name: function {name!r} is defined twice",
                       param=f"tools.{i}.function.name")
    choice = self.tool_choice
    if choice in (None, "none", "auto"):
      return
    if not names:
      raise APIError(400, f"tool_choice: {choice if isinstance(choice, str) else 'a function'}"
                     " needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
      raise APIError(400, f"tool_choice.function.name: {choice.function.name!r} is not among "
                     f"the tools ({', '.join(map(repr, names))})",
                     param="tool_choice.function.name")

  @property
  def forces_call(self) -> bool:
    """Whether tool_choice asks for a call (required, or a named function)."""
    return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

  @property
  def parses_tools(self) -> bool:
    """Whether the output is parsed for tool calls: tools given, and tool_choice not none."""
    return bool(self.tools) and self.tool_choice != "none"

  @property
  def token_limit(self) -> int | None:
    return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


class TokenizeRequest(_Request):
  """vLLM's ``/tokenize``: a prompt, or chat messages rendered with the chat template."""

  model: str | None = None
  prompt: str | None = None
  messages: Annotated[list[Message], Field(min_length=1)] | None = None
  add_special_tokens: bool | None = None  # default: a prompt's yes, rendered messages' no
  return_token_strs: bool = False
  chat_template_kwargs: dict[str, Any] | None = None

  @pydantic.model_validator(mode="after")
  def _one_source(self):
    if (self.prompt is None) == (self.messages is None):
      raise ValueError("give prompt or messages (one of them, not both)")
    return self


class DetokenizeRequest(_Request):
  model: str | None = None
  tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=0)]


def parse(model: type[_Request], body: bytes) -> _Request:
  """``body`` validated as ``model``, or a 400 naming the first field at fault."""
  try:
    return model.model_validate_json(body)
  except pydantic.ValidationError as e:
    # A union field fails once per member, and a list member once per bad element: the member
    # the client meant is the one with the fewest failures ([1, 2.0] is a list of ids with one
    # bad element, not a list of strings with two), then the deepest failure that is not a
    # plain type mismatch.
    errors = e.errors(include_url=False)
    per_member = collections.Counter(_member(error["loc"]) for error in errors)
    error = min(errors, key=lambda error: (per_member[_member(error["loc"])], -len(error["loc"]),
                                           error["type"].endswith("_type")))
    if error["type"] == "json_invalid":
      raise APIError(400, f"the body is not valid JSON: {error['msg']}") from None
    param = ".".join(str(part) for part in error["loc"] if not _is_union_branch(part)) or None
    if error["type"] == "extra_forbidden":
      raise APIError(400, f"unsupported field {param!r}: this server does not implement it",
                     param=param) from None
    if error["type"] == "missing":
      raise APIError(400, f"missing required field {param!r}", param=param) from None
    message = error["msg"].removeprefix("Value error, ")
    where = f"{param}: " if param else ""
    got = "" if error["type"] == "value_error" else f" (got {_short(error.get('input'))})"
    raise APIError(400, f"{where}{message}{got}", param=param) from None


def _member(loc) -> tuple:
  """An error location up to the union member it is in (the whole location outside unions)."""
  for i, part in enumerate(loc):
    if _is_union_branch(part):
      return tuple(loc[:i + 1])
  return tuple(loc)


def _is_union_branch(part) -> bool:
  """pydantic names the union member it tried (``str``, ``list[int]``, ...) in an error's
  location; the client only needs the field's path."""
  return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                    or part.startswith(("constrained-", "function-")))


def _short(value) -> str:
  text = json.dumps(value, default=str) if value is not None else "null"
  return text if len(text) <= 60 else text[:57] + "..."
