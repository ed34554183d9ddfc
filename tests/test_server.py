"""``mla-jax serve`` as users meet it: a subprocess on 127.0.0.1 and a port of its own, driven by
the official ``openai`` client (and raw httpx for malformed requests). Greedy answers equal
``generate``; concurrent streams never mix; a client that goes away frees its pages; bad
requests are 4xx naming the problem; SIGTERM exits 0."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from mla_jax import presets
from mla_jax.checkpoints import load_pretrained
from mla_jax.generation.loop import generate
from mla_jax.tokenizer import ByteTokenizer
from tests.helpers import free_port


MODEL = "recall-chat"
# Refuses a system message, the way HF templates refuse what they cannot render.
TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}"
            "{{ raise_exception('this template takes no system message') }}{% endif %}"
            "{{ bos_token }}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
RECALL = "aQ ..kX zB ...mP rT ..wE cV ?k"
SERVE_FLAGS = ["--num-pages", "48", "--page-size", "16", "--max-num-seqs", "8",
               "--max-step-tokens", "128", "--log-interval", "1000"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """The shipped recall model with a chat template of its own."""
  return recall_checkpoint(tmp_path_factory, MODEL, TEMPLATE)


def recall_checkpoint(tmp_path_factory, name: str, template: str):
  """A copy of the shipped recall model named ``name``, with ``template`` as its chat
  template."""
  path = tmp_path_factory.mktemp("ckpt") / name
  shutil.copytree(presets.RECALL_CHECKPOINT, path)
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": template, "bos_token": "\x01"}))
  return path


def _wait_until_healthy(url: str, procs, *, timeout: float) -> None:
  """Polls ``url``'s /health until it answers 200; a RuntimeError if a process exits first or
  ``timeout`` seconds pass."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if any(p.poll() is not None for p in procs):
      raise RuntimeError(f"a server process exited: {[p.communicate() for p in procs]}")
    with contextlib.suppress(httpx.HTTPError):
      if httpx.get(f"{url}/health", timeout=1).status_code == 200:
        return
    time.sleep(0.3)
  raise RuntimeError(f"the server did not come up in {timeout:g} s")


class Server:
  def __init__(self, checkpoint, *flags):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "mla_jax", "serve", "--checkpoint", str(checkpoint),
         "--dtype", "float32", "--port", str(self.port), *SERVE_FLAGS, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=Path(__file__).parents[1])
    try:
      _wait_until_healthy(self.url, [self.proc], timeout=120)
    except RuntimeError:
      self.stop()
      raise

  def client(self, **kwargs):
    return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"),
                         max_retries=0, timeout=120, **kwargs)

  def metric(self, name: str) -> float:
    text = httpx.get(f"{self.url}/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

  def stop(self, timeout=60):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    out, err = self.proc.communicate(timeout=timeout)
    return self.proc.returncode, out, err


@pytest.fixture(scope="module")
def server(checkpoint):
  s = Server(checkpoint)
  yield s
  code, _, err = s.stop()
  assert code == 0, err


@pytest.fixture(scope="module")
def model(checkpoint):
  return load_pretrained(checkpoint, dtype=jnp.float32, backend="xla")


def _greedy(model, prompts, new):
  """``generate``'s greedy text for each prompt (byte ids), the way the server decodes it."""
  tok = ByteTokenizer()
  ids = [tok.encode(p) if isinstance(p, str) else p for p in prompts]
  return [tok.decode(t) for t in generate(model, ids, new).tokens]


def _chat_ids(messages):
  text = "".join(f"\x01<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
  return ByteTokenizer().encode(text, add_special_tokens=False)


# ---- correctness --------------------------------------------------------------------------


def test_completions_and_chat_equal_generate_streaming_or_not(server, model):
  client = server.client()
  prompts = [RECALL, "zB ..mP ?z", "aQ cV ?c"]
  expected = _greedy(model, prompts, 5)
  for prompt, want in zip(prompts, expected):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == len(ByteTokenizer().encode(prompt))
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
  assert expected[0][0] == "X"  # the recall model answers its lookup
  batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
  assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
  ids = ByteTokenizer().encode(prompts[1])
  assert client.completions.create(model=MODEL, prompt=ids, max_tokens=5,
                                   temperature=0).choices[0].text == expected[1]

  messages = [{"role": "user", "content": "kX ?k"}]
  want = ByteTokenizer().decode(generate(model, [_chat_ids(messages)], 4).tokens[0])
  chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                        temperature=0)
  assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
  stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True})
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
  assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices


