"""The OpenAI-compatible HTTP server (``mla-jax serve``): FastAPI handlers over an ``EngineLoop``.

Handlers run on the event loop and never touch the engine: they check and tokenize a request,
hand it to the engine's thread, and await its updates, which the thread posts back with
``call_soon_threadsafe``. A streaming response sends each update as it comes, as server-sent
events; a client that goes away has its request aborted (its pages freed). See
docs/serving.md for the endpoints and fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from mla_jax.decoding.prompt_checks import ContextLengthError
from mla_jax.serving import forced_calls, protocol, responses
from mla_jax.serving.chat import ChatTemplate, TemplateError
from mla_jax.serving.engine_loop import EngineFailure, EngineLoop
from mla_jax.serving.metrics import ServerMetrics
from mla_jax.serving.constraints import Constraint
from mla_jax.serving.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                      NamedToolChoice)
from mla_jax.serving.reasoning import (ChatOutputParser, output_parser, parser_tags,
                                       prompt_opens_think)
from mla_jax.serving.responses import Choice
from mla_jax.serving.sequence import MAX_SEED, SamplingParams
from mla_jax.serving.settings import ServerSettings
from mla_jax.serving.text import TextStream

logger = logging.getLogger("mla_jax")


@dataclasses.dataclass(frozen=True)
class _ChatOutput:
  """How a chat request's choices are parsed: the tools to parse calls of (None: no calls
  parsed), whether the prompt left ``<think>`` open, and how many calls are returned
  (``parallel_tool_calls: false``: 1)."""

  tools: list[dict] | None
  opens_think: bool
  max_calls: int | None = None

  def parser(self, settings: ServerSettings) -> ChatOutputParser | None:
    return output_parser(settings.tool_parser, settings.reasoning_parser, self.tools,
                         opens_think=self.opens_think, max_calls=self.max_calls)


def create_app(loop: EngineLoop, settings: ServerSettings, metrics: ServerMetrics) -> FastAPI:
  """The app over ``loop``: it starts the loop's thread on startup and stops it (aborting
  whatever is left) on shutdown."""

  @contextlib.asynccontextmanager
  async def lifespan(app):
    if not loop.alive:
      loop.start()
    yield
    await asyncio.to_thread(loop.stop)

  app = FastAPI(title="mla_jax", docs_url=None, redoc_url=None, openapi_url=None,
                lifespan=lifespan)
  handlers = _Handlers(loop, settings, metrics)

  @app.exception_handler(APIError)
  async def api_error(request: Request, e: APIError):
    return _error_response(e)

  @app.exception_handler(HTTPException)
  async def http_error(request: Request, e: HTTPException):  # unknown paths, wrong methods
    return _error_response(APIError(e.status_code, f"{request.method} {request.url.path}: "
                                    f"{e.detail}", type="not_found_error"
                                    if e.status_code == 404 else "invalid_request_error"))

  @app.exception_handler(Exception)
  async def internal_error(request: Request, e: Exception):
    logger.exception("request %s %s failed", request.method, request.url.path)
    return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                    type="internal_error"))

  @app.get("/health")
  async def health():
    if loop.warming_up:
      raise APIError(503, "warming up: the engine is compiling its step programs (requests "
                     "wait for it; mla-jax serve --no-warmup skips it)", type="unavailable",
                     code="warming_up", headers={"Retry-After": str(settings.retry_after)})
    if not loop.alive:
      raise APIError(503, "the engine loop has stopped", type="unavailable")
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    return Response(metrics.exposition(), media_type=ServerMetrics.CONTENT_TYPE)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{
        "id": settings.model_name, "object": "model", "created": _STARTED,
        "owned_by": "mla_jax", "max_model_len": settings.max_model_len}]}

  app.post("/v1/completions")(handlers.completions)
  app.post("/v1/chat/completions")(handlers.chat_completions)
  app.post("/tokenize")(handlers.tokenize)
  app.post("/detokenize")(handlers.detokenize)
  app.add_middleware(_Guard, settings=settings, metrics=metrics)
  return app


class _Guard:
  """ASGI middleware: the API key and the declared body size are checked before any handler
  runs, and every answer is counted by endpoint and status. (A plain ASGI wrapper rather than
  ``BaseHTTPMiddleware``, which would buffer streams and hide client disconnects.)"""

  def __init__(self, app, *, settings: ServerSettings, metrics: ServerMetrics):
    self.app, self.settings, self.metrics = app, settings, metrics

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    status = []

    async def counted_send(message):
      if message["type"] == "http.response.start":
        status.append(message["status"])
      await send(message)

    try:
      request = Request(scope)
      _check_auth(request, self.settings.api_key)
      _check_declared_size(request, self.settings.max_body_bytes)
    except APIError as e:
      await _error_response(e)(scope, receive, counted_send)
    else:
      await self.app(scope, receive, counted_send)
    finally:
      path = scope["path"]
      self.metrics.requests.labels(path if path in _ENDPOINTS else "other",
                                   str(status[0]) if status else "500").inc()


_ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
              "/tokenize", "/detokenize")
_STARTED = int(time.time())


def _error_response(e: APIError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _check_auth(request: Request, api_key: str | None) -> None:
  if api_key is None or not request.url.path.startswith("/v1/"):
    return
  given = request.headers.get("authorization", "")
  scheme, _, token = given.partition(" ")
  if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
    raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                   type="authentication_error", code="invalid_api_key")


def _check_declared_size(request: Request, limit: int) -> None:
  declared = request.headers.get("content-length")
  if declared is not None and declared.isdigit() and int(declared) > limit:
    raise APIError(413, f"the body of {declared} bytes is over this server's limit of "
                   f"{limit} bytes", code="body_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
  """The body, refused past ``limit`` bytes even when no length was declared."""
  body = bytearray()
  async for chunk in request.stream():
    body += chunk
    if len(body) > limit:
      raise APIError(413, f"the body is over this server's limit of {limit} bytes",
                     code="body_too_large")
  return bytes(body)


class _Handlers:
  def __init__(self, loop: EngineLoop, settings: ServerSettings, metrics: ServerMetrics):
    self.loop, self.settings, self.metrics = loop, settings, metrics
    self.pending = 0  # requests queued or running (handlers all run on the event loop)

  # ---- endpoints ------------------------------------------------------------------------

  async def completions(self, request: Request):
    body = await self._body(request, CompletionRequest)
    tokenizer = self.settings.tokenizer
    prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
    echo = [p if isinstance(p, str) else tokenizer.decode(list(p)) for p in body.prompts] \
        if body.echo else None
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
    return await self._serve(request, body, prompts, max_tokens, body.logprobs, chat=False,
                             echo=echo, constraint=body.constraint())

  async def chat_completions(self, request: Request):
    body = await self._body(request, ChatCompletionRequest)
    body.check_tools()
    tools = [t.as_dict() for t in body.tools] if body.tools else None
    self._check_tool_support(body, self.settings.chat_template)
    text, prompt = self._chat_prompt(body.messages, tools, variables=body.chat_template_kwargs)
    max_tokens = body.token_limit
    if max_tokens is None:  # as vLLM: whatever the context (and the page pool) leaves
      room = min(self.settings.max_model_len, self.settings.pool_tokens)
      max_tokens = max(1, room - len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    opens_think = prompt_opens_think(text)
    constraint = body.constraint()
    if body.forces_call:
      if constraint is not None:
        raise APIError(400, f"tool_choice and {constraint.field}: a forced tool call is a "
                       "constraint of its own; give one", param="tool_choice")
      constraint = self._call_constraint(body, tools, opens_think)
    output = _ChatOutput(tools if body.parses_tools else None, opens_think,
                         1 if body.parallel_tool_calls is False else None)
    return await self._serve(request, body, [prompt], max_tokens, logprobs, chat=True,
                             output=output, constraint=constraint)

  async def tokenize(self, request: Request):
    """vLLM's: a prompt's (or rendered messages') token ids, their count and the context."""
    body = await self._body(request, protocol.TokenizeRequest)
    tokenizer = self.settings.tokenizer
    if body.prompt is not None:
      ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
      _, ids = self._chat_prompt(body.messages, add_special_tokens=body.add_special_tokens,
                                 variables=body.chat_template_kwargs)
    answer = {"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids}
    if body.return_token_strs:
      answer["token_strs"] = [responses.token_text(tokenizer, t) for t in ids]
    return answer

  async def detokenize(self, request: Request):
    body = await self._body(request, protocol.DetokenizeRequest)
    vocab = self.settings.vocab_size
    for i, token in enumerate(body.tokens):
      if token >= vocab:
        raise APIError(400, f"tokens.{i}: token id {token} is outside the vocabulary "
                       f"[0, {vocab})", param="tokens")
    return {"prompt": self.settings.tokenizer.decode(body.tokens)}

  # ---- checks ---------------------------------------------------------------------------

  async def _body(self, request: Request, model: type):
    """The request's body, read within the size limit, validated as ``model``, and naming this
    server's model (where it names one: /tokenize and /detokenize may not)."""
    body = protocol.parse(model, await _read_body(request, self.settings.max_body_bytes))
    if body.model is not None:
      self._check_model(body.model)
    return body

  def _chat_prompt(self, messages, tools: list[dict] | None = None, *,
                   add_special_tokens: bool | None = None,
                   variables: dict | None = None) -> tuple[str, list[int]]:
    """The messages (and tools, and ``chat_template_kwargs``' variables) rendered with the
    chat template: the text and its token ids. A template spells its own special tokens
    (HF's apply_chat_template encodes its text without adding any); the plain format gets
    the tokenizer's."""
    template = self.settings.chat_template
    try:
      text = template.render([m.for_template() for m in messages], tools, variables)
    except TemplateError as e:
      param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
      raise APIError(400, f"{param}: {e}", param=param) from None
    if add_special_tokens is None:
      add_special_tokens = template.is_plain
    return text, self.settings.tokenizer.encode(text, add_special_tokens=add_special_tokens)

  def _check_model(self, name: str) -> None:
    if name != self.settings.model_name:
      raise APIError(404, f"model {name!r} does not exist: this server serves "
                     f"{self.settings.model_name!r}", param="model", code="model_not_found")

  def _check_tool_support(self, body: ChatCompletionRequest, template: ChatTemplate) -> None:
    if template.is_plain:
      if body.tools:
        raise APIError(400, "tools: this checkpoint has no chat template, and the plain "
                       "format renders no tools", param="tools")
      for i, m in enumerate(body.messages):
        if m.tool_calls is not None:
          raise APIError(400, f"messages.{i}.tool_calls: this checkpoint has no chat "
                         "template, and the plain format renders no tool calls",
                         param=f"messages.{i}.tool_calls")
    if body.parses_tools and self.settings.tool_parser is None:
      raise APIError(400, "tools: this server parses no tool calls (start it with "
                     "--tool-call-parser), so tool_choice can only be \"none\"",
                     param="tools")

  def _call_constraint(self, body: ChatCompletionRequest, tools: list[dict],
                       opens_think: bool) -> Constraint:
    """``tool_choice`` required or named: a valid call in the parser's format
    (``forced_calls``), after free reasoning when the prompt opened ``<think>``."""
    choice = body.tool_choice
    return forced_calls.call_constraint(
        self.settings.tool_parser, tools,
        name=choice.function.name if isinstance(choice, NamedToolChoice) else None,
        parallel=body.parallel_tool_calls is not False,
        special=self.settings.tokenizer.special_ids(),
        reasoning=opens_think and self.settings.reasoning_parser is not None)

  async def _check_constraint(self, constraint: Constraint | None) -> None:
    """A 400 naming the constraint's field for one the library refuses (a bad schema, regex
    or grammar, a limit met), before anything is queued; compiled off the event loop (a
    large grammar can take a while) and cached for the engine."""
    if constraint is None:
      return
    grammars = self.loop.engine.grammars
    if grammars is None:
      raise APIError(400, f"{constraint.field}: this server serves no structured outputs (it "
                     "was started with --no-structured-outputs)", param=constraint.field)
    try:
      await asyncio.to_thread(grammars.check, constraint)
    except (ValueError, TypeError) as e:
      raise APIError(400, str(e), param=constraint.field) from None

  def _checked(self, prompt: list[int], params: SamplingParams, param: str) -> list[int]:
    """The engine's own check of a request (``Engine.check_request``), as a 400 naming
    ``param`` (and OpenAI's ``context_length_exceeded`` code for a prompt that does not fit)."""
    try:
      return self.loop.engine.check_request(prompt, params, name=param)
    except ContextLengthError as e:
      raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
    except (ValueError, TypeError) as e:
      raise APIError(400, str(e), param=param) from None

  def _params(self, body, max_tokens: int, logprobs: int | None,
              constraint: Constraint | None = None) -> SamplingParams:
    # The prompt's log-probabilities serve prompt_logprobs, and logprobs when echoed.
    depths = [d for d in (body.prompt_logprobs, logprobs if getattr(body, "echo", False)
                          else None) if d is not None]
    try:
      return SamplingParams(
          max_tokens=max_tokens,
          temperature=self.settings.temperature if body.temperature is None else
          body.temperature,
          top_p=self.settings.top_p if body.top_p is None else body.top_p,
          seed=body.seed, stop=body.stop_strings, logprobs=logprobs,
          speculative_tokens=0 if constraint is not None else self.settings.speculative_tokens,
          stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
          include_stop_str_in_output=body.include_stop_str_in_output,
          top_k=max(body.top_k, 0), min_p=body.min_p, min_tokens=body.min_tokens,
          prompt_logprobs=max(depths) if depths else None, logit_bias=body.bias,
          repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
          presence_penalty=body.presence_penalty, constraint=constraint)
    except (ValueError, TypeError) as e:  # the sampling settings' own checks
      raise APIError(400, str(e)) from None

  # ---- running a request ----------------------------------------------------------------

  async def _serve(self, request: Request, body, prompts: list[list[int]], max_tokens: int,
                   logprobs: int | None, *, chat: bool, echo: list[str] | None = None,
                   output: _ChatOutput | None = None, constraint: Constraint | None = None):
    await self._check_constraint(constraint)
    sampling = self._params(body, max_tokens, logprobs, constraint)
    names = (["messages"] if chat else
             [f"prompt.{i}" if len(prompts) > 1 else "prompt" for i in range(len(prompts))])
    prompts = [self._checked(p, sampling, name) for p, name in zip(prompts, names)]
    # n choices of a prompt: indices prompt-major (OpenAI's); sample j of a seeded request
    # draws with seed + j, so its choices differ and each reproduces.
    samples = [j for _ in prompts for j in range(body.n)]
    params = [sampling if sampling.seed is None or j == 0 else dataclasses.replace(
        sampling, seed=(sampling.seed + j) % (MAX_SEED + 1)) for j in samples]
    prompts = [p for p in prompts for _ in range(body.n)]
    echo = [None] * len(prompts) if echo is None else [e for e in echo for _ in range(body.n)]
    if self.pending + len(prompts) > self.settings.max_pending:
      raise APIError(429, f"the server is full ({self.pending} requests in flight): retry "
                     "later", type="rate_limit_error", code="server_busy",
                     headers={"Retry-After": str(self.settings.retry_after)})
    updates: asyncio.Queue = asyncio.Queue()
    parsers = [output.parser(self.settings) if output is not None else None for _ in prompts]
    decode = self.settings.tokenizer.decode
    if any(parsers):  # a tag spelled as a special token must reach the parser
      decode = self.settings.tokenizer.decoder_keeping(
          parser_tags(self.settings.tool_parser, self.settings.reasoning_parser))
    choices = [Choice(i, p, TextStream(decode, params[i].stop,
                                        include_stop=params[i].include_stop_str_in_output),
                       samples[i], echo[i], logprobs, body.prompt_logprobs, parser=parsers[i])
               for i, p in enumerate(prompts)]
    await self._submit(choices, params, updates)
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.stream:
      events = self._stream(choices, updates, response_id, body, chat)
      await anext(events)  # started: its cleanup now runs however the response ends
      return StreamingResponse(events, media_type="text/event-stream")
    try:
      finished = await self._until_finished(request, choices, updates)
    finally:
      self._release(choices)
    if not finished:  # the client went away: nobody reads an answer
      return Response(status_code=499)
    return responses.full_response(response_id, self.settings, choices, chat)

  async def _submit(self, choices: list[Choice], params, updates: asyncio.Queue) -> None:
    if not self.loop.alive:  # nobody would ever take the request
      raise APIError(503, "the engine loop has stopped", type="unavailable")
    event_loop = asyncio.get_running_loop()
    self.pending += len(choices)
    try:
      for choice, p in zip(choices, params):
        deliver = functools.partial(_post_update, event_loop, updates, choice.index)
        choice.request_id = await asyncio.wrap_future(self.loop.add(choice.prompt_ids, p,
                                                                    deliver))
    except BaseException as e:
      self._release(choices)
      if isinstance(e, (ValueError, TypeError)):  # a refusal past ``_checked``'s (a race)
        raise APIError(400, str(e)) from None
      if isinstance(e, EngineFailure):
        raise APIError(503, str(e), type="unavailable") from None
      raise

  def _release(self, choices: list[Choice]) -> None:
    """Aborts the choices still running (a client gone, a failure) and ends their count."""
    for choice in choices:
      if choice.request_id is not None and (choice.last is None or not choice.last.finished):
        self.loop.abort(choice.request_id)
    self.pending -= len(choices)

  async def _next(self, choices, updates: asyncio.Queue):
    # A queue that already holds updates returns at once: yield to the event loop anyway, or
    # a stream the engine outpaces would starve every other connection.
    await asyncio.sleep(0)
    index, update = await updates.get()
    if isinstance(update, EngineFailure):
      raise APIError(500, str(update), type="internal_error")
    choices[index].last = update
    return choices[index]

  async def _until_finished(self, request: Request, choices, updates) -> bool:
    """Waits for every choice to finish: True, or False once the client has disconnected."""
    while not all(c.last is not None and c.last.finished for c in choices):
      try:
        await asyncio.wait_for(self._next(choices, updates), timeout=1.0)
      except TimeoutError:
        if await request.is_disconnected():
          return False  # _release aborts what is left
    return True

  async def _stream(self, choices, updates, response_id: str, body, chat: bool
                    ) -> AsyncIterator[str]:
    chunk = responses.ChunkWriter(response_id, self.settings, chat, body.continuous_usage)
    try:
      yield ""  # the priming step (see _serve): not sent
      if chat:
        for choice in choices:
          yield chunk.role(choice.index, choices)
      while not all(c.last is not None and c.last.finished for c in choices):
        try:
          choice = await self._next(choices, updates)
        except APIError as e:
          yield responses.sse(e.body())
          break
        yield chunk.delta(choice, choices)
      if body.include_usage:
        yield chunk.usage(choices)
      yield "data: [DONE]\n\n"
    finally:
      self._release(choices)


def _post_update(event_loop, updates: asyncio.Queue, index: int, update) -> None:
  """Called on the engine's thread: hands ``update`` of choice ``index`` to the event loop."""
  event_loop.call_soon_threadsafe(updates.put_nowait, (index, update))


def run(app: FastAPI, loop: EngineLoop, *, host: str, port: int,
        shutdown_timeout: float) -> None:
  """Serves ``app`` until SIGINT or SIGTERM. Then it stops accepting, gives the requests in
  flight ``shutdown_timeout`` seconds to finish, aborts the rest (their streams end with
  finish reason ``"abort"`` and ``[DONE]``), stops the engine (the app's lifespan) and
  returns, so the process exits 0."""
  import signal

  import uvicorn

  class Server(uvicorn.Server):
    async def shutdown(self, sockets=None):
      asyncio.get_running_loop().call_later(shutdown_timeout, loop.abort_all)
      await super().shutdown(sockets)

  # uvicorn re-raises the signal it shut down on, once its own handlers are gone: this
  # handler makes that a clean exit rather than death by SIGTERM.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  # uvicorn's own timeout (which cancels handlers mid-response) only backs up the abort.
  config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=shutdown_timeout + 30)
  Server(config).run()
