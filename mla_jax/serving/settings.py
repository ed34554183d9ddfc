"""What the server's handlers and response builders need besides the engine: its own module
so that ``server`` and ``responses`` both import it and not each other."""

from __future__ import annotations

import dataclasses

from mla_jax.serving.chat import ChatTemplate
from mla_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ServerSettings:
  """What the handlers need besides the engine.

  ``max_pending``: requests queued or running at once (beyond it, 429); ``temperature`` and
  ``top_p``: used where a request gives none (the checkpoint's generation_config.json, else
  OpenAI's 1.0); ``retry_after``: seconds a 429 asks the client to wait;
  ``speculative_tokens``: draft tokens per step of every request (the engine's
  ``max_speculative_tokens`` at most); ``tool_parser`` / ``reasoning_parser``: what chat
  output is parsed with (``tool_parsers.TOOL_PARSERS``, ``reasoning.REASONING_PARSERS``; None:
  not parsed).
  """

  model_name: str
  tokenizer: Tokenizer
  chat_template: ChatTemplate
  max_model_len: int
  vocab_size: int
  pool_tokens: int  # tokens the whole page pool holds: one request's ceiling
  api_key: str | None = None
  max_body_bytes: int = 8 * 2**20
  max_pending: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  retry_after: int = 1
  speculative_tokens: int = 0
  tool_parser: str | None = None
  reasoning_parser: str | None = None
