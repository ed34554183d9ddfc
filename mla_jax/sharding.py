"""Device meshes and partition rules: where each parameter, cache and activation lives.

A mesh has four named axes: ``data`` (the batch of sequences), ``tensor`` (attention heads,
MLP intermediate width, vocabulary), ``expert`` (routed experts) and ``context`` (an engine's
page pools: each rank holds 1/context of every pool's rows, ``mla_jax.context_parallel``).
The context ranks are tensor ranks too: what a rule splits over ``tensor`` it splits over
``tensor`` x ``context`` (``TENSOR_RANKS``), as vLLM's decode context parallelism reuses the
tensor-parallel group, so a context axis splits the weights as well as the pools. One table,
``PARTITION_RULES``, maps Hugging Face parameter names to how each tensor is split; stacked
axes that the model adds in front of an HF tensor (scanned layers, stacked experts) are
split as ``LEADING_AXIS_SPECS`` says. Nothing else in the package knows the axis names'
meaning: modules ask this module for specs, and routing never depends on the mesh.

Choices that every shard must agree on:

* The latent cache row [c_kv | k_pe] is one "head" shared by all query heads, so the latent
  and indexer-key caches are split over ``data`` (batch) and replicated over ``tensor``; an
  engine's pools split their rows over ``context``, and attention all-gathers a tensor
  group's query heads over it (``mla_jax.context_parallel``).
* The indexer is replicated: every tensor/expert shard scores the same keys with the same
  weights, so every shard selects the same top-k (no cross-shard reduction before top_k).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, TENSOR, EXPERT, CONTEXT = "data", "tensor", "expert", "context"
AXES = (DATA, TENSOR, EXPERT, CONTEXT)
# What V3.2's rules split heads, MLP widths and the vocabulary over: tensor-major, so the
# context ranks of one tensor group hold consecutive blocks of its heads (an all-gather over
# ``context`` gives the group's heads in order).
TENSOR_RANKS = (TENSOR, CONTEXT)


def vocab_and_mlp_rules(ranks) -> tuple[tuple[str, P], ...]:
  """The rules every family shares: the vocabulary's rows and the MLP width (dense, shared
  and routed experts) split over ``ranks``."""
  return (
      (r"embed_tokens\.weight$", P(ranks, None)),  # vocab rows
      (r"lm_head\.weight$", P(ranks, None)),  # vocab rows
      (r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up)_proj\.weight(_scale_inv)?$",
       P(ranks, None)),
      (r"mlp\.(shared_experts\.|experts\.\d+\.)?down_proj\.weight(_scale_inv)?$",
       P(None, ranks)),
  )


# HF parameter name (regex, searched) -> PartitionSpec of that HF tensor. First match wins.
# An fp8 weight's ``weight_scale_inv`` [rows / 128, cols / 128] is split like the weight, so
# a device holds the scales of the blocks it holds (quant.check_block_split refuses a split
# that would cut a block).
PARTITION_RULES: tuple[tuple[str, P], ...] = (
    *vocab_and_mlp_rules(TENSOR_RANKS),
    (r"self_attn\.q_b_proj\.weight(_scale_inv)?$", P(TENSOR_RANKS, None)),  # heads x (N + R)
    (r"self_attn\.kv_b_proj\.weight(_scale_inv)?$", P(TENSOR_RANKS, None)),  # heads x (N + V)
    (r"self_attn\.o_proj\.weight(_scale_inv)?$", P(None, TENSOR_RANKS)),  # columns: heads x V
    # Everything else is replicated: norms, q_a / kv_a projections, the indexer, the router.
    (r".", P()),
)
# Axes the model stacks in front of HF tensors: scanned layers stay whole on every device,
# stacked routed experts are split over ``expert``.
LEADING_AXIS_SPECS = {"layer": None, "expert": EXPERT}

# Caches and activations (leading stacked-layer axes get None in front).
TOKENS_SPEC = P(DATA)  # [B, T, ...] activations: batch over data, replicated otherwise
REPLICATED = P()       # scalars (seeds, step counters) and anything every device holds whole
# An engine's page pools (latent rows, indexer keys): rows over ``context``, each rank a block
# (``PagedLayerCache``'s layout puts page p in block p % context); whole on every other axis.
POOL_SPEC = P(CONTEXT)

# The attention ops under ``shard_map`` (``mla_jax.backends.on_mesh``): per-sequence values
# split over ``data``; queries and outputs [B, T, H, ...] also split their heads over
# ``tensor`` x ``context``, as the projections' rules hold them. The latent rows, the indexer
# keys and the indexer are whole on every tensor shard, so every shard scores the same keys
# and selects the same top-k.
BATCH_SPEC = P(DATA)
HEADS_SPEC = P(DATA, None, TENSOR_RANKS)
# A flat step's segmented dense MHA is one sequence of all the step's rows ([1, T, ...]): its
# batch cannot split over ``data``, so every data shard attends the whole step (heads still
# split over ``tensor`` x ``context``).
FLAT_HEADS_SPEC = P(None, None, TENSOR_RANKS)
OP_SPECS = {  # op -> (in_specs, out_specs)
    "sparse_mqa": ((HEADS_SPEC, BATCH_SPEC, BATCH_SPEC), (HEADS_SPEC, HEADS_SPEC)),
    "sparse_mqa_pool": ((HEADS_SPEC, REPLICATED, BATCH_SPEC), (HEADS_SPEC, HEADS_SPEC)),
    # q, k, w, starts, ends, k scales (or None), key rows (None unless k is a pool)
    "indexer_logits": ((BATCH_SPEC,) * 7, BATCH_SPEC),
    "indexer_logits_pool": ((BATCH_SPEC, REPLICATED, *(BATCH_SPEC,) * 3, REPLICATED, BATCH_SPEC),
                            BATCH_SPEC),
    "dense_mha": ((HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, BATCH_SPEC, BATCH_SPEC),
                  (HEADS_SPEC, HEADS_SPEC)),
    "masked_mha": ((HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, BATCH_SPEC, BATCH_SPEC, BATCH_SPEC),
                   (HEADS_SPEC, HEADS_SPEC)),
    "segmented_mha": ((FLAT_HEADS_SPEC,) * 3 + (REPLICATED,) * 3,
                      (FLAT_HEADS_SPEC, FLAT_HEADS_SPEC)),
}
# The routed experts under ``shard_map`` (``mla_jax.models.moe``): tokens [T, D] over
# ``data``; stacked expert weights [E, F, D] / [E, D, F] over ``expert`` and their
# intermediate width F over ``tensor`` x ``context``, as the partition rules hold them
# (DeepSeek-V4's rules split F over ``tensor`` alone and refuse a context axis: the same).
MOE_TOKENS_SPEC = P(DATA, None)
MOE_IN_PROJ_SPEC = P(EXPERT, TENSOR_RANKS, None)    # gate_proj, up_proj [E, F, D]
MOE_OUT_PROJ_SPEC = P(EXPERT, None, TENSOR_RANKS)   # down_proj [E, D, F]
MOE_SUM_AXES = (EXPERT, *TENSOR_RANKS)  # the shards whose outputs a token's sum adds


def parse_mesh_spec(spec: str) -> dict[str, int]:
  """``"data=1,tensor=2,expert=4"`` -> ``{"data": 1, "tensor": 2, "expert": 4, "context": 1}``.

  Axes left out have size 1. Unknown or repeated axis names and sizes that are not positive
  ints are ``ValueError``s naming the offending part.
  """
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"mesh spec must be a string like 'data=1,tensor=2,expert=4', got {spec!r}")
  sizes = dict.fromkeys(AXES, 1)
  seen = set()
  for part in spec.split(","):
    name, sep, value = part.strip().partition("=")
    name = name.strip()
    if not sep:
      raise ValueError(f"mesh spec part {part.strip()!r} is not of the form axis=size")
    if name not in AXES:
      raise ValueError(f"unknown mesh axis {name!r} in {spec!r}; axes are {', '.join(AXES)}")
    if name in seen:
      raise ValueError(f"mesh axis {name!r} is given twice in {spec!r}")
    seen.add(name)
    if not re.fullmatch(r"\s*\d+\s*", value) or int(value) < 1:
      raise ValueError(f"mesh axis {name!r} needs a positive int size, got {value.strip()!r}")
    sizes[name] = int(value)
  return sizes


def make_mesh(spec: str | dict[str, int], devices=None) -> Mesh:
  """A ``Mesh`` with axes (data, tensor, expert, context) over ``devices`` (default: all
  devices).

  The product of the sizes must equal the number of devices (all processes' devices in a
  multi-process run). Axes are ``Auto``: XLA propagates shardings between the annotated
  parameters, caches and layer boundaries.
  """
  sizes = parse_mesh_spec(spec) if isinstance(spec, str) else {**dict.fromkeys(AXES, 1), **spec}
  if set(sizes) != set(AXES):
    raise ValueError(f"mesh axes must be {AXES}, got {tuple(sizes)}")
  devices = jax.devices() if devices is None else list(devices)
  shape = tuple(sizes[a] for a in AXES)
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh {_describe(sizes)} needs {math.prod(shape)} devices but "
                     f"{len(devices)} are available")
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def abstract_mesh(spec: str | dict[str, int]) -> AbstractMesh:
  """A device-less mesh of any size, for plans and lowering without the hardware."""
  sizes = parse_mesh_spec(spec) if isinstance(spec, str) else spec
  return AbstractMesh(tuple(sizes[a] for a in AXES), AXES,
                      axis_types=(AxisType.Auto,) * len(AXES))


def _describe(sizes) -> str:
  return ",".join(f"{a}={sizes[a]}" for a in AXES)


def axis_size(mesh, axis: str) -> int:
  """The size of ``axis`` on ``mesh`` (1 without a mesh, or on a mesh without that axis)."""
  return mesh.shape.get(axis, 1) if mesh is not None else 1


def hf_rule(hf_name: str, rules=PARTITION_RULES) -> P:
  """The PartitionSpec of the HF tensor ``hf_name`` (first matching rule of ``rules``: V3.2's,
  or another model's table in the same vocabulary, e.g. ``mla_jax.v4.sharding``'s)."""
  for pattern, spec in rules:
    if re.search(pattern, hf_name):
      return spec
  raise AssertionError("the catch-all rule matches every name")


def param_spec(hf_name: str, leading_axes: tuple[str, ...], ndim: int,
               rules=PARTITION_RULES) -> P:
  """Spec of a parameter that stacks ``leading_axes`` in front of the HF tensor ``hf_name``."""
  rule = tuple(hf_rule(hf_name, rules))
  rule += (None,) * (ndim - len(leading_axes) - len(rule))
  return P(*(LEADING_AXIS_SPECS[a] for a in leading_axes), *rule)


def check_divisible(name: str, shape, spec: P, mesh) -> None:
  """Every split dimension must divide evenly over its mesh axes (no padded shards)."""
  for dim, axes in zip(shape, spec):
    if axes is None:
      continue
    ways = math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
    if dim % ways:
      raise ValueError(f"{name}: dimension {dim} of shape {tuple(shape)} cannot be split "
                       f"{ways} ways over mesh axis {axes!r}")


def cache_spec(batch_axis: int, ndim: int) -> P:
  """Spec of a cache array: its batch axis over ``data`` (after any stacked-layer axes),
  every other axis replicated."""
  return P(*(None,) * batch_axis, DATA, *(None,) * (ndim - batch_axis - 1))


def shard_map(fn, mesh, in_specs, out_specs):
  """``fn`` under ``jax.shard_map`` over ``mesh``; ``fn`` itself without a mesh."""
  if mesh is None:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def constrain(x, mesh, spec: P = TOKENS_SPEC):
  """``with_sharding_constraint`` on a mesh; the identity without one."""
  if mesh is None:
    return x
  spec = P(*spec, *(None,) * (x.ndim - len(spec)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def put(array, mesh, spec: P = P()):
  """A host array placed on ``mesh`` with ``spec``; each process supplies only its own shards.

  Works with several processes as long as every process holds the same host array.
  """
  array = np.asarray(array)
  spec = P(*spec, *(None,) * (array.ndim - len(spec)))
  return jax.make_array_from_callback(array.shape, NamedSharding(mesh, spec),
                                      lambda index: array[index])


def tree_bytes(tree) -> int:
  """Bytes of a pytree's arrays (or ``jax.ShapeDtypeStruct``s), whole: unsharded."""
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def fetch(array) -> np.ndarray:
  """The whole value of a (possibly multi-process) array on the host."""
  if getattr(array, "is_fully_addressable", True):
    return np.asarray(array)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(array, tiled=True))
