"""Progress bars (tqdm on stderr) shared by generation and training."""

from __future__ import annotations

import math
import sys

from tqdm import tqdm


class _FinalLine(tqdm):
  """A bar drawn once, in its final state, when it closes.

  tqdm redraws a bar by writing a carriage return and the new state. A terminal overwrites
  the line; a pipe, a log file or CI output keeps every state, so the bar shows as one line
  per redraw (at least two: the state at creation and the one at close). Started with an
  infinite ``delay`` it draws nothing until ``close`` lifts the delay; the explicit redraws
  (``set_postfix``, and the clear-and-redraw around ``write``) wait for it too.
  """

  _closing = False  # a class default: a disabled tqdm returns from __init__ early

  def refresh(self, *args, **kwargs):
    if self._closing:
      super().refresh(*args, **kwargs)

  def clear(self, *args, **kwargs):
    if self._closing:
      super().clear(*args, **kwargs)

  def close(self):
    self._closing, self.delay = True, 0
    super().close()


def progress_bar(total: int, desc: str, *, unit: str, enabled: bool = True,
                 initial: int = 0) -> tqdm:
  """A bar counting ``unit`` up to ``total``; a silent no-op object when not ``enabled``.

  On a terminal it is redrawn in place; elsewhere only its final line is written."""
  stream = sys.stderr
  if stream.isatty():
    return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=not enabled,
                file=stream, dynamic_ncols=True, leave=True)
  return _FinalLine(total=total, desc=desc, unit=unit, initial=initial, disable=not enabled,
                    file=stream, leave=True, delay=math.inf, mininterval=math.inf)
