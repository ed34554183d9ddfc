"""The OpenAI response bodies the server sends: full responses and stream chunks of completions
and chat, with their log-probabilities (OpenAI's legacy and chat formats, vLLM's
``prompt_logprobs``), usage, echoed prompts, and chat's reasoning and tool-call deltas.
``Choice`` is one choice of a request in flight, as the handlers track it."""

from __future__ import annotations

import dataclasses
import json
import time

from mla_jax.serving.reasoning import ChatOutputParser
from mla_jax.serving.sequence import RequestOutput, TokenLogprobs
from mla_jax.serving.settings import ServerSettings
from mla_jax.serving.text import TextStream
from mla_jax.tokenizer import Tokenizer


@dataclasses.dataclass
class Choice:
  """One choice of a request in flight (sample ``sample`` of one of its prompts): its id once
  queued, its text so far, its last update. ``echo``: the prompt's text, to send before the
  completion (completions' ``echo``); ``logprobs`` / ``prompt_logprobs``: the most likely
  tokens the client asked for per token (None: no such field)."""

  index: int
  prompt_ids: list[int]
  text: TextStream
  sample: int = 0
  echo: str | None = None
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  request_id: str | None = None
  last: RequestOutput | None = None
  logprobs_sent: int = 0
  text_offset: int = 0  # a stream's next legacy ``text_offset``: the tokens' texts sent so far
  prompt_sent: bool = False  # a stream sent the echo and the prompt log-probabilities
  parser: ChatOutputParser | None = None  # chat output's reasoning / tool-call split




def sse(payload: dict) -> str:
  return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(choices) -> dict:
  """A prompt's tokens count once however many choices sample it (OpenAI's, vLLM's)."""
  prompt = sum(len(c.prompt_ids) for c in choices if c.sample == 0)
  completion = sum(len(c.last.tokens) for c in choices if c.last is not None)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


def _finish_reason(update: RequestOutput | None) -> str | None:
  return None if update is None or not update.finished else update.finish_reason


def _chat_finish_reason(choice: Choice) -> str | None:
  """OpenAI's ``tool_calls`` for a choice that stopped after calls (``length`` stays: a call
  may have been cut)."""
  reason = _finish_reason(choice.last)
  if reason == "stop" and choice.parser is not None and choice.parser.calls:
    return "tool_calls"
  return reason


def _message(choice: Choice, text: str) -> dict:
  """The assistant message of a finished choice: its text split by the choice's parser."""
  if choice.parser is None:
    return {"role": "assistant", "content": text}
  out = choice.parser.parse(text)
  message = {"role": "assistant",
             "content": out.content if out.content or not (out.reasoning or out.tool_calls)
             else None}
  if choice.parser.reasoning is not None:
    message["reasoning_content"] = out.reasoning or None
  if out.tool_calls:
    message["tool_calls"] = out.tool_calls
  return message


def token_text(tokenizer: Tokenizer, token: int) -> str:
  return tokenizer.decode([token])


def _completion_logprobs(tokenizer: Tokenizer, tokens: list[int],
                         entries: list[TokenLogprobs | None], offset: int, top: int) -> dict:
  """OpenAI's legacy completions format: tokens, their log-probabilities, the ``top`` most
  likely ones as ``{token text: logprob}`` and each token's character offset (``offset`` for
  the first): the lengths of the token texts before it, so a stream's offsets equal the whole
  response's even where a token is part of a UTF-8 character (its text then is U+FFFD, not a
  character of the response's text). An echoed prompt's first token has no entry: None in both
  lists."""
  texts = [token_text(tokenizer, t) for t in tokens]
  offsets, at = [], offset
  for text in texts:
    offsets.append(at)
    at += len(text)
  return {"tokens": texts,
          "token_logprobs": [None if e is None else e.logprob for e in entries],
          "top_logprobs": [None if e is None else
                           {token_text(tokenizer, t): lp for t, lp in e.top[:top]}
                           for e in entries],
          "text_offset": offsets}


def _prompt_logprobs(tokenizer: Tokenizer, choice: Choice) -> list | None:
  """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token
  ``{token id: {logprob, rank, decoded_token}}`` for it and the most likely ones."""
  entries = choice.last.prompt_logprobs
  if choice.prompt_logprobs is None or entries is None:
    return None

  def item(token: int, logprob: float, rank: int) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token)}

  out = [None]
  for e in entries[1:]:
    ranked = {str(e.token): item(e.token, e.logprob, e.rank)}
    for rank, (token, logprob) in enumerate(e.top[:choice.prompt_logprobs], 1):
      ranked.setdefault(str(token), item(token, logprob, rank))
    out.append(ranked)
  return out


