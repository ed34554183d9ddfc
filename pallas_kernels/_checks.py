"""Argument checks shared by every kernel and its reference, so that both refuse the same inputs.

Each op module composes these into one ``validate_*`` function that both of its entry points
call first. Checks read only shapes, dtypes and Python scalars, so they also run on tracers and
``jax.ShapeDtypeStruct`` inputs and raise before anything is traced or allocated.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

_INT32 = np.iinfo(np.int32)


def array(op: str, name: str, x, axes: str):
  """``x`` is an array of rank ``len(axes)``; returns its shape. ``axes`` names each axis."""
  shape = getattr(x, "shape", None)
  if shape is None or getattr(x, "dtype", None) is None:
    raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
  if len(shape) != len(axes):
    raise ValueError(f"{op}: {name} must have rank {len(axes)} [{', '.join(axes)}], "
                     f"got shape {tuple(shape)}")
  return tuple(shape)


def float_dtype(op: str, name: str, x, allowed=None) -> None:
  if allowed is not None:
    if x.dtype not in allowed:
      names = ", ".join(jnp.dtype(d).name for d in allowed)
      raise TypeError(f"{op}: {name} dtype must be one of {names}, got {x.dtype}")
  elif not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must be a floating array, got {x.dtype}")


def same_dtype(op: str, **arrays) -> None:
  (first, a), *rest = arrays.items()
  for name, x in rest:
    if x.dtype != a.dtype:
      raise TypeError(f"{op}: {name} dtype {x.dtype} differs from {first} dtype {a.dtype}; "
                      "cast them to one dtype")


def int32_array(op: str, name: str, x) -> None:
  if x.dtype != jnp.int32:
    raise TypeError(f"{op}: {name} must be int32, got {x.dtype}")


def positive_float(op: str, name: str, x) -> float:
  """A finite positive real scalar, concrete (kernels bake it in as a constant)."""
  if isinstance(x, jax.core.Tracer):
    raise TypeError(f"{op}: {name} must be a concrete float, not a traced value")
  dtype = getattr(x, "dtype", None)
  is_real_array = (getattr(x, "shape", None) == () and dtype is not None
                   and jnp.issubdtype(dtype, jnp.floating))
  if isinstance(x, bool) or not (isinstance(x, numbers.Real) or is_real_array):
    raise TypeError(f"{op}: {name} must be a float, got {type(x).__name__}")
  value = float(x)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{op}: {name} must be finite and positive, got {value}")
  return value


def positive_int(op: str, name: str, x, *, at_most: int, bound_name: str) -> int:
  if isinstance(x, bool) or not isinstance(x, numbers.Integral):
    raise TypeError(f"{op}: {name} must be an int, got {type(x).__name__}")
  if not 0 < int(x) <= at_most:
    raise ValueError(f"{op}: {name} must lie in [1, {bound_name}={at_most}], got {int(x)}")
  return int(x)


def int32_scalar(op: str, name: str, x, *, minimum: int | None = None):
  """An integer scalar (Python, NumPy or a 0-d jax array, possibly traced) as an int32 array.

  ``minimum`` bounds a concrete value from below; a traced one is only known when it runs.
  """
  if isinstance(x, bool):
    raise TypeError(f"{op}: {name} must be an integer scalar, got bool")
  if not isinstance(x, numbers.Integral):
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
      what = f"{dtype}{list(shape)}" if dtype is not None else type(x).__name__
      raise TypeError(f"{op}: {name} must be an integer scalar, got {what}")
    if isinstance(x, jax.core.Tracer):
      return jnp.asarray(x, jnp.int32)
  if not _INT32.min <= int(x) <= _INT32.max:
    raise ValueError(f"{op}: {name}={int(x)} does not fit in int32")
  if minimum is not None and int(x) < minimum:
    raise ValueError(f"{op}: {name} must be >= {minimum}, got {int(x)}")
  return jnp.int32(int(x)) if isinstance(x, numbers.Integral) else jnp.asarray(x, jnp.int32)


def kernel_config(op: str, config, cls, name: str = "config") -> None:
  if config is not None and not isinstance(config, cls):
    raise TypeError(f"{op}: {name} must be a {cls.__name__} or None, got {type(config).__name__}")


def no_attention(num_tokens: int, num_heads: int, width: int, dtype):
  """What every query row gives when it sees no key: out 0 and natural-log LSE +inf."""
  return (jnp.zeros((num_tokens, num_heads, width), dtype),
          jnp.full((num_tokens, num_heads), jnp.inf, jnp.float32))

