"""The server's plain-Python parts: request parsing (errors name the field), incremental text
with stop strings, and chat templates (HF's jinja2 rendering, or the plain format)."""

import json

import pytest

from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.serving.chat import ChatTemplate, TemplateError
from mla_jax.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse
from mla_jax.decoding.text import IncrementalText
from mla_jax.serving.text import TextStream
from mla_jax.tokenizer import ByteTokenizer


def _parse(request_type, **body):
  return parse(request_type, json.dumps(body).encode())


def test_a_completion_takes_every_prompt_form():
  base = dict(model="m", max_tokens=3)
  assert _parse(CompletionRequest, prompt="hi", **base).prompts == ["hi"]
  assert _parse(CompletionRequest, prompt=["a", "b"], **base).prompts == ["a", "b"]
  assert _parse(CompletionRequest, prompt=[1, 2], **base).prompts == [[1, 2]]
  assert _parse(CompletionRequest, prompt=[[1], [2, 3]], **base).prompts == [[1], [2, 3]]
  assert _parse(CompletionRequest, prompt="x", stop="ab", **base).stop_strings == ("ab",)


@pytest.mark.parametrize("body, param, words", [
    (dict(prompt=[1, -2]), "prompt.1", "greater than or equal to 0"),
    (dict(prompt=[1, 2.0]), "prompt.1", r"valid integer \(got 2.0\)"),  # ids, not strings
    (dict(prompt=["a", 3]), "prompt.1", r"valid string \(got 3\)"),
    (dict(prompt=[[1, 2], [3, "x"]]), "prompt.1.1", "valid integer"),
    (dict(prompt=[[1], []]), "prompt.1", "at least 1 item"),
    (dict(prompt="x", stop=["a", ""]), "stop.1", "at least 1 character"),
    (dict(prompt="x", max_tokens="5"), "max_tokens", "valid integer"),
    (dict(prompt="x", best_of=2), "best_of", "unsupported field"),
    (dict(prompt="x", logit_bias={"7": 1, "x": 2}), "logit_bias", "keys must be token ids"),
    (dict(), "prompt", "missing required field"),
])
def test_the_error_names_the_field_the_client_meant(body, param, words):
  with pytest.raises(APIError, match=words) as e:
    _parse(CompletionRequest, model="m", **body)
  assert e.value.status == 400 and e.value.param == param


def test_chat_limits_are_consistent():
  messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                           {"type": "text", "text": "b"}]}]
  request = _parse(ChatCompletionRequest, model="m", messages=messages, max_completion_tokens=4)
  assert request.token_limit == 4 and request.messages[0].text == "ab"
  with pytest.raises(APIError, match="not both"):
    _parse(ChatCompletionRequest, model="m", messages=messages, max_tokens=1,
           max_completion_tokens=2)


def test_text_stream_holds_back_what_may_begin_a_stop_string():
  tok = ByteTokenizer()
  stream = TextStream(tok.decode, stop=("END",))
  ids = list(b"abcEN")
  assert stream.update(ids[:3], finished=False) == "abc"
  assert stream.update(ids, finished=False) == ""         # "EN" could begin "END"
  assert stream.update(ids + list(b"x"), finished=False) == "ENx"
  assert stream.update(ids + list(b"xEND tail"), finished=True) == ""
  assert stream.text == "abcENx"


@pytest.mark.parametrize("include, want", [(False, "abc"), (True, "abcEND")])
def test_text_stream_ends_before_or_after_the_stop_string(include, want):
  """vLLM's include_stop_str_in_output; of two stop strings starting at one place, the
  longer is the one that ended it when both appeared at once."""
  tok = ByteTokenizer()
  stream = TextStream(tok.decode, ("EN", "END"), include_stop=include)
  assert stream.update(list(b"abc"), finished=False) == "abc"
  assert stream.update(list(b"abcEND tail"), finished=True) == want[3:]
  assert stream.text == ("abcEND" if include else "abc")


def test_text_stream_waits_for_a_whole_utf8_character():
  tok = ByteTokenizer()
  stream = TextStream(tok.decode)
  euro = list("€".encode())
  assert stream.update([*b"a", *euro[:2]], finished=False) == "a"
  assert stream.update([*b"a", *euro], finished=False) == "€"