def test_seed_reproduces_and_stop_cuts_the_text(server, model):
  client = server.client()
  draw = lambda seed: client.completions.create(model=MODEL, prompt="9#@!~", max_tokens=12,
                                                temperature=2.0, seed=seed).choices[0].text
  assert draw(11) == draw(11)
  assert len({draw(s) for s in range(1, 6)}) > 1
  full = _greedy(model, ["zB ..mP ?z"], 6)[0]
  stop = full[2:4]
  out = client.completions.create(model=MODEL, prompt="zB ..mP ?z", max_tokens=6,
                                  temperature=0, stop=[stop])
  assert out.choices[0].text == full[:full.index(stop)]
  assert out.choices[0].finish_reason == "stop"
  streamed = client.completions.create(model=MODEL, prompt="zB ..mP ?z", max_tokens=6,
                                       temperature=0, stop=stop, stream=True)
  assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


def test_vllm_extra_parameters(server, model):
  """What clients built for vLLM send: stop_token_ids (the stopping token stays in the text,
  as vLLM keeps a token that is not special), include_stop_str_in_output, ignore_eos (the recall
  model never emits its eos: the answer is the same), min_tokens, top_k, min_p, and
  continuous_usage_stats (every chunk carries the usage so far)."""
  client = server.client()
  prompt = RECALL
  full = _greedy(model, [prompt], 8)[0]  # "XQBEEEEE"
  stop_char = next(c for c in full if c != full[0])  # the first token that differs
  create = lambda **extra: client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                     temperature=0, extra_body=extra)
  out = create(stop_token_ids=[ord(stop_char)]).choices[0]
  assert out.text == full[:full.index(stop_char) + 1] and out.finish_reason == "stop"
  out = create(ignore_eos=True).choices[0]
  assert out.text == full and out.finish_reason == "length"
  held = create(stop_token_ids=[ord(stop_char)], min_tokens=4).choices[0].text
  assert len(held) >= 4 and stop_char not in held[:4]
  unsure = "9#@!~"  # a prompt the recall model is not sure of: temperature 1 draws
  sampled = lambda **cut: client.completions.create(
      model=MODEL, prompt=unsure, max_tokens=8, temperature=1.0, seed=1,
      extra_body=cut).choices[0].text
  greedy = _greedy(model, [unsure], 8)[0]
  assert sampled() != greedy
  for cut in ({"top_k": 1}, {"min_p": 1.0}):  # only the most likely token is left to draw
    assert sampled(**cut) == greedy
  # logit_bias (OpenAI's field): +100 forces a token, -100 bans the greedy one; sampled, +100 on
  # two tokens draws only those
  forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                     logit_bias={str(ord("Z")): 100}).choices[0].text
  assert forced == "ZZZZ"
  banned = create(logit_bias={ord(full[0]): -100}).choices[0].text
  assert banned[0] != full[0]
  assert set(sampled(logit_bias={ord("a"): 100, ord("b"): 100})) == {"a", "b"}
  # penalties change the greedy answer to a prompt the model is unsure of, "KUKLLLLL" (the
  # exact rules: tests/test_engine.py; this trained model's margins outlast +2 penalties)
  for penalty, text in (({"presence_penalty": -2.0, "frequency_penalty": -2.0}, "KUKUKUKU"),
                        ({"repetition_penalty": 5.0}, "KUQQQQQQ")):
    assert client.completions.create(model=MODEL, prompt=unsure, max_tokens=8, temperature=0,
                                     extra_body=penalty).choices[0].text == text != greedy
  stop = full[2:4]
  for include in (False, True):
    text = create(stop=[stop], include_stop_str_in_output=include).choices[0].text
    assert text == full[:full.index(stop) + len(stop) * include]
  chunks = list(client.completions.create(
      model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
      stream_options={"include_usage": True}, extra_body={"stream_options": {
          "include_usage": True, "continuous_usage_stats": True}}))
  with_text = [c for c in chunks if c.choices]
  assert "".join(c.choices[0].text for c in with_text) == full
  counts = [c.usage.completion_tokens for c in with_text]
  assert counts == sorted(counts) and counts[-1] == 8 and chunks[-1].usage.completion_tokens == 8
  assert all(c.usage.prompt_tokens == len(ByteTokenizer().encode(prompt)) for c in chunks)


