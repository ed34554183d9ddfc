"""DeepSeek-V4's partition rules, in ``mla_jax.sharding``'s vocabulary (docs/models.md, Meshes).

A V4 parameter's name is its path in ``V4CausalLM`` (Hugging Face's module names); a routed
experts' matrix stacks one tensor per expert on a leading ``expert`` axis, and a quantized
weight (``quant.BlockScaledWeight``) holds ``<name>`` and ``<name>_scale_inv``, split alike.
Over ``tensor``: the query heads (``q_b_proj`` rows, the sinks), the grouped output projection
(``o_a_proj`` rows, whole groups of heads; ``o_b_proj`` columns, reduced after), the MLP width
and the vocabulary. Over ``expert``: the routed experts.

Replicated, as V3.2's latent and indexer are, so that no shard waits on another before its
selection: the one K=V projection shared by every head (``kv_proj``) and the compressors that
pool it, the indexer (every shard scores the same keys and selects the same top-k), the
routers and hash MoE's ``tid2eid`` table (every shard routes the same tokens), and the mHC
weights (each token's ``pre`` / ``post`` / ``comb`` mix all its streams). The caches (window
ring, compressed entries, compressor state, indexer keys) split their batch over ``data``,
whole on every other axis: they are shared by all the heads of their sequence.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax import quant, sharding
from mla_jax.sharding import CONTEXT, DATA, EXPERT, TENSOR

V4_PARTITION_RULES: tuple[tuple[str, P], ...] = (
    *sharding.vocab_and_mlp_rules(TENSOR),
    (r"self_attn\.q_b_proj\.weight(_scale_inv)?$", P(TENSOR, None)),  # rows: heads x head_dim
    (r"self_attn\.sinks$", P(TENSOR)),  # one per head
    (r"self_attn\.o_a_proj\.weight(_scale_inv)?$", P(TENSOR, None)),  # rows: groups x o_lora
    (r"self_attn\.o_b_proj\.weight(_scale_inv)?$", P(None, TENSOR)),  # columns: groups x o_lora
    # Everything else is replicated: kv_proj and the compressors, the indexer, q_a_proj, the
    # routers and tid2eid, the mHC weights, the MTP layers' e_proj / h_proj, norms.
    (r".", P()),
)
_SUFFIXES = {quant.VALUES: "", quant.SCALE_INV: "_scale_inv"}


def rule_name(path: tuple) -> tuple[str, tuple[str, ...]]:
  """``(name, leading axes)`` of a V4 state leaf: its dotted path, ``.weight`` and the expert
  index spelled out for stacked experts, ``_scale_inv`` for a quantized weight's scales."""
  names = [str(p) for p in path]
  suffix = _SUFFIXES[names.pop()] if names[-1] in _SUFFIXES else ""
  if "experts" not in names:
    return ".".join(names) + suffix, ()
  at = names.index("experts") + 1
  return ".".join([*names[:at], "0", *names[at:], "weight"]) + suffix, (sharding.EXPERT,)


def leaf_spec(path: tuple, ndim: int) -> P:
  name, leading = rule_name(path)
  return sharding.param_spec(name, leading, ndim, V4_PARTITION_RULES)


def check_mesh(config, mesh) -> None:
  """Refuses, before anything is allocated, a mesh V4 cannot be split over (each problem by
  name); dimensions a rule splits are checked again, each, by ``state_shardings``."""
  size = lambda axis: sharding.axis_size(mesh, axis)
  tensor, expert = size(TENSOR), size(EXPERT)
  problems = []
  if size(CONTEXT) > 1:
    problems.append(f"a 'context' axis (size {size(CONTEXT)}): V4 has no context parallelism")
  if config.num_attention_heads % tensor:
    problems.append(f"{config.num_attention_heads} attention heads cannot be split over mesh "
                    f"axis 'tensor' of size {tensor}")
  if config.o_groups % tensor:
    problems.append(f"{config.o_groups} output groups (o_groups) cannot be split over mesh "
                    f"axis 'tensor' of size {tensor}: a shard must hold whole groups of heads")
  if config.n_routed_experts % expert:
    problems.append(f"{config.n_routed_experts} routed experts cannot be split over mesh axis "
                    f"'expert' of size {expert}")
  if problems:
    raise ValueError("; ".join(problems))


def leaf_rules(model: nnx.Module) -> list[tuple]:
  """``(path, leaf, spec, quantized weight or None)`` of every leaf of a (possibly abstract)
  V4 model's state (``tid2eid`` included): what ``shardings`` places on a mesh."""
  quantized = {tuple(path): m for path, m in nnx.iter_modules(model)
               if isinstance(m, quant.BlockScaledWeight)}
  return [(path, leaf, leaf_spec(path, len(leaf.shape)),
           quantized.get(path[:-1]) if path[-1] == quant.VALUES else None)
          for path, leaf in nnx.state(model).flat_state()]


def shardings(rules: list[tuple], mesh) -> dict[tuple, NamedSharding]:
  """Each leaf's ``NamedSharding`` on ``mesh`` (``leaf_rules``). A split dimension must
  divide evenly, and a quantized weight's split must not cut a scale block (128 x 128 fp8,
  1 x 32 MXFP4): each device then holds the scales of its blocks."""
  out = {}
  for path, leaf, spec, weight in rules:
    name = rule_name(path)[0]
    sharding.check_divisible(name, leaf.shape, spec, mesh)
    if weight is not None:
      quant.check_block_split(name, weight.shape, spec, mesh, weight.block)
    out[path] = NamedSharding(mesh, spec)
  return out


def state_shardings(model: nnx.Module, mesh) -> nnx.State:
  """A ``NamedSharding`` for every leaf of a (possibly abstract) V4 model's state, by the
  rules (``shardings``)."""
  return nnx.State.from_flat_path(list(shardings(leaf_rules(model), mesh).items()))


def cache_shardings(caches, mesh):
  """Every cache array's batch axis (its first) over ``data``, whole on the other axes."""
  return jax.tree.map(lambda a: NamedSharding(mesh, sharding.cache_spec(0, a.ndim)), caches)


def constrain_streams(streams_BTND, mesh):
  """The residual streams (and any [B, ...] activation): batch over ``data``."""
  return sharding.constrain(streams_BTND, mesh, P(DATA))
