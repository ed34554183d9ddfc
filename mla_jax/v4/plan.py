"""Full-size DeepSeek-V4 plans: parameter bytes per device on a mesh and what the caches take.

Everything is shapes: ``nnx.eval_shape`` gives the parameters, in bf16 or as released
(``"fp8"``: the fp8 projections as e4m3 with 128 x 128 e8m0 block scales, the routed experts
as packed MXFP4 with one e8m0 scale per 32 values), and ``mla_jax.v4.sharding``'s rules on an
``AbstractMesh`` give each device's shards. The caches are split over ``data`` only (every
device of a data shard holds its sequences' caches whole), so a mesh holds ``data`` times the
sequences that fit beside one device's parameters.

A V4 layer caches per token only its compressed entries: ``head_dim / m`` values (CSA: also
the indexer's ``index_head_dim / m``), in bf16 or fp8 (``--cache-dtype``: V3.2's fp8 layouts);
the window is a ring of ``sliding_window`` rows and each compressor keeps the last ``m`` or
``2m`` tokens' projections, fixed per sequence, in bf16.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import plan, quant, sharding
from mla_jax.backends import XlaBackend
from mla_jax.plan import FIT_FRACTION, GPUS
from mla_jax.v4.attention import empty_entries, empty_index_keys
from mla_jax.v4.config import CSA, HCA, MOE, HASH_MOE, SLIDING, V4Config
from mla_jax.v4.model import V4CausalLM
from mla_jax.v4.sharding import (V4_PARTITION_RULES, check_mesh, leaf_rules, rule_name,
                                 shardings)


def _alternating(first: str, second: str, n: int) -> tuple[str, ...]:
  return tuple(first if i % 2 == 0 else second for i in range(n))


# The published sizes. V4-Flash is HF's DeepseekV4Config defaults (its docstring names
# deepseek-ai/DeepSeek-V4-Flash-Base) with the release's compress_ratios (two sliding layers,
# then CSA and HCA alternating); V4-Pro's dimensions are its config.json's (hidden 7168, 384
# experts of 3072, top-6, scaling 2.5, as FlashInfer's and vLLM's V4-Pro tests and
# MindFormers' DeepseekV4Config repeat them) with HF's default schedule (two HCA layers, then
# HCA and CSA alternating).
V4_SIZES = {
    "deepseek_v4_flash": V4Config(
        layer_types=(SLIDING, SLIDING) + _alternating(CSA, HCA, 41),
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 40),
    "deepseek_v4_pro": V4Config(
        hidden_size=7168, moe_intermediate_size=3072, num_attention_heads=128,
        q_lora_rank=1536, o_groups=16, index_topk=1024, n_routed_experts=384,
        routed_scaling_factor=2.5, layer_types=(HCA, HCA) + _alternating(HCA, CSA, 59),
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 58),
}
CONTEXTS = (131072, 1048576)
DTYPES = ("bf16", "fp8")
# What the releases store in fp8 (e4m3, 128 x 128 e8m0 scales): the projections vLLM's V4
# loads through its fp8 linear method. The compressors' wkv / wgate and the indexer's
# weights_proj stay bf16 (vLLM multiplies them as they are), so do the embedding and head.
RELEASED_FP8 = re.compile(r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|"
                          r"indexer\.q_b_proj)\.weight$|shared_experts\.\w+\.weight$|"
                          r"(e_proj|h_proj)\.weight$")
FP8_BLOCK = (128, 128)
GPU_COUNTS = (1, 2, 4, 8)


def abstract_model(config: V4Config, dtype: str = "bf16") -> V4CausalLM:
  """The model as shapes only: bf16 weights (float32 norms, mHC, routers, biases, as the
  model holds them), or ``"fp8"``, the weights as released (module docstring)."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  model = nnx.eval_shape(lambda: V4CausalLM(config, rngs=nnx.Rngs(0), backend=XlaBackend(),
                                            param_dtype=jnp.bfloat16))
  if dtype == "fp8":
    for path, _ in list(nnx.state(model, nnx.Param).flat_state()):
      name, leading = rule_name(path)
      if leading:  # the routed experts: MXFP4
        quant.block_scale_abstract(model, path, None, quant.MXFP4_BLOCK, jnp.float8_e8m0fnu,
                                   packed=True)
      elif RELEASED_FP8.search(name):
        quant.block_scale_abstract(model, path, jnp.float8_e4m3fn, FP8_BLOCK,
                                   jnp.float8_e8m0fnu)
  return model


