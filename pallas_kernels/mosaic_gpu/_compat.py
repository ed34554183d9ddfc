"""Every jax-version-dependent Mosaic GPU import, in one place.

Mosaic GPU kernels here need ``plgpu.kernel`` (``pl.pallas_call`` with Mosaic GPU params has no
CUDA lowering rule on jax 0.12) and the GPU interpreter ``plgpu.InterpretGPUParams`` (plain
``interpret=True`` has no discharge rule for the plgpu ops). Checked on jax 0.11.2 and 0.12.0.1.
"""

from __future__ import annotations

import jax.numpy as jnp

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as e:  # pragma: no cover - depends on the installed jax
  plgpu = None
  _IMPORT_ERROR = f"jax.experimental.pallas.mosaic_gpu does not import: {e}"
else:
  _IMPORT_ERROR = None

MOSAIC_CUSTOM_CALLS = ("mosaic_gpu_v2", "mosaic_gpu")


def unsupported_reason() -> str | None:
  """Why this jax cannot build the Mosaic GPU kernels, or ``None`` when it can."""
  if _IMPORT_ERROR is not None:
    return _IMPORT_ERROR
  for name in ("kernel", "InterpretGPUParams", "wgmma", "copy_gmem_to_smem", "Layout"):
    if not hasattr(plgpu, name):
      return f"jax {__import__('jax').__version__}: plgpu.{name} is missing"
  return None


def swizzled(dtype):
  """The transforms of a 128-byte-swizzled SMEM tile (what wgmma reads): tiles of 8 rows of
  128 bytes."""
  cols = 128 // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128))


def interpret_params():
  """The GPU interpreter's params: runs a ``plgpu.kernel`` on the CPU."""
  return plgpu.InterpretGPUParams()
