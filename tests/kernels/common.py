"""The test base every op suite derives from, and the checks the suites share.

Each op (``sparse_mqa``, ``indexer_logits``, ``dense_mha``) has one suite, ``<op>_base.py``,
written against ``self.fn()``: a callable with the op's signature. Its ``test_<op>.py`` runs the
suite over every implementation, as tokamax's attention test base and jax's Pallas interpret
tests do:

- ``<Op>ReferenceTest``: the jnp reference (what the XLA backend runs);
- ``<Op>PallasTest``: the Pallas-Triton kernel on a CUDA GPU (skipped elsewhere, in ``setUp``);
- ``<Op>PallasInterpretTest``: the same class with ``INTERPRET = True``, so CPU runs every test.

Block configs are a kernel's tuning, not its meaning: the reference ignores them. What only a
kernel has (a config it can refuse) is tested in the Pallas classes.
"""

import functools
import re
from collections.abc import Callable
from typing import ClassVar

import chex
import jax
import numpy as np

from mla_jax.backends.pallas import PallasTritonBackend
from mla_jax.backends.xla import XlaBackend

REFERENCE, PALLAS_TRITON = "reference", "pallas_triton"

POISONS = {"nan": np.nan, "inf": np.inf}

_JITTED: dict = {}


def cuda_gpu_ready() -> bool:
  """A CUDA GPU of compute capability 8.0 or newer (the Triton kernels' floor)."""
  try:
    device = jax.devices("gpu")[0]
  except RuntimeError:
    return False
  return float(getattr(device, "compute_capability", 0)) >= 8.0


class KernelTestBase(chex.TestCase):
  """One implementation of one op: the op base sets ``KERNEL`` and ``REFERENCE``, the test
  classes ``IMPLEMENTATION`` (and ``INTERPRET`` for the kernel)."""

  KERNEL: ClassVar[Callable]  # staticmethod(the Pallas kernel)
  REFERENCE: ClassVar[Callable]  # staticmethod(its jnp reference, the same signature)
  STATIC_ARGNAMES: ClassVar[tuple[str, ...]] = ()  # the reference's static keyword arguments
  POSITIONAL: ClassVar[tuple[str, ...]]  # the names of the op's positional (array) arguments
  IMPLEMENTATION: ClassVar[str]
  INTERPRET: ClassVar[bool] = False

  def setUp(self):
    super().setUp()
    if self.IMPLEMENTATION == PALLAS_TRITON and not self.INTERPRET and not cuda_gpu_ready():
      self.skipTest("the Pallas-Triton kernel needs a CUDA GPU (sm80+); "
                    "its interpret-mode class runs everywhere")

  def fn(self, config=None, *, jit=True) -> Callable:
    """The implementation under test, with the reference's signature.

    The reference comes jitted unless ``jit=False`` (bad-input checks, where ``jax.jit``
    would refuse unhashable static arguments before the op's own checks): run eagerly, op by
    op, it compiles each primitive for each new shape, seconds a case on CPU.
    """
    if self.IMPLEMENTATION == REFERENCE:
      return self.reference() if jit else self.REFERENCE
    return functools.partial(self.KERNEL, config=config, interpret=self.INTERPRET)

  def reference(self) -> Callable:
    """The jitted reference, what the results are compared against."""
    key = (REFERENCE, self.REFERENCE)
    if key not in _JITTED:
      _JITTED[key] = jax.jit(self.REFERENCE, static_argnames=self.STATIC_ARGNAMES)
    return _JITTED[key]

  def jitted(self, config=None, **static) -> Callable:
    """``self.fn(config)`` with ``static`` bound, jitted once per implementation for all cases."""
    key = (self.IMPLEMENTATION, self.INTERPRET, self.KERNEL, config,
           tuple(sorted(static.items())))
    if key not in _JITTED:
      _JITTED[key] = jax.jit(functools.partial(self.fn(config), **static))
    return _JITTED[key]

  def _split(self, args):
    kwargs = dict(args)
    return [kwargs.pop(name) for name in self.POSITIONAL], kwargs

  def assert_refused_like_the_reference(self, args, error, argument):
    """The op refuses ``args`` with ``error`` naming ``argument``, in the reference's words."""
    arrays, kwargs = self._split(args)
    e = raised(self.fn(jit=False), arrays, kwargs)
    assert type(e) is error, f"expected {error.__name__}, got {e!r}"
    assert re.search(rf"\b{argument}\b", str(e)), f"message does not name {argument}: {e}"
    assert str(e) == str(raised(self.REFERENCE, arrays, kwargs))

  def assert_accepted(self, args):
    arrays, kwargs = self._split(args)
    self.assertIsNone(raised(self.fn(jit=False), arrays, kwargs))

  def assert_kernel_refuses_config(self, args, config):
    """A config of the wrong type is a TypeError naming ``config`` (the kernel only)."""
    arrays, kwargs = self._split(args)
    e = raised(self.KERNEL, arrays, {**kwargs, "config": config})
    assert isinstance(e, TypeError) and "config" in str(e)

  def backend(self):
    """The backend that runs this implementation (batched, vmapped over the leading axis)."""
    if self.IMPLEMENTATION == REFERENCE:
      return XlaBackend()
    return PallasTritonBackend(interpret=self.INTERPRET)


def named_product(**axes: dict) -> list[dict]:
  """``parameterized.named_parameters`` cases: every combination of the axes' named values."""
  cases = [dict(testcase_name="")]
  for axis, values in axes.items():
    cases = [{**c, axis: value, "testcase_name": f"{c['testcase_name']}_{name}".lstrip("_")}
             for c in cases for name, value in values.items()]
  return cases


def bad_input_cases(valid: dict, bad: list, prefix: str = "") -> list[dict]:
  """Named cases of ``(case, changed arguments, error, argument to name)`` applied to ``valid``."""
  return [dict(testcase_name=prefix + case, args={**valid, **change}, error=error,
               argument=argument) for case, change, error, argument in bad]


def raised(fn, arrays, kwargs):
  """The exception ``fn`` raises on these inputs (traced abstractly: nothing is computed).

  A non-array argument cannot be traced, so it is passed as it is.
  """
  try:
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(arrays)):
      jax.eval_shape(functools.partial(fn, **kwargs), *arrays)
    else:
      fn(*arrays, **kwargs)
  except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
    return e
  return None


def assert_only_affected_change(got, clean, affected):
  """``affected`` selects the leading-axis rows that see poison; the others are untouched."""
  for g, c in zip(got, clean):
    g, c = np.asarray(g, np.float64), np.asarray(c, np.float64)
    np.testing.assert_array_equal(g[~affected], c[~affected])
    for row in np.flatnonzero(affected):
      assert not np.isfinite(g[row]).all(), f"row {row} sees a poisoned row but is finite"


def assert_no_attention(result, shape):
  """Every row sees nothing: out 0 of ``shape`` and LSE +inf."""
  out, lse = result
  assert out.shape == shape and lse.shape == shape[:2]
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  assert np.isposinf(np.asarray(lse)).all()
