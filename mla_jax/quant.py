"""Block-scaled weights (fp8, and MXFP4's fp4), kept as released and dequantized where used.

DeepSeek's fp8 releases store a projection as float8_e4m3fn values plus one float32
``weight_scale_inv`` per 128 x 128 block (edge blocks are ragged when a dimension is not a
multiple of 128): the real weight is ``values * scale_inv`` of the block. ``BlockScaledWeight``
holds both as parameters and reads like one: ``w[...]`` is the float32 weight, computed inside
the caller's jitted program right before its matmul (a temporary of that program, which XLA
may fuse into the matmul's operand; never a stored parameter), so code that reads a weight
directly (the absorbed MLA path splits ``kv_b_proj`` per head) works unchanged.

MXFP4 (DeepSeek-V4's routed experts) is the same with 1 x 32 blocks: e2m1 values, two a byte
(``packed``: the low nibble is the even column, as the release stores them, so an fp4 weight
takes half a byte a value on every backend), and one e8m0 scale (a power of two) per 32
values of a row. ``jnp.float4_e2m1fn`` unpacks them inside the program (a bitcast).

Under a mesh a split dimension must fall on block boundaries, so that each device holds the
scales of exactly the blocks it holds (``check_block_split``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.params import module_at

# Names of the two parameters inside a BlockScaledWeight (mla_jax.models.hf_layout maps them
# to HF's ``<name>`` and ``<name>_scale_inv``).
VALUES, SCALE_INV = "quantized", "scale_inv"
MXFP4_BLOCK = (1, 32)  # one e8m0 scale per 32 values of a row


def scale_shape(shape, block: tuple[int, int]) -> tuple[int, ...]:
  """Shape of the scales of a weight of ``shape`` (blocks over the last two axes)."""
  *lead, rows, cols = shape
  return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def unpack_fp4(packed):
  """uint8 [..., K / 2], two e2m1 values a byte (low nibble first) -> float4_e2m1fn [..., K]."""
  values = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
  return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def logical_shape(values_shape, packed: bool) -> tuple[int, ...]:
  """The weight's shape from its stored values' (packed fp4: two values a byte)."""
  *lead, cols = values_shape
  return (*lead, 2 * cols if packed else cols)


def dequantize(values, scale_inv, block: tuple[int, int]):
  """float32 ``values * scale_inv`` of each [block] tile of the last two axes."""
  rows, cols = values.shape[-2:]
  scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block[0], axis=-2), block[1],
                     axis=-1)
  return values.astype(jnp.float32) * scale[..., :rows, :cols]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaledArray:
  """The values of a ``BlockScaledWeight`` (a pytree, so it can enter ``shard_map``)."""

  values: jax.Array
  scale_inv: jax.Array
  block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
  packed: bool = dataclasses.field(default=False, metadata=dict(static=True))  # fp4 in uint8

  @property
  def shape(self) -> tuple[int, ...]:
    return logical_shape(self.values.shape, self.packed)

  def take(self, index) -> BlockScaledArray:
    """Entries ``index`` of the leading (e.g. expert) axis, values and scales alike."""
    return BlockScaledArray(self.values[index], self.scale_inv[index], self.block, self.packed)

  def dequantize(self):
    values = unpack_fp4(self.values) if self.packed else self.values
    return dequantize(values, self.scale_inv, self.block)


def as_operand(weight, dtype):
  """A matmul operand in ``dtype``: a plain array cast, a ``BlockScaledArray`` dequantized."""
  if isinstance(weight, BlockScaledArray):
    return weight.dequantize().astype(dtype)
  return weight.astype(dtype)


def take(weight, index):
  """``weight[index]`` on the leading axis, for plain and block-scaled weights."""
  return weight.take(index) if isinstance(weight, BlockScaledArray) else weight[index]


class BlockScaledWeight(nnx.Module):
  """An fp8 (or ``packed`` MXFP4) weight [..., out, in] and its block scales, read like a
  parameter.

  ``w[...]`` is the dequantized float32 weight (computed where it is used, never stored);
  ``w.array()`` is the pair, for code that gathers before dequantizing (the grouped expert
  matmul dequantizes only the experts each row tile uses). ``packed``: the values are uint8
  [..., out, in / 2], two e2m1 values a byte (``unpack_fp4``).
  """

  def __init__(self, values, scale_inv, block: tuple[int, int], packed: bool = False):
    if packed and values.dtype != jnp.uint8:
      raise ValueError(f"packed fp4 values must be uint8 (two e2m1 values a byte), got "
                       f"{values.dtype}")
    shape = logical_shape(values.shape, packed)
    want = scale_shape(shape, block)
    if tuple(scale_inv.shape) != want:
      raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} != {want} for {block} "
                       f"blocks of a weight of shape {shape}")
    setattr(self, VALUES, nnx.Param(values))
    setattr(self, SCALE_INV, nnx.Param(scale_inv))
    self.block, self.packed = tuple(block), packed

  @property
  def shape(self) -> tuple[int, ...]:
    return logical_shape(getattr(self, VALUES).shape, self.packed)

  def array(self) -> BlockScaledArray:
    return BlockScaledArray(getattr(self, VALUES)[...], getattr(self, SCALE_INV)[...],
                            self.block, self.packed)

  def __getitem__(self, index):
    return self.array().dequantize()[index]


def weight_operand(weight):
  """What a parameter slot holds: a ``BlockScaledArray`` or the plain parameter's array."""
  return weight.array() if isinstance(weight, BlockScaledWeight) else weight[...]