def test_incremental_text_finds_the_earliest_stop_string_across_tokens():
  tok = ByteTokenizer()
  text = IncrementalText(tok.decode, stop=("three", "two"))
  for t in b"one tw":
    text.extend([t])
  assert text.stop_at is None and text.pending_stop() == 2  # "tw" may begin "two"
  text.extend(list(b"o three"))
  assert text.stop_at == 4 and text.text == "one two three"
  assert IncrementalText(tok.decode, stop=("x",)).extend(list(b"nothing")) == "nothing"


def test_incremental_text_decodes_each_token_a_bounded_number_of_times():
  """Feeding n tokens one at a time decodes O(n) tokens in all (the whole output after
  every token would be n^2 / 2), multi-byte characters included."""
  tok, decoded = ByteTokenizer(), []

  def counting(ids):
    decoded.append(len(ids))
    return tok.decode(ids)

  text = IncrementalText(counting, stop=("never",))
  data = ("é€ mixed text " * 80).encode()
  for t in data:
    text.extend([t])
  text.flush()
  assert text.text == data.decode() and text.stop_at is None
  assert sum(decoded) <= 8 * len(data)


def test_chat_template_renders_as_hf_and_refuses_by_its_own_words():
  source = ("{% for m in messages %}{% if m.role == 'system' %}"
            "{{ raise_exception('no system') }}{% endif %}"
            "{{ bos_token }}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
  template = ChatTemplate(source, {"bos_token": "<s>"})
  text = template.render([{"role": "user", "content": "hi"}])
  assert text == "<s>[user] hi\n[assistant]" and not template.is_plain
  with pytest.raises(TemplateError, match="no system"):
    template.render([{"role": "system", "content": "x"}])
  with pytest.raises(CheckpointError, match="not a valid jinja2 template"):
    ChatTemplate("{% for %}")


def test_plain_chat_format_and_templates_read_from_a_checkpoint(tmp_path):
  plain = ChatTemplate.from_checkpoint(None)
  assert plain.is_plain
  assert plain.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": [{"name": "default", "template": "{{ eos_token }}"}],
       "eos_token": {"content": "</s>"}}))
  assert ChatTemplate.from_checkpoint(tmp_path).render([]) == "</s>"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
  with pytest.raises(CheckpointError, match="chat_template must be"):
    ChatTemplate.from_checkpoint(tmp_path)


def test_usage_counts_every_choice_of_a_batched_request():
  """A completions request with several prompts: usage sums every prompt's tokens and every
  choice's output tokens, not the first choice's; a prompt sampled n > 1 times counts once."""
  from types import SimpleNamespace

  from mla_jax.serving.responses import usage as _usage

  choices = [SimpleNamespace(prompt_ids=[1, 2, 3], last=SimpleNamespace(tokens=(7, 8)), sample=0),
             SimpleNamespace(prompt_ids=[4] * 5, last=SimpleNamespace(tokens=(9,)), sample=0),
             SimpleNamespace(prompt_ids=[4] * 5, last=SimpleNamespace(tokens=(9,)), sample=1),
             SimpleNamespace(prompt_ids=[6], last=None, sample=0)]  # not started: no output
  assert _usage(choices) == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}


@pytest.mark.parametrize("header, ok", [
    ("Bearer s3cret-key", True), ("bearer s3cret-key", True), ("Bearer s3cret", False),
    ("Bearer ", False), ("Bearer", False), ("Bearer s3cret-key2", False),
    ("Basic s3cret-key", False), (None, False)])
def test_only_the_whole_api_key_passes(header, ok):
  """Not a prefix of the key, not the empty string, not another scheme."""
  from starlette.requests import Request

  from mla_jax.serving.server import _check_auth

  headers = [] if header is None else [(b"authorization", header.encode())]
  request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                     "headers": headers, "query_string": b""})
  if ok:
    _check_auth(request, "s3cret-key")
  else:
    with pytest.raises(APIError, match="missing or wrong API key"):
      _check_auth(request, "s3cret-key")
