"""A hang is a failure with a name: ``StallGuard`` watches an engine's steps and raises
``EngineStalled``, naming the stuck requests, once steps stop making progress (a token lost to
a bug would otherwise keep ``Engine.generate`` stepping forever)."""

from __future__ import annotations

from mla_jax.serving.sequence import Status

# Steps in a row without progress before ``Engine.step`` raises ``EngineStalled``.
MAX_STEPS_WITHOUT_PROGRESS = 16


class EngineStalled(RuntimeError):
  """Steps ran without any request making progress: an engine bug named, not a hang."""


class StallGuard:
  """Raises ``EngineStalled`` once ``limit`` steps in a row with unfinished requests left the
  engine's progress as it was: no row computed, no token taken, nothing finished."""

  def __init__(self, limit: int = MAX_STEPS_WITHOUT_PROGRESS):
    self.limit, self.idle, self.last = limit, 0, None

  def after_step(self, progress, seqs) -> None:
    """Called after each step with a value that changes whenever a request makes progress
    (the engine's counters: the same cost at any number of requests) and ``seqs()``, the
    engine's sequences (read only to name the stuck ones)."""
    stuck = progress == self.last and any(s.status is not Status.FINISHED for s in seqs())
    self.idle = self.idle + 1 if stuck else 0
    self.last = progress
    if self.idle >= self.limit:
      stuck = [s for s in seqs() if s.status is not Status.FINISHED]
      self.idle = 0
      raise EngineStalled(
          f"the engine ran {self.limit} steps without progress: no request took a token, "
          "finished or computed a prompt row; stuck: " + "; ".join(
              f"{s.request_id!r} ({s.status.value}, {s.num_cached} of {len(s.tokens)} tokens "
              f"computed, {s.num_output} of max_tokens {s.params.max_tokens} generated)"
              for s in stuck))
