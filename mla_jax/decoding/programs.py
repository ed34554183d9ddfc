"""The bounded cache of compiled programs that ``generate`` and the engine keep, and what a
compiled program is specialised to."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import jax

from mla_jax.checks import static_int

Program = TypeVar("Program")


def signature(tree):
  """What a compiled program is specialised to: the tree and every leaf's type and place."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


class ProgramCache:
  """The ``max_size`` most recently used compiled programs, each under the key of what it was
  compiled for (settings, model structure, the arguments' ``signature``). A hit costs one hash
  of the key; eviction frees the executable."""

  def __init__(self, max_size: int = 32):
    self.max_size = static_int(max_size, "max_size", minimum=1)
    self._programs: collections.OrderedDict = collections.OrderedDict()

  def lookup(self, key: Hashable, compile_program: Callable[[], Program]
             ) -> tuple[Program, float]:
    """The program under ``key``, compiled by ``compile_program()`` on a miss; and the
    seconds spent compiling it (0 when it was cached)."""
    if key in self._programs:
      self._programs.move_to_end(key)
      return self._programs[key], 0.0
    t0 = time.perf_counter()
    program = compile_program()
    seconds = time.perf_counter() - t0
    self._programs[key] = program
    if len(self._programs) > self.max_size:
      self._programs.popitem(last=False)
    return program, seconds

  def get(self, key: Hashable):
    """The program under ``key`` (now the most recently used), or None: nothing compiles."""
    if key not in self._programs:
      return None
    self._programs.move_to_end(key)
    return self._programs[key]

  def keys(self) -> list:
    return list(self._programs)

  def clear(self) -> None:
    self._programs.clear()

  def __len__(self) -> int:
    return len(self._programs)
