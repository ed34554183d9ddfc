"""``/health`` while the engine warms up (the server listens first) and after its loop failed,
in process, over a stand-in engine whose warm-up the test holds."""

import threading
import time

from fastapi.testclient import TestClient

from mla_jax.decoding.driver import Pipeline
from mla_jax.serving.chat import ChatTemplate
from mla_jax.serving.engine_loop import EngineLoop
from mla_jax.serving.metrics import ServerMetrics
from mla_jax.serving.server import ServerSettings, create_app
from mla_jax.tokenizer import ByteTokenizer


class _Idle:
  """An engine with nothing to run that accepts every prompt as it is."""

  def has_unfinished(self):
    return False

  def check_request(self, prompt, params, name="prompt"):
    return prompt

  def run(self, done, step):
    """``Engine.run``: the host decode loop, here with nothing to dispatch."""
    return Pipeline(lambda pipeline, updates: None, lambda flight: []).run(done, step)


def _app(warmup):
  settings = ServerSettings(model_name="m", tokenizer=ByteTokenizer(), chat_template=ChatTemplate(),
                            max_model_len=64, vocab_size=260, pool_tokens=64)
  loop = EngineLoop(_Idle(), warmup=warmup)
  return loop, create_app(loop, settings, ServerMetrics(4))


def _until(condition, timeout=10.0):
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline
    time.sleep(0.01)


def test_health_says_warming_up_until_the_warm_up_ends():
  release = threading.Event()
  loop, app = _app(release.wait)
  with TestClient(app) as http:
    try:
      answer = http.get("/health")
    finally:
      release.set()  # the app's shutdown waits for the warm-up
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    error = answer.json()["error"]
    assert error["code"] == "warming_up" and error["message"].startswith("warming up: ")
    assert "--no-warmup" in error["message"]
    _until(lambda: not loop.warming_up)
    assert http.get("/health").json() == {"status": "ok"}


def test_a_failed_warm_up_is_503_everywhere_rather_than_a_hang():
  def fail():
    raise RuntimeError("out of memory while compiling")

  loop, app = _app(fail)
  with TestClient(app) as http:
    _until(lambda: not loop.alive)
    assert http.get("/health").json()["error"]["message"] == "the engine loop has stopped"
    answer = http.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 1})
    assert answer.status_code == 503 and "stopped" in answer.json()["error"]["message"]
