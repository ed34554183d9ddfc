"""Progress bars (tqdm on stderr) shared by generation and training."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total: int, desc: str, *, unit: str, enabled: bool = True,
                 initial: int = 0) -> tqdm:
  """A bar counting ``unit`` up to ``total``; a silent no-op object when not ``enabled``."""
  return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=not enabled,
              file=sys.stderr, dynamic_ncols=True, leave=True)
