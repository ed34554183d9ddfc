"""Walk a traced program: which named scopes, primitives and Pallas kernels it contains.

Routes are decided while tracing, so the traced program *is* the route: tests and notebooks
assert on these sets instead of trusting flags (docs/design.md §6). ``collectives`` reads
a compiled program's collectives (context parallelism's exchanges, docs/scaling.md).
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterator
from typing import NamedTuple

import jax
from jax import core as jax_core

_ClosedJaxpr = getattr(jax_core, "ClosedJaxpr", None) or jax.extend.core.ClosedJaxpr
_Jaxpr = getattr(jax_core, "Jaxpr", None) or jax.extend.core.Jaxpr


def _sub_jaxprs(value) -> Iterator:
  """Every (Closed)Jaxpr nested in an equation parameter, including inside containers."""
  if isinstance(value, _ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, _Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)
  elif isinstance(value, dict):
    for item in value.values():
      yield from _sub_jaxprs(item)
  else:  # e.g. pallas_call's kernel jaxpr or custom_vjp's fun_jaxpr hide behind attributes
    for attr in ("jaxpr", "fun_jaxpr", "call_jaxpr"):
      inner = getattr(value, attr, None)
      if isinstance(inner, (_ClosedJaxpr, _Jaxpr)):
        yield from _sub_jaxprs(inner)


class ProgramSummary(collections.namedtuple(
    "ProgramSummary", "scopes primitives kernels kernel_primitives stacks",
    defaults=(frozenset(),))):
  """What a traced program contains.

  scopes: frozenset of scope names; primitives: Counter of primitives outside kernel bodies
  (where a ``cond`` would be runtime routing); kernels: tuple of Pallas kernel names;
  kernel_primitives: Counter of primitives inside kernel bodies (their own loops and guards);
  stacks: frozenset of whole name stacks (``"outer/inner"``), which say in which scope each
  scope sits (``scopes_within``).
  """


def scopes_within(summary: ProgramSummary, scope: str) -> frozenset[str]:
  """The scopes opened inside ``scope`` (e.g. one layer's, when each layer opens its own)."""
  inner = set()
  for stack in summary.stacks:
    names = stack.split("/")
    if scope in names:
      inner.update(names[names.index(scope) + 1:])
  return frozenset(inner)


# Pallas-Triton kernels trace as ``pallas_call``; Mosaic GPU's ``plgpu.kernel`` as ``mpmd_map``
# (``core_map`` before it) over a mesh that carries the kernel's name.
KERNEL_PRIMITIVES = frozenset({"pallas_call", "mpmd_map", "core_map"})


def _kernel_name(eqn) -> str:
  meshes = eqn.params.get("meshes") or (eqn.params.get("mesh"),)
  if getattr(meshes[0], "kernel_name", None):
    return str(meshes[0].kernel_name)
  name = eqn.params.get("name")
  if name:
    return str(name)
  meta = eqn.params.get("name_and_src_info")  # renamed across jax versions
  if meta is not None and getattr(meta, "name", None):
    return str(meta.name)
  return eqn.params["jaxpr"].debug_info.func_name


def walk_equations(jaxpr) -> Iterator[tuple[object, bool]]:
  """``(equation, in_kernel)`` for every equation of a (Closed)Jaxpr and everything nested in
  it; ``in_kernel``: it lies inside a Pallas kernel body."""

  def walk(jx, in_kernel):
    for eqn in jx.eqns:
      yield eqn, in_kernel
      is_kernel = in_kernel or eqn.primitive.name in KERNEL_PRIMITIVES
      for value in eqn.params.values():
        for sub in _sub_jaxprs(value):
          yield from walk(sub, is_kernel)

  yield from walk(jaxpr.jaxpr if isinstance(jaxpr, _ClosedJaxpr) else jaxpr, False)


def summarize_jaxpr(jaxpr) -> ProgramSummary:
  """Scopes, primitive counts and kernel names of a (Closed)Jaxpr and everything inside it."""
  scopes, stacks, kernels = set(), set(), []
  prims, kernel_prims = collections.Counter(), collections.Counter()
  for eqn, in_kernel in walk_equations(jaxpr):
    (kernel_prims if in_kernel else prims)[eqn.primitive.name] += 1
    stack = str(eqn.source_info.name_stack)
    if stack:
      scopes.update(stack.split("/"))
      stacks.add(stack)
    if eqn.primitive.name in KERNEL_PRIMITIVES and not in_kernel:
      kernels.append(_kernel_name(eqn))
  return ProgramSummary(frozenset(scopes), prims, tuple(kernels), kernel_prims,
                        frozenset(stacks))


def summarize(fn, *args, **kwargs) -> ProgramSummary:
  """Traces ``fn(*args, **kwargs)`` (nothing runs) and summarizes the program."""
  return summarize_jaxpr(jax.make_jaxpr(fn)(*args, **kwargs))


def traced_scopes(fn, *args, **kwargs) -> frozenset[str]:
  """Names of every ``jax.named_scope`` (and jit/kernel name) in the traced program."""
  return summarize(fn, *args, **kwargs).scopes


def traced_kernels(fn, *args, **kwargs) -> tuple[str, ...]:
  """Names of the Pallas kernels in the traced program, in trace order."""
  return summarize(fn, *args, **kwargs).kernels


_COLLECTIVE = re.compile(r"=\s*(.*?)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")
_ARRAY_TYPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_TYPE_BYTES = {"pred": 1, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_OP_NAME = re.compile(r'op_name="([^"]*)"')


class Collective(NamedTuple):
  kind: str     # all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute
  nbytes: int   # the size of its result on one device
  op_name: str  # where the program made it (its named scopes), "" when XLA states none


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective instruction of a compiled program's text (``Compiled.as_text()``), as
  written (an instruction inside a loop appears once)."""
  found = []
  for line in hlo_text.splitlines():
    match = _COLLECTIVE.search(line)
    if match is None:
      continue
    nbytes = sum(math.prod(int(d) for d in dims.split(",") if d) *
                 _TYPE_BYTES.get(dtype, int(dtype[1:]) // 8 or 1)
                 for dtype, dims in _ARRAY_TYPE.findall(match.group(1)))
    op_name = _OP_NAME.search(line)
    found.append(Collective(match.group(2), nbytes, op_name.group(1) if op_name else ""))
  return found


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes each kind of collective produces per device in one run of a compiled program's
  text: the sizes of their results, summed over their instructions as written
  (``collectives``)."""
  totals: dict[str, int] = collections.Counter()
  for c in collectives(hlo_text):
    totals[c.kind] += c.nbytes
  return dict(totals)
