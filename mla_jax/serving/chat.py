"""Chat messages to prompt text: the checkpoint's ``chat_template`` (``tokenizer_config.json``),
rendered with jinja2 as HF's ``apply_chat_template`` does, or a documented plain format for a
checkpoint without one."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.reading import read_json_object
from mla_jax.tokenizer import TOKENIZER_CONFIG, TOKENIZER_FILE, special_token


class TemplateError(ValueError):
  """The template refused these messages (its ``raise_exception``) or failed rendering them."""


def _raise_exception(message: str):
  raise TemplateError(message)


def _strftime_now(format: str) -> str:
  return datetime.datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """HF's ``tojson`` filter: ``json.dumps`` (jinja2's own escapes HTML characters and takes no
  ``ensure_ascii``, which templates pass)."""
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


class ChatTemplate:
  """Renders a list of messages (``{"role", "content"}``, and an assistant's ``tool_calls``, a
  tool message's ``tool_call_id``) to the prompt text that asks for the assistant's turn.

  ``source`` is a jinja2 template, rendered in a sandbox with ``messages``, ``tools``,
  ``add_generation_prompt=True``, the tokenizer's special tokens (``bos_token``,
  ``eos_token``, ...), ``raise_exception``, ``strftime_now`` and HF's ``tojson``, with HF's
  whitespace settings.
  None: the plain format, one ``"{role}: {content}\\n"`` line per message, then
  ``"assistant:"``.
  """

  def __init__(self, source: str | None = None, special_tokens: dict[str, str] | None = None):
    self.source = source
    self.special_tokens = dict(special_tokens or {})
    self._template = None
    if source is not None:
      env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=["jinja2.ext.loopcontrols"])
      env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
      env.filters["tojson"] = _tojson
      try:
        self._template = env.from_string(source)
      except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat_template is not a valid jinja2 template: {e}") from None

  @property
  def is_plain(self) -> bool:
    return self._template is None

  def render(self, messages: list[dict], tools: list[dict] | None = None,
             variables: dict | None = None) -> str:
    """``tools``: OpenAI function tools, which the template gets as ``tools`` (None when the
    request gave none), as HF's ``apply_chat_template(tools=...)`` passes them. ``variables``:
    more for the template (vLLM's ``chat_template_kwargs``, e.g. ``thinking``), which may not
    replace ``messages``, ``tools`` or ``add_generation_prompt`` (a ``TemplateError``). The
    plain format renders no tools (nor tool calls): the server refuses them there."""
    taken = sorted(set(variables or ()) & {"messages", "tools", "add_generation_prompt"})
    if taken:
      raise TemplateError(f"chat_template_kwargs may not set {', '.join(taken)}")
    if self._template is None:
      return "".join(f"{m['role']}: {m['content'] or ''}\n" for m in messages) + "assistant:"
    try:
      return self._template.render(**{**self.special_tokens, **(variables or {})},
                                   messages=messages, tools=tools, add_generation_prompt=True)
    except TemplateError:
      raise
    except jinja2.TemplateError as e:
      raise TemplateError(f"the chat template failed on these messages: {e}") from None

  @classmethod
  def from_checkpoint(cls, directory: str | Path | None,
                      template_file: str | Path | None = None) -> ChatTemplate:
    """The template of ``directory``'s ``tokenizer_config.json`` (HF's default one when it
    names several), or the plain format without a directory, file or template.
    ``template_file``: a jinja2 file that replaces the checkpoint's template (its special
    tokens still come from the checkpoint)."""
    override = None if template_file is None else _read_template(Path(template_file))
    if directory is None:
      return cls(override)
    file = Path(directory) / TOKENIZER_CONFIG
    config = read_json_object(file) or {}
    source = config.get("chat_template") if override is None else override
    if source is None and (Path(directory) / CHAT_TEMPLATE_FILE).is_file():
      source = _read_template(Path(directory) / CHAT_TEMPLATE_FILE)  # where HF now saves it
    if isinstance(source, list):  # HF's named templates: [{"name": ..., "template": ...}]
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = named.get("default")
    if source is not None and not isinstance(source, str):
      raise CheckpointError(f"{file}: chat_template must be a string or a list of named "
                            f"templates with a 'default', got {type(source).__name__}")
    special = {key: special_token(file, config, key)
               for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return cls(source, {key: value for key, value in special.items() if value is not None})


CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Templates mla_jax ships for checkpoints (by config.json's model_type) whose makers publish
# their chat format as code rather than as a template.
SHIPPED_TEMPLATES = {model_type: Path(__file__).parent / "templates" / f"{model_type}.jinja"
                     for model_type in ("deepseek_v32", "deepseek_v4")}


def serving_template(directory: str | Path | None, template_file: str | Path | None,
                     model_type: str | None) -> tuple[ChatTemplate, str]:
  """The template ``mla-jax serve`` renders chat with, and where it came from: the
  ``--chat-template`` file, the checkpoint's own, the one shipped for its ``model_type``
  (``SHIPPED_TEMPLATES``: for a checkpoint with a ``tokenizer.json``, which holds the special
  tokens the template spells; the byte-level ``recall`` preset has none), or else the plain
  format (``"plain"``)."""
  template = ChatTemplate.from_checkpoint(directory, template_file)
  if template_file is not None:
    return template, str(template_file)
  if not template.is_plain:
    return template, "the checkpoint's"
  shipped = SHIPPED_TEMPLATES.get(model_type)
  if shipped is None or not (Path(directory) / TOKENIZER_FILE).is_file():
    return template, "plain"
  return ChatTemplate.from_checkpoint(directory, shipped), f"{shipped.name}, shipped with mla_jax"


def _read_template(file: Path) -> str:
  try:
    return file.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise CheckpointError(f"--chat-template {file}: cannot read it ({e})") from None
