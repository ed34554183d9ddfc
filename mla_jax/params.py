"""Flat, dotted parameter names (``"q_a_proj.weight"``) over NNX modules.

The dotted names are the Hugging Face names below a module's prefix, which makes checkpoint
loading a rename and lets tests address parameters the way a state dict does.
"""

from __future__ import annotations

import jax
from flax import nnx


def dotted_name(path) -> str:
  """``("layers", 0, "q_a_proj", "weight")`` -> ``"layers.0.q_a_proj.weight"``."""
  return ".".join(str(part) for part in path)


def module_at(root: nnx.Module, path) -> nnx.Module:
  """The module (or parameter) at ``path`` below ``root``; int parts index ``nnx.List``s."""
  for key in path:
    root = root[key] if isinstance(key, int) else getattr(root, key)
  return root


def flat_params(module: nnx.Module) -> dict[str, jax.Array]:
  """``{"layers.0.self_attn.q_a_proj.weight": array}`` for every ``nnx.Param``."""
  return {dotted_name(path): variable[...]
          for path, variable in nnx.state(module, nnx.Param).flat_state()}


def set_flat_params(module: nnx.Module, values: dict[str, jax.Array]) -> None:
  """Replaces the named parameters in place; names and shapes must match exactly."""
  state = nnx.state(module, nnx.Param)
  current = {dotted_name(path): var for path, var in state.flat_state()}
  unknown = sorted(set(values) - set(current))
  if unknown:
    raise KeyError(f"unknown parameter names: {unknown[:10]}")
  for name, value in values.items():
    if tuple(value.shape) != tuple(current[name].shape):
      raise ValueError(f"parameter {name}: shape {tuple(value.shape)} does not match "
                       f"{tuple(current[name].shape)}")
    current[name][...] = value
