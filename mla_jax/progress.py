"""A minimal progress bar for long decodes (stderr; redrawn in place on a terminal)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
  def __init__(self, total: int, label: str, *, stream=None, width: int = 30):
    self.total, self.label, self.width = max(total, 1), label, width
    self.stream = stream if stream is not None else sys.stderr
    self.start = time.perf_counter()
    self.count = 0

  def update(self, count: int) -> None:
    self.count = count
    filled = int(self.width * count / self.total)
    rate = count / max(time.perf_counter() - self.start, 1e-9)
    line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{count}/{self.total} {rate:.1f} tok/s")
    end = "\r" if self.stream.isatty() else "\n"
    if end == "\n" and count not in (self.total,) and count % max(self.total // 4, 1):
      return  # not a terminal: a few lines, not one per token
    self.stream.write(line + end)
    self.stream.flush()

  def close(self) -> None:
    if self.stream.isatty():
      self.stream.write("\n")
      self.stream.flush()