def _chat_logprobs(tokenizer: Tokenizer, entries: tuple[TokenLogprobs, ...]) -> dict:
  def item(token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

  return {"content": [{**item(e.token, e.logprob),
                       "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def _logprobs(settings: ServerSettings, choice: Choice, chat: bool, start: int, offset: int,
              *, with_prompt: bool = False):
  """The output tokens' from ``start`` on; ``with_prompt``: an echo's prompt tokens first."""
  entries = choice.last.logprobs
  if entries is None:
    return None
  entries = list(entries[start:])
  if chat:
    return _chat_logprobs(settings.tokenizer, entries)
  tokens = [e.token for e in entries]
  if with_prompt:
    tokens, entries = choice.prompt_ids + tokens, list(choice.last.prompt_logprobs) + entries
  return _completion_logprobs(settings.tokenizer, tokens, entries, offset, choice.logprobs)


def full_response(response_id: str, settings: ServerSettings, choices, chat: bool) -> dict:
  out = []
  for choice in choices:
    choice.text.update(choice.last.tokens, finished=True)
    text = choice.text.text
    echoed = choice.echo is not None
    entry = {"index": choice.index, "finish_reason": _finish_reason(choice.last),
             "logprobs": _logprobs(settings, choice, chat, 0, 0, with_prompt=echoed)}
    if chat:
      entry["message"] = _message(choice, text)
      entry["finish_reason"] = _chat_finish_reason(choice)
    else:
      entry["text"] = choice.echo + text if echoed else text
      if choice.prompt_logprobs is not None:
        entry["prompt_logprobs"] = _prompt_logprobs(settings.tokenizer, choice)
    out.append(entry)
  response = {"id": response_id, "object": "chat.completion" if chat else "text_completion",
              "created": int(time.time()), "model": settings.model_name, "choices": out,
              "usage": usage(choices)}
  if chat and choices[0].prompt_logprobs is not None:  # vLLM's: once, for the one prompt
    response["prompt_logprobs"] = _prompt_logprobs(settings.tokenizer, choices[0])
  return response


class ChunkWriter:
  """Server-sent events in OpenAI's chunk format, one per update; with ``continuous_usage``
  (vLLM's ``continuous_usage_stats``) each carries the request's usage so far."""

  def __init__(self, response_id: str, settings: ServerSettings, chat: bool,
               continuous_usage: bool):
    self.settings, self.chat, self.continuous_usage = settings, chat, continuous_usage
    self.head = {"id": response_id,
                 "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": int(time.time()), "model": settings.model_name}

  def _event(self, choices: list[dict], **extra) -> str:
    return sse({**self.head, "choices": choices, **extra})

  def _choice_event(self, entry: dict, choices, **extra) -> str:
    if self.continuous_usage:
      extra["usage"] = usage(choices)
    return self._event([entry], **extra)

  def role(self, index: int, choices) -> str:
    return self._choice_event({"index": index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}, choices)

  def delta(self, choice: Choice, choices) -> str:
    """A choice's new text and log-probabilities; its first also the echoed prompt and the
    prompt log-probabilities (the engine's first update comes once the prompt is
    computed)."""
    update = choice.last
    first, echo = not choice.prompt_sent, choice.echo or ""
    choice.prompt_sent = True
    text = choice.text.update(update.tokens, finished=update.finished)
    logprobs = _logprobs(self.settings, choice, self.chat, choice.logprobs_sent,
                         choice.text_offset, with_prompt=first and choice.echo is not None)
    choice.logprobs_sent = len(update.tokens)
    if logprobs is not None and not self.chat:  # offsets go on where the last token's text ended
      choice.text_offset += sum(map(len, logprobs["tokens"]))
    entry = {"index": choice.index, "logprobs": logprobs,
             "finish_reason": _finish_reason(update)}
    extra = {}
    if self.chat:
      entry["delta"] = _delta(choice, text, update.finished)
      entry["finish_reason"] = _chat_finish_reason(choice)
      if first and choice.index == 0 and choice.prompt_logprobs is not None:
        extra["prompt_logprobs"] = _prompt_logprobs(self.settings.tokenizer, choice)
    else:
      entry["text"] = echo + text if first else text
      if first and choice.prompt_logprobs is not None:
        entry["prompt_logprobs"] = _prompt_logprobs(self.settings.tokenizer, choice)
    return self._choice_event(entry, choices, **extra)

  def usage(self, choices) -> str:
    return self._event([], usage=usage(choices))


def _delta(choice: Choice, text: str, finished: bool) -> dict:
  """A chat chunk's delta: the new text, split by the choice's parser (``reasoning_content``,
  ``content``, OpenAI's ``tool_calls`` deltas; ``content`` is there whenever nothing else
  is)."""
  if choice.parser is None:
    return {"content": text}
  out = choice.parser.feed(text, final=finished)
  delta = {}
  if out.reasoning:
    delta["reasoning_content"] = out.reasoning
  if out.content or not (out.reasoning or out.tool_calls):
    delta["content"] = out.content
  if out.tool_calls:
    delta["tool_calls"] = out.tool_calls
  return delta
