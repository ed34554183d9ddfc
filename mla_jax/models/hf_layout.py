"""The model's parameter layout <-> Hugging Face tensor names.

Inside ``CausalLM`` the decoder layers of a group are stacked on a leading "layer" axis (one
``scan`` runs them) and the routed experts on a leading "expert" axis (one grouped matmul
runs them). Checkpoints keep HF's names, one tensor per layer and expert:

    model.groups.1.unit.layers.0.mlp.experts.gate_proj      [reps, E, F, D]
      element [r, e]  <->  model.layers.{first + r * unit_len}.mlp.experts.{e}.gate_proj.weight

Multi-token-prediction layers (``CausalLM.mtp``, not stacked) take the HF layer numbers
after the main layers, their decoder block's parameters without a prefix, as HF stores them:

    mtp.0.eh_proj.weight                         <->  model.layers.{N}.eh_proj.weight
    mtp.0.block.mlp.experts.down_proj [E, D, F]  <->  model.layers.{N}.mlp.experts.{e}.down_proj.weight

``param_layouts`` describes every parameter this way; loading, saving and the partition
rules all go through it, so the mapping exists once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator

import numpy as np
from flax import nnx

from mla_jax.models.config import LayerGroup
from mla_jax.quant import SCALE_INV, VALUES

LAYER, EXPERT = "layer", "expert"
MTP = "mtp"  # CausalLM's attribute holding the MTP layers
_QUANTIZED_SUFFIXES = {VALUES: "", SCALE_INV: "_scale_inv"}


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """One parameter: the HF tensors it stacks and along which leading axes.

  Attributes:
    path: the parameter's path in the model's state.
    template: the HF name, with ``{layer}`` / ``{expert}`` fields for stacked axes.
    leading: kinds of the stacked leading axes, outermost first (``"layer"``, ``"expert"``).
    group, position: for a stacked layer axis, the group and the position in its unit.
  """

  path: tuple
  template: str
  leading: tuple[str, ...] = ()
  group: LayerGroup | None = None
  position: int = 0

  def hf_name(self, index: tuple[int, ...] = ()) -> str:
    """The HF tensor at ``index`` of the leading axes."""
    fields = {}
    for kind, i in zip(self.leading, index):
      fields[kind] = self.group.layer(i, self.position) if kind == LAYER else i
    return self.template.format(**fields)

  @property
  def rule_name(self) -> str:
    """An HF name of this parameter, for the partition rules (any stacked index will do)."""
    return self.hf_name((0,) * len(self.leading))

  def indices(self, shape) -> Iterator[tuple[int, ...]]:
    """Every index of the leading axes of a parameter of ``shape``."""
    return itertools.product(*(range(n) for n in shape[:len(self.leading)]))


def _layer_params(rest: list[str], leading: tuple[str, ...]) -> tuple[list[str], tuple]:
  """A decoder layer's names below ``model.layers.{L}`` and the stacked axes they add."""
  if rest[:2] == ["mlp", "experts"]:  # stacked [E, ...]; HF: one ``.weight`` per expert
    return ["mlp", "experts", "{expert}", *rest[2:], "weight"], leading + (EXPERT,)
  return rest, leading


def _layout(path: tuple, groups: tuple[LayerGroup, ...]) -> ParamLayout:
  names = [str(p) for p in path]
  # A block-scaled fp8 weight holds two parameters: HF's ``X`` and ``X_scale_inv``.
  suffix = ""
  if names[-1] in _QUANTIZED_SUFFIXES:
    suffix = _QUANTIZED_SUFFIXES[names.pop()]
  if names[0] == MTP:
    layer, rest = groups[-1].end + int(names[1]), names[2:]  # after the main layers
    rest, leading = _layer_params(rest[1:] if rest[0] == "block" else rest, ())
    return ParamLayout(path, ".".join(["model", "layers", str(layer), *rest]) + suffix, leading)
  if names[:2] != ["model", "groups"]:
    return ParamLayout(path, ".".join(names) + suffix)
  group, position = groups[int(names[2])], int(names[5])
  rest, leading = _layer_params(names[6:], (LAYER,))
  template = ".".join(["model", "layers", "{layer}", *rest]) + suffix
  return ParamLayout(path, template, leading, group, position)


