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
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, memref, nvvm
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
  for name in ("kernel", "InterpretGPUParams", "wgmma", "copy_gmem_to_smem", "Layout",
               "inline_mgpu", "set_max_registers"):
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


_CHUNK = 16      # bytes a cp.async copies
_SWIZZLE = 128   # bytes a swizzled tile row: 8 chunks, XORed with the row's index mod 8


def cp_async_rows(kv_ref, ids_ref, tile_ref) -> None:
  """The calling warpgroup gathers rows ``kv_ref[ids_ref[r]]`` (GMEM [S, L], 2-byte values)
  into row r of ``tile_ref`` (a 128-byte-swizzled SMEM tile [R, L], ``swizzled``) by 16-byte
  ``cp.async`` copies, one commit group. Ids outside ``[0, S)`` copy 0 bytes: their rows are
  zeros. Wait for the copies with :func:`cp_async_wait`.

  Pallas's ``copy_gmem_to_smem`` is a TMA on Hopper, and a swizzled TMA box is at most 128
  bytes wide, so a 1,152-byte row cannot land swizzled in one copy. Here 8 threads copy one
  128-byte column tile of a row, 16 rows at a time; the address of column chunk c of row r is
  that of ``TilingTransform((8, cols))`` then ``SwizzleTransform(128)``: tile (r // 8, c // 8)
  of 1 KiB, row r % 8 of it, chunk (c % 8) XOR (r % 8)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(),
                                plgpu.RefType(swizzled(tile_ref.dtype))))
  def issue(ctx, kv, ids, tile):
    del ctx
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    i8 = ir.IntegerType.get_signless(8)
    c32 = lambda v: mgpu_utils.c(v, i32)
    num_rows, width = ir.MemRefType(kv.type).shape
    rows = ir.MemRefType(ids.type).shape[0]
    row_bytes, col_tiles = width * 2, width * 2 // _SWIZZLE
    # The layouts the addresses below assume, checked where they are made: contiguous rows of
    # 2-byte values, and the tile as Mosaic lays out the transforms, 1 KiB tiles in row-major
    # order (so that, from a 1 KiB-aligned base, the swizzle is the hardware's 128-byte one).
    want = {"kv": ([num_rows, width], [width, 1]),
            "tile": ([rows // 8, col_tiles, 8, _SWIZZLE // 2], [col_tiles * 512, 512, 64, 1])}
    for name, ref in (("kv", kv), ("tile", tile)):
      ty = ir.MemRefType(ref.type)
      got = (list(ty.shape), list(ty.get_strides_and_offset()[0]))
      if got != want[name] or mgpu_utils.bitwidth(ty.element_type) != 16:
        raise NotImplementedError(f"cp_async_rows: {name} is {ty}, expected 2-byte values of "
                                  f"shape and strides {want[name]}")
    lanes = _SWIZZLE // _CHUNK                               # threads a column tile
    lane = arith.andi(mgpu_utils.thread_idx(), c32(127))
    row = arith.shrui(lane, c32(3))                          # 0 .. 15
    chunk = arith.andi(lane, c32(lanes - 1))
    row8 = arith.andi(row, c32(7))
    # Within a pass, r % 8 is this thread's row8: the swizzled offset is the same each pass.
    in_tile = arith.addi(arith.muli(row8, c32(_SWIZZLE)),
                         arith.muli(arith.xori(chunk, row8), c32(_CHUNK)))
    gmem = llvm.addrspacecast(llvm.PointerType.get(1), mgpu_utils.memref_ptr(kv))
    smem = mgpu_utils.memref_ptr(tile)
    for first in range(0, rows, 128 // lanes):
      r = arith.addi(row, c32(first))
      rid = memref.load(ids, [arith.index_cast(ir.IndexType.get(), r)])
      valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, rid, c32(0)),
                         arith.cmpi(arith.CmpIPredicate.slt, rid, c32(num_rows)))
      size = arith.select(valid, c32(_CHUNK), c32(0))        # 0: zero-fill, nothing read
      src = arith.addi(arith.muli(arith.extui(i64, arith.select(valid, rid, c32(0))),
                                  mgpu_utils.c(row_bytes, i64)),
                       arith.extui(i64, arith.muli(chunk, c32(_CHUNK))))
      dst = arith.addi(arith.muli(arith.shrui(r, c32(3)), c32(col_tiles * 8 * _SWIZZLE)),
                       in_tile)
      for k in range(col_tiles):
        nvvm.cp_async_shared_global(
            mgpu_utils.getelementptr(smem, [arith.addi(dst, c32(k * 8 * _SWIZZLE))], i8),
            mgpu_utils.getelementptr(gmem, [arith.addi(src, mgpu_utils.c(k * _SWIZZLE, i64))],
                                     i8),
            _CHUNK, nvvm.LoadCacheModifierKind.CG, cp_size=size)
    nvvm.cp_async_commit_group()
  issue(kv_ref, ids_ref, tile_ref)


def cp_async_wait(pending: int) -> None:
  """Waits until at most ``pending`` of this thread's ``cp.async`` groups are in flight."""
  @plgpu.inline_mgpu()
  def wait(ctx):
    del ctx
    nvvm.cp_async_wait_group(pending)
  wait()


def interpret_params():
  """The GPU interpreter's params: runs a ``plgpu.kernel`` on the CPU."""
  return plgpu.InterpretGPUParams()
