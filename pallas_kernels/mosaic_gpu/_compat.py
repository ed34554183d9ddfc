"""Every jax-version-dependent Mosaic GPU import, in one place.

Mosaic GPU kernels here need ``plgpu.kernel`` (``pl.pallas_call`` with Mosaic GPU params has no
CUDA lowering rule on jax 0.12) and the GPU interpreter ``plgpu.InterpretGPUParams`` (plain
``interpret=True`` has no discharge rule for the plgpu ops). Checked on jax 0.11.2 and 0.12.0.1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.indexer_logits_tiles import valid_rows

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
      return f"jax {jax.__version__}: plgpu.{name} is missing"
  return None


def swizzled(dtype):
  """The transforms of a 128-byte-swizzled SMEM tile (what wgmma reads): tiles of 8 rows of
  128 bytes."""
  cols = 128 // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128))


def gather_rows(sources, tiles, row_ids_smem, num_rows: int, barrier) -> None:
  """One TMA copy a row: row ``row_ids_smem[r]`` of each source (GMEM [num_rows, ...]) into row
  r of its tile (unswizzled SMEM), all on ``barrier`` (one arrival a copy). Hopper has no TMA
  gather. Ids outside ``[0, num_rows)`` read row 0, which the caller masks."""
  def fetch(r, carry):
    safe = valid_rows(row_ids_smem[r], num_rows)[1]
    for source, tile in zip(sources, tiles):
      plgpu.copy_gmem_to_smem(source.at[pl.ds(safe, 1)], tile.at[pl.ds(r, 1)], barrier)
    return carry
  lax.fori_loop(0, row_ids_smem.shape[0], fetch, None)


def interpret_params():
  """The GPU interpreter's params: runs a ``plgpu.kernel`` on the CPU."""
  return plgpu.InterpretGPUParams()
