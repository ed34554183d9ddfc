"""The one host decode loop: dispatches with one in flight.

Every driver decodes by dispatches of compiled programs: ``generate``'s decode programs, the
engine's steps, and the server's loop through the engine. They share two rules, written here:

* **one dispatch in flight.** JAX dispatches asynchronously, so the next dispatch is sent to
  the device before the last one's outputs are read: the device works while the host reads,
  schedules and builds. A driver whose next dispatch needs the last one's outputs on the host
  (an engine step whose drafts or token masks come from it) settles it first
  (``settle_first``, or ``Pipeline.settle`` from inside ``dispatch``);
* **one loop.** ``Pipeline.run`` advances until the driver says it is done, yielding what
  each advance settled; nothing else loops over dispatches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class Pipeline:
  """Dispatches of one driver, the next sent before the last is read.

  ``dispatch(pipeline, updates)`` sends the next dispatch and returns its flight (whatever
  ``settle`` needs to read its outputs), or None when there is nothing to send; it may call
  ``pipeline.settle()`` first, adding the updates to ``updates``. ``settle(flight)`` reads a
  flight's outputs and commits them, returning the updates. ``settle_first(flight)``: whether
  the flight must be settled before the next dispatch is built (by default never).
  """

  def __init__(self, dispatch: Callable[[Pipeline, list], Any],
               settle: Callable[[Any], list],
               settle_first: Callable[[Any], bool] = lambda flight: False):
    self._dispatch, self._settle, self._settle_first = dispatch, settle, settle_first
    self.in_flight: Any = None

  def settle(self) -> list:
    """Reads and commits the flight in flight, if any; its updates."""
    flight, self.in_flight = self.in_flight, None
    return [] if flight is None else self._settle(flight)

  def advance(self) -> list:
    """Sends the next dispatch (settling the flight first when it must be), then settles the
    one before it: the updates settled."""
    updates = []
    if self.in_flight is not None and self._settle_first(self.in_flight):
      updates += self.settle()
    flight = self._dispatch(self, updates)
    updates += self.settle()
    self.in_flight = flight
    return updates

  def run(self, done: Callable[[], bool],
          step: Callable[[], list] | None = None) -> Iterator[list]:
    """The host decode loop: ``step`` (by default ``advance``; a driver's own wraps it with
    its bookkeeping) until ``done()``, yielding each step's updates."""
    step = self.advance if step is None else step
    while not done():
      yield step()