def mtp_shared_copies(config) -> dict[str, str]:
  """The copies of the embedding and the LM head that DeepSeek's and GLM's checkpoints store
  in every MTP layer -> the main model's tensor each duplicates (the model holds only that
  one: ``mla_jax.models.mtp``)."""
  copies = {}
  for layer in range(config.num_layers, config.num_layers + config.num_mtp_layers):
    copies[f"model.layers.{layer}.embed_tokens.weight"] = "model.embed_tokens.weight"
    copies[f"model.layers.{layer}.shared_head.head.weight"] = "lm_head.weight"
  return copies


def _groups(flat: dict) -> tuple[LayerGroup, ...]:
  """The layer groups, read off the state: unit positions per group and the stacked reps."""
  units: dict[int, tuple[int, int]] = {}
  for path, value in flat.items():
    if len(path) > 5 and path[:2] == ("model", "groups"):
      g, u = int(path[2]), int(path[5])
      unit_len, _ = units.get(g, (0, 0))
      units[g] = (max(unit_len, u + 1), value.shape[0])
  groups, first = [], 0
  for g in sorted(units):
    unit_len, reps = units[g]
    groups.append(LayerGroup(first, unit_len, reps))
    first += unit_len * reps
  return tuple(groups)


def param_layouts(state: nnx.State) -> dict[tuple, ParamLayout]:
  """The layout of every ``nnx.Param`` in ``state`` (a ``CausalLM``'s, possibly abstract)."""
  flat = dict(nnx.state(state, nnx.Param).flat_state())
  groups = _groups(flat)
  return {path: _layout(path, groups) for path in flat}


def hf_shapes(state: nnx.State) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{hf_name: (shape, dtype name)}`` of every HF tensor the parameters in ``state`` hold."""
  flat = dict(nnx.state(state, nnx.Param).flat_state())
  out = {}
  for path, layout in param_layouts(state).items():
    value = flat[path]
    shape = tuple(value.shape)
    for index in layout.indices(shape):
      out[layout.hf_name(index)] = (shape[len(layout.leading):], str(np.dtype(value.dtype)))
  return out


def to_hf(state: nnx.State, fetch: Callable = np.asarray) -> dict[str, np.ndarray]:
  """Every HF tensor of ``state`` as a host array (``fetch`` gathers one parameter)."""
  flat = dict(nnx.state(state, nnx.Param).flat_state())
  out = {}
  for path, layout in param_layouts(state).items():
    value = fetch(flat[path][...])
    for index in layout.indices(value.shape):
      out[layout.hf_name(index)] = np.ascontiguousarray(value[index])
  return out


def hf_params(model) -> dict[str, np.ndarray]:
  """A ``CausalLM``'s parameters as HF tensors on the host (what ``save_pretrained`` writes)."""
  from mla_jax.sharding import fetch

  return to_hf(nnx.state(model, nnx.Param), fetch)


def assemble(layout: ParamLayout, shape: tuple[int, ...], index: tuple[slice, ...],
             read: Callable[[str, tuple[slice, ...]], np.ndarray]) -> np.ndarray:
  """The ``index`` piece of a parameter of ``shape``, read HF tensor by HF tensor.

  ``read(hf_name, tail)`` returns the ``tail`` slice of one HF tensor, so a caller can read
  only what one device holds (``jax.make_array_from_callback`` passes such an ``index``).
  Each slice is copied into the piece as it arrives, so at most one slice sits beside it.
  """
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  num_leading = len(layout.leading)
  head, tail = index[:num_leading], index[num_leading:]
  ranges = [range(*s.indices(n)) for s, n in zip(head, shape[:num_leading])]
  piece = None
  for at, i in enumerate(itertools.product(*ranges)):
    value = read(layout.hf_name(i), tail)
    if piece is None:
      piece = np.empty((math.prod(map(len, ranges)), *value.shape), value.dtype)
    piece[at] = value
  return piece.reshape(*map(len, ranges), *piece.shape[1:])
