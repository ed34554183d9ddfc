"""The one way the benchmarks time things.

Every timed call ends with ``block_until_ready`` on its result (jax dispatches
asynchronously: without it a timer measures the dispatch, not the work); warm-up calls
(compilation) come first and are not counted; variants measured together run interleaved (A,
B, A, B, ...), so the shared machine's slow drift hits them alike; a variant's samples reduce
to their median (the usual figure) or their best (the least disturbed run, for ratios on a
noisy machine). Times are wall seconds.

jax is imported only to wait for results, so a script run by another interpreter (torch's,
``hf_eager_decode.py``) can pass ``sync=None`` for computations that are already done when
they return.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "best": min}


def _block(value):
  import jax

  return jax.block_until_ready(value)


def once(fn: Callable[..., Any], *args, sync: Callable[[Any], Any] | None = _block
         ) -> tuple[Any, float]:
  """``fn(*args)``'s result and the wall seconds it took, up to the result being ready."""
  t0 = time.perf_counter()
  result = fn(*args)
  if sync is not None:
    sync(result)
  return result, time.perf_counter() - t0


def samples(fns: Mapping[str, Callable[..., Any]], repeats: int, *, warmup: int = 1,
            setup: Mapping[str, Callable[[], tuple]] | None = None,
            sync: Callable[[Any], Any] | None = _block) -> dict[str, list[float]]:
  """``repeats`` timed calls of each function after ``warmup`` untimed ones, interleaved.

  ``setup[name]()``, when given, makes the arguments of each call of ``fns[name]`` outside
  the timing (e.g. fresh buffers for a program that donates its inputs).
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  args = lambda name: setup[name]() if setup and name in setup else ()
  for name, fn in fns.items():
    for _ in range(warmup):
      once(fn, *args(name), sync=sync)
  out = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      out[name].append(once(fn, *args(name), sync=sync)[1])
  return out


def side_by_side(fns: Mapping[str, Callable[..., Any]], repeats: int, *, warmup: int = 1,
                 stat: str = "median", setup: Mapping[str, Callable[[], tuple]] | None = None,
                 sync: Callable[[Any], Any] | None = _block) -> dict[str, float]:
  """Seconds per call of each function (``stat`` of its interleaved samples)."""
  reduce = STATS[stat]
  return {name: reduce(ts) for name, ts in
          samples(fns, repeats, warmup=warmup, setup=setup, sync=sync).items()}


def timed(fn: Callable[..., Any], repeats: int, *, warmup: int = 1, stat: str = "median",
          setup: Callable[[], tuple] | None = None,
          sync: Callable[[Any], Any] | None = _block) -> float:
  """Seconds per call of one function (``stat`` of ``repeats`` warm calls)."""
  return side_by_side({"": fn}, repeats, warmup=warmup, stat=stat,
                      setup=None if setup is None else {"": setup}, sync=sync)[""]
