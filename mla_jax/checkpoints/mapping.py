"""The one place where checkpoint tensors meet model parameters.

The model stacks layers of a scanned group and the routed experts on leading axes; the
checkpoint keeps one HF tensor per layer and expert. ``mla_jax.models.hf_layout`` describes
that mapping; these functions apply it for saving and loading.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from mla_jax.models import hf_layout


def model_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
  """Saving: HF tensor name -> host array, in the parameters' own dtypes."""
  return hf_layout.hf_params(model)


def expected_tensors(params: nnx.State) -> dict[str, jax.ShapeDtypeStruct]:
  """Loading: every HF tensor the (abstract) parameters need, with its shape and dtype."""
  return {name: jax.ShapeDtypeStruct(shape, dtype)
          for name, (shape, dtype) in hf_layout.hf_shapes(params).items()}


def fill_parameters(params: nnx.State,
                    read: Callable[[str, tuple[slice, ...]], np.ndarray]) -> nnx.State:
  """The parameters built from HF tensors; ``read(name, index)`` returns a tensor's slice."""
  layouts = hf_layout.param_layouts(params)
  filled = []
  for path, var in params.flat_state():
    value = hf_layout.assemble(layouts[path], var.shape, (), read)
    filled.append((path, var.replace(jax.numpy.asarray(value.astype(var.dtype)))))
  return nnx.State.from_flat_path(filled)
