"""Every jax-version-dependent Pallas import and call, in one place (docs/design.md §8).

Supported: jax 0.10.2 (Python 3.11) and jax 0.12.x (Python 3.12). The Pallas Triton backend is
deprecated from jax 0.11; when it moves or goes, only this file should change.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

with warnings.catch_warnings():
  # jax >= 0.11 warns that the Triton backend is deprecated; it still works through 0.12.
  # mla_jax.backends.gpu_support states the deprecation and the plan for its removal.
  warnings.simplefilter("ignore", DeprecationWarning)
  try:
    from jax.experimental.pallas import triton as pltriton
  except ImportError as e:  # a jax after its removal: the Triton kernels refuse to build
    pltriton, _NO_TRITON = None, str(e)
  else:
    _NO_TRITON = None


def _triton():
  if pltriton is None:
    raise NotImplementedError(f"the Pallas-Triton kernels need jax's Pallas Triton backend, "
                              f"which jax {jax.__version__} lacks ({_NO_TRITON})")
  return pltriton

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"

# Finite "minus infinity" for masked logits: a fully masked block must not produce NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def compiler_params(num_warps: int, num_stages: int):
  """Triton compiler params; their type is what selects the Triton backend (jax >= 0.9.1)."""
  return _triton().CompilerParams(num_warps=num_warps, num_stages=num_stages)


def load(ref, *, mask=None, other=None):
  """Masked load; ``other`` fills the masked-off lanes.

  ``other`` is cast to the ref's dtype first: Triton cannot cast an int splat to fp8.
  """
  if other is not None:
    other = jnp.asarray(other, ref.dtype)
  return _triton().load(ref, mask=mask, other=other)


def store(ref, val, *, mask=None):
  """Masked store; masked-off lanes of ``ref`` keep their previous contents."""
  _triton().store(ref, val, mask=mask)


def dot_precision(dtype):
  """fp32 inputs get IEEE fp32 dots (Triton would use TF32 otherwise); narrow types the default."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# Block dimension that is squeezed out of the kernel's ref.
SQUEEZED = pl.squeezed


def gpu_lowering_context():
  """Context in which ``.lower(lowering_platforms=("cuda",))`` works without a GPU.

  jax 0.10.2 silently assumes compute capability 9.0; jax >= 0.12 needs an abstract GPU device
  (docs/design.md §8).
  """
  abstract_device_cls = getattr(jax.sharding, "AbstractDevice", None)
  if abstract_device_cls is None or jax.devices()[0].platform == "gpu":
    return contextlib.nullcontext()
  from jax.sharding import AbstractMesh, AxisType

  device = abstract_device_cls(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def lower_for_cuda(fn, *args):
  """StableHLO text of ``jax.jit(fn)`` lowered for cuda, on any host."""
  with gpu_lowering_context():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@contextlib.contextmanager
def capture_ttir():
  """Collects ``(kernel_name, ttir_text)`` for every Triton module lowered inside the block.

  Private API: wraps ``lower_jaxpr_to_triton_module`` (jax's Triton lowering); pinned to the
  jax versions above.
  """
  from jax._src.pallas.triton import lowering as triton_lowering

  original = triton_lowering.lower_jaxpr_to_triton_module
  modules: list[tuple[str, str]] = []

  def hook(jaxpr, *args, **kwargs):
    result = original(jaxpr, *args, **kwargs)
    modules.append((jaxpr.debug_info.func_name, result.module.operation.get_asm()))
    return result

  triton_lowering.lower_jaxpr_to_triton_module = hook
  try:
    yield modules
  finally:
    triton_lowering.lower_jaxpr_to_triton_module = original