def test_n_samples_each_prompt(server, model):
  """n choices per prompt, prompt-major; seeded samples differ from one another and each
  reproduces; a prompt's tokens count once in usage; greedy choices all equal generate."""
  client = server.client()
  prompts = ["9#@!~", "~!@#9"]  # unlike its lookups, nothing the recall model is sure of
  draw = lambda: client.completions.create(model=MODEL, prompt=prompts, max_tokens=6,
                                           temperature=2.0, seed=7, n=3)
  out = draw()
  texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
  assert len(texts) == 6 and len(set(texts[:3])) > 1 and len(set(texts[3:])) > 1
  assert texts == [c.text for c in sorted(draw().choices, key=lambda c: c.index)]
  single = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6,
                                     temperature=2.0, seed=7)
  assert texts[3] == single.choices[0].text  # sample 0 of a prompt: the request's own seed
  assert out.usage.prompt_tokens == sum(len(ByteTokenizer().encode(p)) for p in prompts)
  assert out.usage.completion_tokens == 6 * 6
  greedy = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                          max_tokens=3, temperature=0, n=2)
  assert len({c.message.content for c in greedy.choices}) == 1 and len(greedy.choices) == 2
  streamed = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6,
                                       temperature=2.0, seed=7, n=3, stream=True)
  joined = ["", "", ""]
  for chunk in streamed:
    for c in chunk.choices:
      joined[c.index] += c.text
  assert joined == texts[3:]


def test_logprobs_follow_openai_formats(server):
  client = server.client()
  out = client.completions.create(model=MODEL, prompt=RECALL, max_tokens=2, temperature=0,
                                  logprobs=3)
  lp = out.choices[0].logprobs
  assert "".join(lp.tokens) == out.choices[0].text and len(lp.top_logprobs[0]) == 3
  assert lp.token_logprobs[0] == max(lp.top_logprobs[0].values()) <= 0
  chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                        max_tokens=2, temperature=0, logprobs=True,
                                        top_logprobs=2)
  content = chat.choices[0].logprobs.content
  assert "".join(c.token for c in content) == chat.choices[0].message.content
  assert all(len(c.top_logprobs) == 2 for c in content)