def check_block_split(name: str, shape, spec, mesh, block: tuple[int, int]) -> None:
  """A split of the last two axes must give shards of whole blocks (no block cut in two)."""
  spec = (*spec, *(None,) * (len(shape) - len(spec)))
  for dim, axes, size in zip(shape[-2:], spec[-2:], block):
    if axes is None:
      continue
    ways = math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
    if ways > 1 and (dim % ways or (dim // ways) % size):
      raise ValueError(f"{name}: splitting dimension {dim} of block-scaled weight "
                       f"{tuple(shape)} {ways} ways over mesh axis {axes!r} gives shards of "
                       f"{dim / ways:g}, "
                       f"which cut its {size}-wide scale blocks; use a mesh whose split "
                       f"gives multiples of {size}")


def is_block_scalable(model: nnx.Module, path: tuple) -> bool:
  """Whether the parameter at ``path`` may hold a ``BlockScaledWeight``: its module lists the
  attribute in ``block_scalable`` (a Linear's weight, the stacked expert matrices; not an
  embedding, whose rows are gathered)."""
  *parent_path, attr = path
  return attr in getattr(type(module_at(model, parent_path)), "block_scalable", ())


def block_scale_abstract(model: nnx.Module, path: tuple, values_dtype, block: tuple[int, int],
                         scale_dtype=jnp.float32, packed: bool = False) -> None:
  """Turns the parameter at ``path`` of an abstract model (``nnx.eval_shape``) into an
  abstract ``BlockScaledWeight`` of the same shape, in place (``packed``: MXFP4, uint8 values
  two a byte)."""
  if not is_block_scalable(model, path):
    raise ValueError(f"parameter {'.'.join(map(str, path))} cannot hold block-scaled values")
  *parent_path, attr = path
  parent = module_at(model, parent_path)
  shape = tuple(getattr(parent, attr).shape)
  if packed and shape[-1] % 2:
    raise ValueError(f"parameter {'.'.join(map(str, path))}: {shape[-1]} columns cannot be "
                     "packed two fp4 values a byte")
  stored = (*shape[:-1], shape[-1] // 2) if packed else shape
  setattr(parent, attr, BlockScaledWeight(
      jax.ShapeDtypeStruct(stored, jnp.uint8 if packed else values_dtype),
      jax.ShapeDtypeStruct(scale_shape(shape, block), scale_dtype), block, packed))