def param_bytes(model: V4CausalLM | list, mesh=None) -> tuple[int, int]:
  """(bytes on the busiest device, bytes in all) of an abstract model's state on ``mesh``
  (None: one device), by the partition rules (fp8 / fp4 scales like their weights).
  ``model`` may be its ``leaf_rules``, when several meshes share them."""
  rules = leaf_rules(model) if isinstance(model, nnx.Module) else model
  placed = None if mesh is None else shardings(rules, mesh)
  per_device = total = 0
  for path, leaf, _, _ in rules:
    shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
    total += math.prod(shape) * itemsize
    shard = shape if placed is None else placed[path].shard_shape(shape)
    per_device += math.prod(shard) * itemsize
  return per_device, total


def cache_bytes(config: V4Config, cache_dtype: str = "bf16") -> tuple[int, int]:
  """(bytes per token, bytes per sequence) of every layer's cache (``init_cache``'s arrays)
  in ``cache_dtype`` (``DTYPES``): bf16, or fp8 entries and indexer keys beside bf16 rings."""
  if cache_dtype not in DTYPES:
    raise ValueError(f"cache_dtype must be one of {DTYPES}, got {cache_dtype!r}")
  itemsize = 2  # the rings: bf16 either way
  entry_dtype = "fp8" if cache_dtype == "fp8" else jnp.bfloat16
  entry, key = (sharding.tree_bytes(jax.eval_shape(lambda f=f: f(config, 1, entry_dtype)))
                for f in (empty_entries, empty_index_keys))
  per_token = per_sequence = 0
  for layer_type in config.layer_types:
    per_sequence += config.sliding_window * config.head_dim * itemsize
    if layer_type == SLIDING:
      continue
    m = config.compress_ratio(layer_type)
    per_token += entry / m
    state_tokens = 2 * m if layer_type == CSA else m
    width = 2 * config.head_dim if layer_type == CSA else config.head_dim
    per_sequence += 2 * state_tokens * width * itemsize  # kv and gate
    if layer_type == CSA:
      per_token += key / m
      per_sequence += 2 * state_tokens * 2 * config.index_head_dim * itemsize
  return round(per_token), per_sequence