def _prompt_logprobs_reference(model, ids):
  """float64 log-softmax of the logits predicting ids[1:] (one contiguous forward)."""
  logits = np.asarray(model(np.asarray(ids[:-1])[None], model.init_cache(1, len(ids)))[0][0],
                      np.float64)
  logits -= logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_scoring_with_echo_and_prompt_logprobs(server, model):
  """lm-eval's log-likelihood request (token ids, echo, logprobs 1, max_tokens 1 or 0) and
  vLLM's prompt_logprobs, against a float64 log-softmax of one contiguous forward."""
  client, tok = server.client(), ByteTokenizer()
  prompts = [tok.encode(RECALL), tok.encode("zB ..mP ?z")]
  refs = [_prompt_logprobs_reference(model, ids) for ids in prompts]
  for max_tokens in (1, 0):
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=max_tokens,
                                    temperature=0, logprobs=1, echo=True)
    for choice, ids, ref in zip(sorted(out.choices, key=lambda c: c.index), prompts, refs):
      lp = choice.logprobs
      assert len(lp.tokens) == len(ids) + max_tokens
      assert choice.text.startswith(tok.decode(ids)) and "".join(lp.tokens) == choice.text
      assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
      got = np.array(lp.token_logprobs[1:len(ids)])
      np.testing.assert_allclose(got, ref[np.arange(len(ids) - 1), ids[1:]], rtol=1e-5,
                                 atol=1e-6)
      for p, top in enumerate(lp.top_logprobs[1:len(ids)]):  # lm-eval's is_greedy reads these
        assert list(top) == [tok.decode([int(ref[p].argmax())])]
        np.testing.assert_allclose(list(top.values()), [ref[p].max()], rtol=1e-5, atol=1e-6)
      assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
  assert out.usage.completion_tokens == 0 and out.choices[0].finish_reason == "length"

  # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}}, the prompt token first.
  ids, ref = prompts[1], refs[1]
  out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
  entries = out.choices[0].model_extra["prompt_logprobs"]
  assert entries[0] is None and len(entries) == len(ids)
  for p, entry in enumerate(entries[1:]):
    token = ids[p + 1]
    mine = entry[str(token)]
    assert mine["rank"] == 1 + int((ref[p] > ref[p, token]).sum())
    assert mine["decoded_token"] == tok.decode([token])
    np.testing.assert_allclose(mine["logprob"], ref[p, token], rtol=1e-5, atol=1e-6)
    best = np.argsort(-ref[p])[:2]
    assert all(entry[str(t)]["rank"] == r for r, t in enumerate(best, 1) if t != token)
  assert out.choices[0].logprobs is None and len(out.choices[0].text) == 2  # not echoed

  # chat: once, beside the choices; a stream's first chunk carries it, and an echo's prompt
  chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                        max_tokens=1, temperature=0,
                                        extra_body={"prompt_logprobs": 0})
  chat_ids = _chat_ids([{"role": "user", "content": "a"}])
  assert len(chat.model_extra["prompt_logprobs"]) == len(chat_ids)
  stream = client.completions.create(model=MODEL, prompt=RECALL, max_tokens=3, temperature=0,
                                     echo=True, logprobs=0, stream=True,
                                     extra_body={"prompt_logprobs": 1})
  chunks = list(stream)
  assert chunks[0].choices[0].text.startswith(RECALL)
  assert len(chunks[0].choices[0].model_extra["prompt_logprobs"]) == len(prompts[0])
  assert all("prompt_logprobs" not in c.choices[0].model_extra for c in chunks[1:])
  full = client.completions.create(model=MODEL, prompt=RECALL, max_tokens=3, temperature=0,
                                   echo=True, logprobs=0)
  assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
  assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == \
      full.choices[0].logprobs.token_logprobs


def test_tokenize_and_detokenize(server):
  """vLLM's /tokenize (a prompt, or messages rendered as chat renders them) and /detokenize."""
  tok = ByteTokenizer()
  got = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "aQ",
                                                   "return_token_strs": True}).json()
  assert got == {"count": 3, "max_model_len": got["max_model_len"], "tokens": tok.encode("aQ"),
                 "token_strs": ["", "a", "Q"]}
  bare = httpx.post(f"{server.url}/tokenize", json={"prompt": "aQ", "add_special_tokens": False})
  assert bare.json()["tokens"] == tok.encode("aQ", add_special_tokens=False)
  messages = [{"role": "user", "content": "hi"}]
  chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
  assert chat["tokens"] == _chat_ids(messages)
  back = httpx.post(f"{server.url}/detokenize", json={"tokens": tok.encode("zB ?z")}).json()
  assert back == {"prompt": "zB ?z"}
  for path, body, words in (
      ("/tokenize", {"prompt": "a", "messages": messages}, "not both"),
      ("/tokenize", {}, "prompt or messages"),
      ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "does not exist"),
      ("/detokenize", {"tokens": [65, 10**6]}, "tokens.1: token id 1000000 is outside"),
      ("/detokenize", {"tokens": [-1]}, "tokens")):
    answer = httpx.post(f"{server.url}{path}", json=body)
    assert answer.status_code in (400, 404) and words in answer.json()["error"]["message"], \
        answer.text


