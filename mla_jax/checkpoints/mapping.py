"""The one place where checkpoint tensors meet model parameters.

Today each parameter's dotted NNX path is its Hugging Face tensor name and its layout is the
tensor's ([out, in] linears), so both directions are lookups. A model layout that stacks
experts or layers changes these two functions and nothing else in the checkpoint code.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from mla_jax.params import dotted_name, flat_params


def model_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
  """Saving: HF tensor name -> host array, in the parameters' own dtypes."""
  return {name: np.asarray(value) for name, value in flat_params(model).items()}


def parameter_targets(params: nnx.State) -> dict[str, tuple[tuple, nnx.Variable]]:
  """Loading: HF tensor name -> (state path, abstract variable) of the parameter it fills."""
  return {dotted_name(path): (path, var) for path, var in params.flat_state()}
