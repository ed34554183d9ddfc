"""``EngineLoop``: the engine on a thread of its own, so HTTP handlers never block it.

The engine is not thread-safe: only the loop's thread touches it. Handlers send commands
(add, abort, stop) through a queue; the loop runs them between steps, steps while anything is
unfinished, and hands each update to its request's callback (which must be thread-safe, e.g.
``loop.call_soon_threadsafe``). Finished requests are released at once, so nothing grows with
the number served. ``warmup`` runs on the thread before its first step (the server listens
meanwhile, its ``/health`` saying so); requests queued meanwhile wait for it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from mla_jax.serving.engine import Engine
from mla_jax.serving.metrics import ServerMetrics
from mla_jax.serving.sequence import RequestOutput, SamplingParams

logger = logging.getLogger("mla_jax")


class EngineFailure(RuntimeError):
  """The engine failed a step; the requests in flight were aborted."""


Deliver = Callable[[RequestOutput | EngineFailure], None]


@dataclasses.dataclass
class _Request:
  deliver: Deliver
  last_token_time: float | None = None


class EngineLoop:
  """Runs ``engine`` on a daemon thread until ``stop``."""

  def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, *,
               warmup: Callable[[], None] | None = None):
    self.engine, self.metrics, self._warmup = engine, metrics, warmup
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._requests: dict[str, _Request] = {}
    self._thread = threading.Thread(target=self._run, name="mla-jax-engine", daemon=True)
    self._ready = threading.Event()

  # ---- from any thread ------------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  @property
  def warming_up(self) -> bool:
    """Started, and still running ``warmup``."""
    return self.alive and not self._ready.is_set()

  def add(self, prompt_ids: list[int], params: SamplingParams,
          deliver: Deliver) -> concurrent.futures.Future:
    """Queues a request; the future's result is its id, or the engine's refusal (ValueError,
    TypeError). ``deliver`` gets each update, the last one finished."""
    future = concurrent.futures.Future()
    self._commands.put(("add", (prompt_ids, params, deliver, future)))
    return future

  def abort(self, request_id: str) -> None:
    """Stops a request if it is still running (a finished or unknown one: nothing to do)."""
    self._commands.put(("abort", request_id))

  def abort_all(self) -> None:
    """Aborts every request in flight (each gets its last update, finish reason "abort")."""
    self._commands.put(("abort_all", None))

  def stop(self, timeout: float | None = None) -> None:
    """Aborts whatever is left, stops the thread and waits for it (up to ``timeout`` s)."""
    self._commands.put(("stop", None))
    self._thread.join(timeout)

  # ---- on the loop's thread -----------------------------------------------------------

  def _run(self) -> None:
    try:
      if self._warmup is not None:
        self._warmup()
      self._ready.set()
      # The engine's host decode loop; commands run between steps (waiting when idle).
      stopped = lambda: not self._handle_commands(block=not self.engine.has_unfinished())
      for _ in self.engine.run(stopped, self._step):
        self._publish_load()
    except Exception:  # noqa: BLE001 - said here; /health and new requests say it too
      logger.exception("the engine loop failed and stopped")
    finally:
      for request_id in list(self._requests):
        self._abort(request_id)
      self._refuse_queued()
      self._publish_load()

  def _refuse_queued(self) -> None:
    """Requests still queued when the loop ends (a failed warm-up, a stop) are refused rather
    than left waiting."""
    while True:
      try:
        kind, payload = self._commands.get_nowait()
      except queue.Empty:
        return
      if kind == "add" and payload[3].set_running_or_notify_cancel():
        payload[3].set_exception(EngineFailure("the engine loop has stopped"))

  def _handle_commands(self, *, block: bool) -> bool:
    """Runs the queued commands (waiting for one when ``block``); False once told to stop."""
    while True:
      try:
        kind, payload = self._commands.get(block=block, timeout=None)
      except queue.Empty:
        return True
      block = False
      if kind == "stop":
        return False
      if kind == "add":
        self._add(*payload)
      elif kind == "abort_all":
        for request_id in list(self._requests):
          self._abort(request_id)
      else:
        self._abort(payload)

  def _add(self, prompt_ids, params, deliver, future) -> None:
    if not future.set_running_or_notify_cancel():
      return
    try:
      request_id = self.engine.add_request(prompt_ids, params)
    except (ValueError, TypeError) as e:
      future.set_exception(e)
      return
    self._requests[request_id] = _Request(deliver)
    if self.metrics is not None:
      self.metrics.prompt_tokens.inc(len(prompt_ids))
    future.set_result(request_id)

  def _abort(self, request_id: str) -> None:
    request = self._requests.pop(request_id, None)
    if request is None:
      return  # finished (and released) already
    self.engine.abort(request_id)
    request.deliver(self.engine.release(request_id))

  def _step(self) -> list[RequestOutput]:
    """One engine step, if anything is unfinished; its updates, delivered. A failed step
    aborts the requests in flight (each told why) and the loop goes on."""
    if not self.engine.has_unfinished():
      return []
    try:
      updates = self.engine.step()
    except Exception as e:  # noqa: BLE001 - one failed step must not end the server
      logger.exception("engine step failed: aborting the %d requests in flight",
                       len(self._requests))
      failure = EngineFailure(f"the engine failed a step ({type(e).__name__}: {e})")
      for request_id, request in list(self._requests.items()):
        self.engine.abort(request_id)
        self.engine.release(request_id)
        request.deliver(failure)
      self._requests.clear()
      return []
    now = time.perf_counter()
    for update in updates:
      request = self._requests[update.request_id]
      self._record(update, request, now)
      if update.finished:
        del self._requests[update.request_id]
        self.engine.release(update.request_id)
      request.deliver(update)
    return updates

  def _record(self, update: RequestOutput, request: _Request, now: float) -> None:
    if self.metrics is None:
      return
    self.metrics.generation_tokens.inc(len(update.new_tokens))
    if request.last_token_time is None:
      self.metrics.ttft.observe(update.ttft)
    else:
      self.metrics.itl.observe(now - request.last_token_time)
    request.last_token_time = now

  def _publish_load(self) -> None:
    if self.metrics is None:
      return
    scheduler, pages = self.engine.scheduler, self.engine.pages
    self.metrics.running.set(len(scheduler.running))
    self.metrics.waiting.set(len(scheduler.waiting))
    self.metrics.pages_in_use.set(pages.num_in_use)
    self.metrics.pages_cached.set(pages.num_cached)
    self.metrics.programs.set(len(self.engine.programs))