def test_models_health_and_metrics(server):
  models = server.client().models.list()
  assert [m.id for m in models.data] == [MODEL]
  assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
  text = httpx.get(f"{server.url}/metrics").text
  for name in ("mla_jax_requests_total", "mla_jax_prompt_tokens_total",
               "mla_jax_generation_tokens_total", "mla_jax_requests_running",
               "mla_jax_requests_waiting", "mla_jax_pages_in_use", "mla_jax_step_programs",
               "mla_jax_time_to_first_token_seconds_bucket",
               "mla_jax_inter_token_latency_seconds_bucket"):
    assert name in text, name


# ---- concurrency and faults ---------------------------------------------------------------


def test_32_concurrent_streams_complete_without_mixing(server, model):
  prompts = [f"{chr(97 + i % 26)}{chr(65 + (i * 7) % 26)} ..{chr(97 + i % 26)}? " * (1 + i % 3)
             for i in range(32)]
  expected = _greedy(model, prompts, 6)
  client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                              timeout=300)

  async def one(prompt):
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                             temperature=0, stream=True)
    ids = set()
    text = []
    async for chunk in stream:
      ids.add(chunk.id)
      text.append(chunk.choices[0].text)
    return "".join(text), ids

  async def all_of_them():
    return await asyncio.gather(*(one(p) for p in prompts))

  results = asyncio.run(all_of_them())
  assert [text for text, _ in results] == expected
  stream_ids = [ids for _, ids in results]
  assert all(len(ids) == 1 for ids in stream_ids) and len(set.union(*stream_ids)) == 32


@pytest.mark.slow  # a server of its own
def test_speculative_server_gives_the_plain_answers(checkpoint, model):
  """``--speculative-tokens 2``: every request drafts with the shipped MTP head; greedy text
  streamed or not equals plain ``generate``'s."""
  server = Server(checkpoint, "--speculative-tokens", "2")
  try:
    client = server.client()
    prompts = [RECALL, "zB ..mP ?z", "aQ cV ?c"]
    for prompt, want in zip(prompts, _greedy(model, prompts, 12)):
      out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
      assert out.choices[0].text == want and out.usage.completion_tokens == 12
      streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True)
      assert "".join(c.choices[0].text for c in streamed) == want
  finally:
    code, _, err = server.stop()
  assert code == 0, err


def _wait_for_pages_free(server, timeout=30):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if server.metric("mla_jax_pages_in_use") == 0 and \
        server.metric("mla_jax_requests_running") == 0:
      return True
    time.sleep(0.2)
  return False


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
  """The request is aborted, not run to its max_tokens: left alone the tiny model would finish
  all 400 tokens within the wait, so the tokens generated after the disconnect tell."""
  body = {"model": MODEL, "prompt": RECALL * 3, "max_tokens": 400, "temperature": 0,
          "stream": True}
  generated = server.metric("mla_jax_generation_tokens_total")
  with httpx.Client(timeout=60) as http:
    with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
      lines = response.iter_lines()
      got = [next(lines) for _ in range(6)]
      assert any(line.startswith("data: {") for line in got)
      assert server.metric("mla_jax_pages_in_use") > 0
  assert _wait_for_pages_free(server)
  assert server.metric("mla_jax_generation_tokens_total") - generated < 200
  assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_refused_request_leaves_the_streams_beside_it_untouched(server, model):
  expected = _greedy(model, [RECALL, "zB ..mP ?z"], 12)
  client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                              timeout=120)

  async def stream(prompt):
    s = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                        temperature=0, stream=True)
    return "".join([c.choices[0].text async for c in s])

  async def refused():
    await asyncio.sleep(0.2)
    with pytest.raises(openai.BadRequestError, match="takes no system message"):
      await client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
          {"role": "system", "content": "x"}, {"role": "user", "content": "y"}])

  async def run():
    return await asyncio.gather(stream(RECALL), stream("zB ..mP ?z"), refused())

  assert asyncio.run(run())[:2] == expected


