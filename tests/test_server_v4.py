"""``mla-jax serve --checkpoint`` a DeepSeek-V4 checkpoint (a tiny random one, every layer
type): completions, streamed or not, and a shared-prefix request, give ``mla_jax.generate``'s
greedy text; the DeepSeek-V4 tool-call parser is the default (a flag V4's engine cannot take
is refused by name: tests/test_reliability_cli.py)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from mla_jax.generation import generate
from mla_jax.tokenizer import ByteTokenizer
from mla_jax.v4.checkpoint import load_pretrained, save_pretrained
from tests.test_server import Server
from tests.test_v4_model import build

FLAGS = ("--max-model-len", "128", "--no-warmup")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("v4_serve") / "tiny-v4"
  save_pretrained(build(seed=11, vocab_size=260), path)  # the byte tokenizer's 258 ids fit
  return path


@pytest.mark.slow  # a server of its own
def test_completions_equal_generate(checkpoint):
  model = load_pretrained(checkpoint, dtype=jnp.float32, backend="xla")
  tok = ByteTokenizer()
  prompts = ["a V4 prompt of some length, to cross pages", "a V4 prompt of some length, shared"]
  ids = [tok.encode(p) for p in prompts]
  want = [tok.decode(t) for t in generate(model, ids, 8, eos_id=list(tok.eos_ids)).tokens]
  server = Server(checkpoint, *FLAGS)
  try:
    client = server.client()
    for prompt, text in zip(prompts, want):  # the second shares a page with the first
      out = client.completions.create(model="tiny-v4", prompt=prompt, max_tokens=8,
                                      temperature=0)
      assert out.choices[0].text == text and out.usage.completion_tokens == 8
      streamed = client.completions.create(model="tiny-v4", prompt=prompt, max_tokens=8,
                                           temperature=0, stream=True)
      assert "".join(c.choices[0].text for c in streamed) == text
  finally:
    code, out, err = server.stop()
  assert code == 0, err
  assert "DeepSeek-V4 x 4 layers" in out and "tool-call parser deepseek_v4" in out, out

