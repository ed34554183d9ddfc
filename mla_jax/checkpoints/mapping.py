"""The one place where checkpoint tensors meet model parameters.

The model stacks layers of a scanned group and the routed experts on leading axes; the
checkpoint keeps one HF tensor per layer and expert. ``mla_jax.models.hf_layout`` describes
that mapping; these functions apply it for saving and loading.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax.models import hf_layout

Read = Callable[[str, tuple[slice, ...]], np.ndarray]


def model_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
  """Saving: HF tensor name -> host array, in the parameters' own dtypes, with the copies of
  the embedding and head that MTP layers store in HF checkpoints (``mtp_shared_copies``)."""
  tensors = hf_layout.hf_params(model)
  for copy, original in hf_layout.mtp_shared_copies(model.config).items():
    tensors[copy] = tensors[original]
  return tensors


def expected_tensors(params: nnx.State) -> dict[str, jax.ShapeDtypeStruct]:
  """Loading: every HF tensor the (abstract) parameters need, with its shape and dtype."""
  return {name: jax.ShapeDtypeStruct(shape, dtype)
          for name, (shape, dtype) in hf_layout.hf_shapes(params).items()}


def _from_callback(shape, dtype, sharding, piece: Callable) -> jax.Array:
  """``make_array_from_callback`` reading each distinct piece once (devices that hold the
  same piece, replicas over some mesh axis, share one read)."""
  pieces = {}

  def cached(index):
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in pieces:
      pieces[key] = piece(index)
    return pieces[key]

  return jax.make_array_from_callback(shape, sharding, cached, dtype=dtype)


def _without_leading_axis(sharding):
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
  return sharding


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked, layer, index):
  return jax.lax.dynamic_update_index_in_dim(stacked, layer, index, 0)


def _stream(layout: hf_layout.ParamLayout, shape, dtype, sharding, read: Read,
            placed: Callable[[], None]) -> jax.Array:
  """One parameter on its devices; a stacked layer axis is filled layer by layer, so the
  host holds one layer's pieces at a time (the layer axis is whole on every device)."""
  piece = lambda index: hf_layout.assemble(layout, shape, index, read)
  if not layout.leading or layout.leading[0] != hf_layout.LAYER or shape[0] == 1:
    array = _from_callback(shape, dtype, sharding, piece)
    placed()
    return array
  stacked = jax.jit(jnp.zeros, static_argnums=(0, 1), out_shardings=sharding)(shape, dtype)
  for r in range(shape[0]):
    layer = _from_callback(shape[1:], dtype, _without_leading_axis(sharding),
                           lambda index, r=r: piece((slice(r, r + 1), *index))[0])
    placed()
    stacked = _set_layer(stacked, layer, np.int32(r))
  return stacked


def fill_parameters(params: nnx.State, read: Read, shardings: dict,
                    placed: Callable[[], None] = lambda: None) -> nnx.State:
  """The parameters built from HF tensors on their devices (``shardings[path]``).

  ``read(name, tail)`` returns the ``tail`` slice of one HF tensor; only the slices the
  local devices hold are read, each cast to its parameter's dtype as it arrives. ``placed()``
  is called whenever a parameter (or one layer of a stacked one) is on its devices.
  """
  layouts = hf_layout.param_layouts(params)
  filled = []
  for path, var in params.flat_state():
    dtype = np.dtype(var.dtype)
    typed = lambda name, tail, dtype=dtype: read(name, tail).astype(dtype, copy=False)
    value = _stream(layouts[path], tuple(var.shape), dtype, shardings[path], typed, placed)
    filled.append((path, var.replace(value)))
  return nnx.State.from_flat_path(filled)