@dataclasses.dataclass(frozen=True)
class V4Plan:
  model: str
  mesh: str
  dtype: str
  param_bytes: int  # on the busiest device
  total_param_bytes: int
  token_bytes: int  # one more cached token, all layers
  sequence_bytes: int  # per sequence whatever its length: window rings, compressor state
  data_shards: int
  gpus: int

  def sequence_total(self, context: int) -> int:
    return self.sequence_bytes + context * self.token_bytes

  def sequences_that_fit(self, gpu: str, context: int) -> int:
    """Sequences of ``context`` tokens the mesh holds: each data shard's devices hold its
    sequences' caches whole, beside their parameters, in ``FIT_FRACTION`` of a GPU."""
    free = FIT_FRACTION * GPUS[gpu] - self.param_bytes
    return self.data_shards * max(int(free // self.sequence_total(context)), 0)


def make_plan(model: str, mesh_spec: str = "tensor=8", dtype: str = "bf16",
              abstract: V4CausalLM | list | None = None,
              cache_dtype: str = "bf16") -> V4Plan:
  """The plan of a named full-size V4 on an abstract mesh (``abstract``: its abstract model
  in ``dtype``, or that model's ``leaf_rules``, when several meshes share it), its caches
  in ``cache_dtype`` (``cache_bytes``)."""
  if model not in V4_SIZES:
    raise ValueError(f"model must be one of {sorted(V4_SIZES)}, got {model!r}")
  config = V4_SIZES[model]
  mesh = sharding.abstract_mesh(mesh_spec)
  check_mesh(config, mesh)
  abstract = abstract_model(config, dtype) if abstract is None else abstract
  per_device, total = param_bytes(abstract, mesh)
  token, sequence = cache_bytes(config, cache_dtype)
  return V4Plan(model, mesh_spec, dtype, per_device, total, token, sequence,
                mesh.shape[sharding.DATA], math.prod(mesh.shape.values()))


def candidate_meshes(config: V4Config, gpus: int) -> list[str]:
  """Every data x tensor x expert mesh of ``gpus`` devices that V4 can be split over."""
  meshes = []
  for data, tensor in itertools.product(range(1, gpus + 1), repeat=2):
    if gpus % (data * tensor):
      continue
    spec = f"data={data},tensor={tensor},expert={gpus // (data * tensor)}"
    try:
      check_mesh(config, sharding.abstract_mesh(spec))
    except ValueError:
      continue
    meshes.append(spec)
  return meshes


def mesh_plans(model: str, dtype: str, gpus: int, abstract: V4CausalLM | list | None = None,
               cache_dtype: str = "bf16") -> list[V4Plan]:
  """The plan of every mesh of ``gpus`` devices that V4's rules can split the model over
  (``abstract``, ``cache_dtype``: as ``make_plan``'s)."""
  config = V4_SIZES[model]
  abstract = abstract_model(config, dtype) if abstract is None else abstract
  rules = leaf_rules(abstract) if isinstance(abstract, nnx.Module) else abstract
  plans = []
  for spec in candidate_meshes(config, gpus):
    try:
      plans.append(make_plan(model, spec, dtype, rules, cache_dtype))
    except ValueError:  # a dimension the rules split does not divide
      continue
  return plans


def best_plan(plans: list[V4Plan], gpu: str, context: int = CONTEXTS[0]) -> V4Plan:
  """The plan holding the most ``context`` sequences on ``gpu`` (ties: the fewest parameter
  bytes a device)."""
  return max(plans, key=lambda p: (p.sequences_that_fit(gpu, context), -p.param_bytes))


def format_plans(plans: list[V4Plan]) -> str:
  """A markdown table, one row per plan: bytes a device and the sequences each GPU holds."""
  heads = " | ".join(f"{g}: {c // 1024}K seqs" for g in GPUS for c in CONTEXTS)
  lines = [f"| mesh | GPUs | params GiB/device | {heads} |",
           "|---" * (3 + len(GPUS) * len(CONTEXTS)) + "|"]
  for p in plans:
    counts = " | ".join(f"{p.sequences_that_fit(g, c):,}" for g in GPUS for c in CONTEXTS)
    lines.append(f"| {p.mesh} | {p.gpus} | {_gib(p.param_bytes)} | {counts} |")
  return "\n".join(lines)


def format_best(model: str, dtype: str, abstract: V4CausalLM | None = None,
                cache_dtype: str = "bf16") -> str:
  """A markdown table: for each GPU kind and count, its best mesh (``best_plan``) and the
  sequences it holds, or that the weights alone do not fit."""
  rules = leaf_rules(abstract_model(V4_SIZES[model], dtype) if abstract is None else abstract)
  by_count = {n: mesh_plans(model, dtype, n, rules, cache_dtype) for n in GPU_COUNTS}
  lines = ["| GPU | GPUs | best mesh | params GiB/device | "
           + " | ".join(f"{c // 1024}K seqs" for c in CONTEXTS) + " |",
           "|---" * (4 + len(CONTEXTS)) + "|"]
  for gpu in GPUS:
    for gpus, plans in by_count.items():
      p = best_plan(plans, gpu)
      fits = p.param_bytes <= FIT_FRACTION * GPUS[gpu]
      counts = " | ".join(f"{p.sequences_that_fit(gpu, c):,}" for c in CONTEXTS)
      lines.append(f"| {gpu} | {gpus} | {p.mesh if fits else 'none: the weights do not fit'} "
                   f"| {_gib(p.param_bytes)} | {counts} |")
  return "\n".join(lines)


def _gib(n: int) -> str:
  return f"{n / 2**30:,.1f}"


def describe(model: str, dtype: str, total_param_bytes: int, cache_dtype: str = "bf16") -> str:
  """The model's layers, its parameter bytes and its cache bytes, in two lines."""
  config = V4_SIZES[model]
  counts = {t: config.layer_types.count(t) for t in (SLIDING, CSA, HCA)}
  token, sequence = cache_bytes(config, cache_dtype)
  caches = "bf16" if cache_dtype == "bf16" else "fp8 entries and indexer keys, bf16 rings"
  weights = ("bf16 weights" if dtype == "bf16" else
             "weights as released: fp8 projections, fp4 (MXFP4) routed experts")
  return (f"{model}: {config.num_layers} layers ({counts[SLIDING]} sliding, {counts[CSA]} CSA, "
          f"{counts[HCA]} HCA), {total_param_bytes / 2**30:,.1f} GiB of parameters in all "
          f"({weights})\n"
          f"cache ({caches}): {token:,} B per token over all layers, plus "
          f"{sequence / 2**20:,.1f} MiB per sequence (window rings, compressor state)")


def format_rules() -> str:
  """V4's partition rules as a markdown table, the caches' spec last."""
  rules = plan.format_rules(V4_PARTITION_RULES, {"expert": sharding.EXPERT}, "V4 parameter")
  return (rules + "\n| caches (window ring, entries, compressor state, indexer keys) | "
          f"`{sharding.cache_spec(0, 3)}` |")