# ---- bad requests -------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "ab", "max_tokens": 2}
MSG = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_REQUESTS = [
    # (path, body (dict or raw bytes), status, words the message must contain)
    (C, b"{not json", 400, "not valid JSON"),
    (C, b"[1, 2]", 400, "object"),
    (C, {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    (C, {**OK, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {**MSG, "max_tokens": 0}, 400, "max_tokens"),
    (C, {**OK, "max_tokens": 10**9}, 400, "max_tokens"),
    (C, {**OK, "max_tokens": 2.5}, 400, "max_tokens"),
    (C, b'{"model": "recall-chat", "prompt": "a", "temperature": NaN}', 400, "temperature"),
    (C, {**OK, "temperature": -0.5}, 400, "temperature"),
    (C, {**OK, "temperature": 9}, 400, "temperature"),
    (C, {**OK, "top_p": 0}, 400, "top_p"),
    (C, {**OK, "top_p": 1.5}, 400, "top_p"),
    (C, {**OK, "seed": -1}, 400, "seed"),
    (C, {**OK, "seed": "x"}, 400, "seed"),
    (C, {**OK, "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    (C, {k: v for k, v in OK.items() if k != "model"}, 400, "model"),
    (C, {k: v for k, v in OK.items() if k != "prompt"}, 400, "prompt"),
    (C, {**OK, "prompt": ""}, 400, "prompt"),
    (C, {**OK, "prompt": []}, 400, "prompt"),
    (C, {**OK, "prompt": [1, -2]}, 400, "prompt"),
    (C, {**OK, "prompt": [1, 10**6]}, 400, "outside the vocabulary"),
    (C, {**OK, "prompt": 7}, 400, "prompt"),
    (C, {**OK, "prompt": "x" * 2000}, 400, "context"),
    (C, {**OK, "stop": ""}, 400, "stop"),
    (C, {**OK, "stop": ["a", 1]}, 400, "stop"),
    (C, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (C, {**OK, "n": 0}, 400, "n"),
    (C, {**OK, "n": 17}, 400, "n"),
    (C, {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (C, {**OK, "stop_token_ids": [10**6]}, 400, "outside the vocabulary"),
    (C, {**OK, "ignore_eos": "yes"}, 400, "ignore_eos"),
    (C, {**OK, "top_k": -2}, 400, "top_k"),
    (C, {**OK, "top_k": 2**40}, 400, "top_k"),
    (C, {**OK, "min_p": 1.5}, 400, "min_p"),
    (C, {**OK, "min_tokens": 3}, 400, "min_tokens"),
    (C, {**OK, "stream": True, "stream_options": {"continuous_usage_stats": 1}}, 400,
     "continuous_usage_stats"),
    (C, {**OK, "echo": "yes"}, 400, "echo"),
    (C, {**OK, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (CHAT, {**MSG, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (C, {**OK, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {**OK, "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {**OK, "best_of": 2}, 400, "unsupported field 'best_of'"),
    (C, {**OK, "logit_bias": {"abc": 1}}, 400, "logit_bias: keys must be token ids"),
    (C, {**OK, "logit_bias": {"65": 101}}, 400, "logit_bias"),
    (C, {**OK, "logit_bias": {"9999": 1}}, 400, "logit_bias token 9999 is outside the"),
    (CHAT, {**MSG, "logit_bias": {str(t): 1 for t in range(129)}}, 400, "logit_bias"),
    (C, {**OK, "logprobs": 50}, 400, "logprobs"),
    (C, {**OK, "stream": "yes"}, 400, "stream"),
    (CHAT, {k: v for k, v in MSG.items() if k != "messages"}, 400, "messages"),
    (CHAT, {**MSG, "messages": []}, 400, "messages"),
    (CHAT, {**MSG, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    (CHAT, {**MSG, "messages": [{"role": "user"}]}, 400, "content"),
    (CHAT, {**MSG, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "type"),
    (CHAT, {**MSG, "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    (CHAT, {**MSG, "max_completion_tokens": 3}, 400, "not both"),
    (CHAT, {**MSG, "parallel_tool_calls": "no"}, 400, "parallel_tool_calls"),
    (CHAT, {**MSG, "messages": [{"role": "system", "content": "x"}]}, 400, "no system message"),
    ("/v1/embeddings", OK, 404, "/v1/embeddings"),
]


@pytest.mark.parametrize("path, body, status, words", BAD_REQUESTS,
                         ids=[f"{i}-{case[3][:24]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_requests_are_4xx_naming_the_problem(server, path, body, status, words):
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  response = httpx.post(f"{server.url}{path}", content=content, timeout=30,
                        headers={"content-type": "application/json"})
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert words in error["message"], error
  assert httpx.get(f"{server.url}/health").status_code == 200


def test_an_oversized_body_is_413(server):
  response = httpx.post(f"{server.url}{C}", content=b"{" + b" " * (9 * 2**20) + b"}",
                        timeout=60)
  assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
  assert httpx.get(f"{server.url}/health").status_code == 200


# ---- boundaries -----------------------------------------------------------------------------


def test_streamed_text_offsets_equal_the_whole_responses_across_partial_characters(server):
  """Echo with logprobs, streamed one token a chunk: the chunks' tokens, log-probabilities and
  text_offsets joined equal the whole response's, where the prompt holds two-byte characters
  and the draws (0xC3 and 0xA9 biased) are halves of one, whole or not; each offset is the
  previous one plus its token's text."""
  client = server.client()
  prompt = "aQ é€ ?k"
  ask = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=3, echo=True,
             logprobs=0, logit_bias={"195": 100, "169": 100})
  full = client.completions.create(**ask).choices[0]
  chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True)]
  assert len(chunks) > 2 and "".join(c.text for c in chunks) == full.text
  joined = lambda field: sum((getattr(c.logprobs, field) for c in chunks), [])
  lp = full.logprobs
  assert joined("tokens") == lp.tokens and joined("token_logprobs") == lp.token_logprobs
  assert joined("text_offset") == lp.text_offset
  assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
  # Every output token is half a character; the text holds whole ones where two met.
  assert lp.tokens[-8:] == ["\ufffd"] * 8 and set(full.text[len(prompt):]) <= {"é", "\ufffd"}


def test_n_choices_with_a_seed_at_the_top_of_its_range(server):
  """Choice j draws with (seed + j) mod 2**31: from seed 2**31 - 1 the next choices draw with
  seeds 0 and 1, each the answer of a single request with that seed."""
  client = server.client()
  draw = lambda seed, n=1: client.completions.create(
      model=MODEL, prompt="9#@!~", max_tokens=6, temperature=2.0, seed=seed, n=n).choices
  choices = sorted(draw(2**31 - 1, n=3), key=lambda c: c.index)
  assert [c.text for c in choices] == [draw(s)[0].text for s in (2**31 - 1, 0, 1)]


def test_chat_without_max_tokens_runs_to_what_the_page_pool_holds(server):
  """The pool (48 pages of 16: 768 tokens) is smaller than the context (1024): a chat request
  without max_tokens may fill the pool, exactly, and is not refused. A template without any
  <think> tag leaves the answer content under the checkpoint's reasoning parser."""
  messages = [{"role": "user", "content": "kX ?k"}]
  out = server.client().chat.completions.create(model=MODEL, messages=messages,
                                                temperature=0, logit_bias={str(ord("a")): 100})
  room = 48 * 16 - len(_chat_ids(messages))
  assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == room
  assert out.choices[0].message.content == "a" * room
  assert out.choices[0].message.model_extra.get("reasoning_content") is None


def test_a_body_exactly_at_the_size_limit_is_accepted(server):
  """--max-body-bytes (8 MiB): a body of exactly that many bytes is served, whether its length
  is declared or it comes in chunks; one byte more is 413."""
  limit = 8 * 2**20
  body = json.dumps({**OK, "temperature": 0}).encode()
  padded = lambda size: body[:-1] + b" " * (size - len(body)) + b"}"
  chunks = lambda data: (data[i:i + 2**20] for i in range(0, len(data), 2**20))
  with httpx.Client(base_url=server.url, timeout=60) as http:
    for content in (padded(limit), chunks(padded(limit))):
      response = http.post(C, content=content, headers={"content-type": "application/json"})
      assert response.status_code == 200, response.text
    for content in (padded(limit + 1), chunks(padded(limit + 1))):
      response = http.post(C, content=content, headers={"content-type": "application/json"})
      assert response.status_code == 413, response.text


# ---- a second server: auth, overload, SIGTERM ----------------------------------------------


def test_api_key_overload_and_sigterm(checkpoint, tmp_path):
  template = tmp_path / "template.jinja"
  template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                      "[assistant]")
  s = Server(checkpoint, "--api-key", "sesame", "--max-pending", "1", "--max-step-tokens", "1",
             "--shutdown-timeout", "5", "--chat-template", str(template))
  try:
    # --chat-template replaces the checkpoint's (/tokenize renders messages as chat does)
    rendered = httpx.post(f"{s.url}/tokenize", json={
        "messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert ByteTokenizer().decode(rendered) == "[user] hi\n[assistant]"
    with pytest.raises(openai.AuthenticationError):
      s.client(api_key="wrong").completions.create(model=MODEL, prompt="a", max_tokens=1)
    missing = httpx.post(f"{s.url}{C}", json=OK)
    assert missing.status_code == 401 and "API key" in missing.json()["error"]["message"]
    assert s.client(api_key="sesame").completions.create(
        model=MODEL, prompt="ab", max_tokens=2, temperature=0).choices[0].text
    assert httpx.get(f"{s.url}/health").status_code == 200  # no key needed

    # A long request fills the server (--max-pending 1; --max-step-tokens 1 prefills its 700
    # tokens one step at a time): the next request is told to come back.
    auth = {"authorization": "Bearer sesame"}
    filler = concurrent.futures.ThreadPoolExecutor(1).submit(
        httpx.post, f"{s.url}{C}", headers=auth, timeout=120,
        json={**OK, "prompt": "a" * 700, "max_tokens": 60, "temperature": 0, "stream": True})
    deadline = time.monotonic() + 60
    while s.metric("mla_jax_requests_running") + s.metric("mla_jax_requests_waiting") == 0:
      assert time.monotonic() < deadline and not filler.done()
      time.sleep(0.05)
    full = httpx.post(f"{s.url}{C}", json=OK, headers=auth)
    assert full.status_code == 429 and full.headers["retry-after"] == "1"
    assert "full" in full.json()["error"]["message"]
    t0 = time.monotonic()
    code, out, err = s.stop(timeout=60)  # SIGTERM with the request in flight
    assert time.monotonic() - t0 < 5 + 20  # the shutdown timeout, then the engine's stop
    events = [json.loads(line[6:]) for line in filler.result().text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "abort")  # ended, not cut
    assert filler.result().text.rstrip().endswith("data: [DONE]")
    assert code == 0, err
    assert "Traceback" not in err and "server stopped" in out, err
  finally:
    if s.proc.poll() is None:
      s.proc.kill()


@pytest.mark.slow  # two processes compiling the tiny MoE model: over a minute on 2 cores
def test_two_process_server_equals_generate_on_one():
  """Process 0 serves HTTP and schedules; process 1 follows its steps (gloo on 127.0.0.1)."""
  from flax import nnx

  from mla_jax.models.config import tiny_moe_lm
  from mla_jax.models.lm import CausalLM

  coordinator, port = free_port(), free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  procs = [subprocess.Popen(
      [sys.executable, "-m", "mla_jax", "serve", "--preset", "tiny-moe", "--port", str(port),
       "--mesh", "data=1,tensor=2,expert=2", "--coordinator", f"127.0.0.1:{coordinator}",
       "--num-processes", "2", "--process-id", str(i), *SERVE_FLAGS,
       "--no-warmup"],  # both processes would compile every program first: minutes here
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
      cwd=Path(__file__).parents[1]) for i in range(2)]
  try:
    url = f"http://127.0.0.1:{port}"
    _wait_until_healthy(url, procs, timeout=300)
    prompt = list(range(40, 60))
    out = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300
                        ).completions.create(model="tiny-moe", prompt=prompt, max_tokens=6,
                                             temperature=0, logprobs=0)
    model = CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla")
    want = generate(model, [prompt], 6).tokens[0]
    assert out.choices[0].text == ByteTokenizer().decode(want)
    assert out.usage.completion_tokens == 6
  finally:
    procs[0].send_signal(signal.SIGTERM)
    results = [p.communicate(timeout=120) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], results
