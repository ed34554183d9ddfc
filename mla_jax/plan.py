"""Full-size deployment plans without the hardware: bytes per device, fit, paged-cache capacity,
lowered collectives.

Everything here works on abstract values (``nnx.eval_shape``, ``AbstractMesh``): a 671B
model is described, split by the partition rules and lowered for CUDA on a laptop, and
nothing of its size is ever allocated.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from mla_jax import checks, quant, sharding
from mla_jax.backends import XlaBackend
from mla_jax.decoding.steps import Progress
from mla_jax.models.config import FULL_SIZE, ModelConfig
from mla_jax.models.hf_layout import param_layouts
from mla_jax.models.lm import CausalLM, cache_shardings, check_mesh, state_shardings

# Memory that nvidia-smi reports for each GPU (MiB).
GPUS = {"H100 80GB": 81559 * 2**20, "H200 141GB": 143771 * 2**20}
# Parameters, caches and their sharding must leave room for activations and XLA's workspace.
FIT_FRACTION = 0.9
# What DeepSeek's fp8 releases store as float8_e4m3 with 128 x 128 float32 block scales:
# every projection except the router, the indexer's head weights, embeddings and lm_head.
FP8_WEIGHTS = re.compile(r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|wq_b|wk|"
                         r"gate_proj|up_proj|down_proj)\.weight$")
FP8_BLOCK = 128
# Bytes per cached token per layer: latent row + indexer key (docs/design.md §7).
CACHE_BYTES = {"bf16": (576 * 2, 128 * 2), "fp8": (656, 132)}


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device bytes of one model on one mesh."""

  model: str
  mesh: str
  dtype: str
  batch: int
  context: int
  param_bytes: int     # per device
  token_bytes: int     # one cached token over all layers, on every device of its data shard
  data_shards: int     # the mesh's 'data' size: each shard caches its own sequences
  total_param_bytes: int
  context_shards: int = 1  # the mesh's 'context' size: an engine's pools split over it

  @property
  def cache_bytes(self) -> int:
    """Per device: each data shard's sequences (``generate`` splits its batch over
    ``data``), 1/context_shards of their tokens on each context rank (an engine's pools)."""
    tokens = self.context * -(-self.batch // self.data_shards)
    return -(-tokens // self.context_shards) * self.token_bytes

  @property
  def device_bytes(self) -> int:
    return self.param_bytes + self.cache_bytes

  def fits(self, gpu: str) -> bool:
    return self.device_bytes <= budget(gpu)


def budget(gpu: str) -> float:
  """Bytes of one GPU that parameters and caches may take."""
  return FIT_FRACTION * GPUS[gpu]


def abstract_model(config: ModelConfig, dtype: str = "bf16") -> CausalLM:
  """The model as shapes only (no parameter is allocated).

  bf16: every parameter in bfloat16 except what HF keeps in float32 (router, indexer head
  weights). fp8: ``FP8_WEIGHTS`` as e4m3 ``BlockScaledWeight``s with one float32 scale per
  128 x 128 block, as ``load_pretrained(dtype="fp8")`` holds DeepSeek's fp8 release.
  """
  model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), backend=XlaBackend(),
                                          param_dtype=jnp.bfloat16))
  if dtype == "fp8":
    for path, layout in param_layouts(nnx.state(model, nnx.Param)).items():
      if FP8_WEIGHTS.search(layout.rule_name) and quant.is_block_scalable(model, path):
        quant.block_scale_abstract(model, path, jnp.float8_e4m3fn, (FP8_BLOCK, FP8_BLOCK))
  return model


def param_bytes(state, mesh) -> tuple[int, int]:
  """(bytes on the busiest device, bytes in total) of every parameter of an abstract state,
  split by the partition rules (fp8 scales like their weights; a split that would cut a
  scale block is refused)."""
  shardings = dict(state_shardings(state, mesh).flat_state())
  layouts = param_layouts(state)
  per_device = total = 0
  for path, leaf in nnx.state(state, nnx.Param).flat_state():
    shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
    if path[-1] == quant.VALUES:
      quant.check_block_split(layouts[path].rule_name, shape, shardings[path].spec, mesh,
                              (FP8_BLOCK, FP8_BLOCK))
    per_device += math.prod(shardings[path].shard_shape(shape)) * itemsize
    total += math.prod(shape) * itemsize
  return per_device, total


def token_bytes(config: ModelConfig, cache_dtype: str) -> int:
  """Bytes of one cached token over all layers, MTP layers included: a latent row in every
  layer, an indexer key in every layer that scores its own keys (IndexShare's shared layers
  reuse a top-k; an MTP layer always scores its own)."""
  latent, key = CACHE_BYTES[cache_dtype]
  layers = config.num_layers + config.num_mtp_layers
  indexed = 0 if config.mla.indexer is None else sum(
      not config.shares_topk(i) for i in range(layers))
  return layers * latent + indexed * key


def make_plan(model: str, mesh_spec: str, dtype: str = "bf16", batch: int = 1,
              context: int = 4096, cache_dtype: str = "bf16", mtp_layers: int = 0) -> Plan:
  """Bytes per device for a named full-size model (``FULL_SIZE``) on an abstract mesh.

  ``mtp_layers``: MTP layers to count beside the model, their parameters and caches (the
  DeepSeek-V3.2, GLM-5 and DeepSeek-V3 releases ship 1; 0 plans plain decoding, as
  ``load_pretrained(..., mtp=False)`` loads it).
  """
  if model not in FULL_SIZE:
    raise ValueError(f"model must be one of {sorted(FULL_SIZE)}, got {model!r}")
  if dtype not in ("bf16", "fp8"):
    raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")
  if cache_dtype not in CACHE_BYTES:
    raise ValueError(f"cache dtype must be one of {sorted(CACHE_BYTES)}, got {cache_dtype!r}")
  for name, value in (("batch", batch), ("context", context)):
    if not checks.is_int(value) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if not checks.is_int(mtp_layers) or mtp_layers < 0:
    raise ValueError(f"mtp_layers must be an int >= 0, got {mtp_layers!r}")
  batch, context = int(batch), int(context)
  config = dataclasses.replace(FULL_SIZE[model](), num_mtp_layers=int(mtp_layers))
  if context > config.mla.max_position_embeddings:
    raise ValueError(f"context {context} exceeds {model}'s max_position_embeddings "
                     f"{config.mla.max_position_embeddings}")
  mesh = sharding.abstract_mesh(mesh_spec)
  check_mesh(config, mesh)
  if batch % mesh.shape[sharding.DATA]:
    raise ValueError(f"batch {batch} cannot be split over mesh axis 'data' of size "
                     f"{mesh.shape[sharding.DATA]}")
  state = nnx.state(abstract_model(config, dtype))
  per_device, total = param_bytes(state, mesh)
  return Plan(model, mesh_spec, dtype, batch, context, per_device,
              token_bytes(config, cache_dtype), mesh.shape[sharding.DATA], total,
              mesh.shape[sharding.CONTEXT])


def format_plans(plans: list[Plan]) -> str:
  """A markdown table, one row per plan."""
  gib = lambda b: f"{b / 2**30:,.1f}"
  lines = ["| model | mesh | weights | batch x context | params GiB/device | caches GiB/device "
           "| total GiB/device | " + " | ".join(f"fits {g}" for g in GPUS) + " |",
           "|---" * (7 + len(GPUS)) + "|"]
  for p in plans:
    fits = " | ".join("yes" if p.fits(g) else "no" for g in GPUS)
    lines.append(f"| {p.model} | {p.mesh} | {p.dtype} | {p.batch} x {p.context} | "
                 f"{gib(p.param_bytes)} | {gib(p.cache_bytes)} | {gib(p.device_bytes)} | "
                 f"{fits} |")
  return "\n".join(lines)


# Context lengths at which the paged-cache table counts sequences.
PAGED_CONTEXTS = (4096, 32768, 131072)


@dataclasses.dataclass(frozen=True)
class PageCapacity:
  """An engine's page pool in what one GPU kind has left after the weights.

  An engine has one pool (``serving.runner.engine_pools``): whole on every device of the
  ``data``, ``tensor`` and ``expert`` axes, its pages split over ``context`` (each rank holds
  1/context of them, ``mla_jax.context_parallel``). So the pool holds ``context_shards`` times
  the pages one device has room for, and a ``data`` axis adds none: its shards share the one
  pool (docs/serving.md, "Pools and the data axis").
  """

  gpu: str
  page_size: int
  page_bytes: int   # one whole page: page_size tokens over all layers (on one device)
  pages: int        # in the engine's pool (over its context ranks)
  context_shards: int = 1

  @property
  def pages_per_device(self) -> int:
    return self.pages // self.context_shards

  @property
  def tokens(self) -> int:
    """Cached tokens the engine's pool holds."""
    return self.pages * self.page_size

  def sequences(self, context: int) -> int:
    """Sequences of ``context`` tokens (in whole pages) that fit in the pool."""
    return self.pages // -(-context // self.page_size)


def pages_that_fit(device_bytes: float, param_bytes: int, page_bytes: int) -> int:
  """The pages of ``page_bytes`` each that fit in ``FIT_FRACTION`` of a device of
  ``device_bytes`` after ``param_bytes`` of weights (0 when the weights alone do not fit):
  the rule of ``mla-jax plan`` and of ``mla-jax serve --num-pages auto``."""
  return max(0, int((FIT_FRACTION * device_bytes - param_bytes) // page_bytes))


def page_capacity(p: Plan, gpu: str, page_size: int = 64) -> PageCapacity:
  """The pages of ``page_size`` tokens that fit next to ``p``'s weights on ``gpu`` (none
  when the weights alone do not fit)."""
  if gpu not in GPUS:
    raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {gpu!r}")
  if not checks.is_int(page_size) or page_size < 1:
    raise ValueError(f"page size must be a positive int, got {page_size!r}")
  page_bytes = int(page_size) * p.token_bytes
  pages = p.context_shards * pages_that_fit(GPUS[gpu], p.param_bytes, page_bytes)
  return PageCapacity(gpu, int(page_size), page_bytes, pages, p.context_shards)


@dataclasses.dataclass(frozen=True)
class LiveCapacity:
  """What ``--num-pages auto`` found on the devices of a live model."""

  device_bytes: int  # the busiest GPU's memory limit, or on a host the memory available
  param_bytes: int   # the weights on the busiest device
  page_bytes: int    # one page of every pool on one device (``engine.page_bytes``)
  pages: int
  host: bool = False  # no GPU: the pools live in host memory (HOST_POOL_FRACTION, _BYTES)

  def describe(self) -> str:
    gib = lambda b: f"{b / 2**30:,.1f} GiB"
    if self.host:
      return (f"{self.pages:,} pages: no GPU, so {HOST_POOL_FRACTION:.0%} of the "
              f"{gib(self.device_bytes)} of host memory available, at most "
              f"{gib(HOST_POOL_BYTES)}, over {self.page_bytes:,} B per page (give a number "
              "to choose)")
    return (f"{self.pages:,} pages: {gib(self.device_bytes)} per device x {FIT_FRACTION:.0%}, "
            f"minus {gib(self.param_bytes)} of weights, over {self.page_bytes:,} B per page "
            f"(the rest is left for activations and XLA's workspace)")


# Without a GPU the pools share host memory with everything else: ``--num-pages auto`` then
# takes this fraction of the memory available, and at most this many bytes of pages.
HOST_POOL_FRACTION = 0.25
HOST_POOL_BYTES = 2 * 2**30


def live_capacity(model, page_bytes: int) -> LiveCapacity:
  """The pages of ``page_bytes`` that fit next to ``model``'s weights on its busiest device:
  ``FIT_FRACTION`` of a GPU's memory limit (``memory_stats``) after the weights it holds; on
  a host without a GPU, ``HOST_POOL_FRACTION`` of the memory available (``/proc/meminfo``,
  the weights already loaded) and at most ``HOST_POOL_BYTES``."""
  state = nnx.state(model)
  per_device = collections.Counter()
  for leaf in jax.tree.leaves(state):
    for shard in getattr(leaf, "addressable_shards", ()):
      per_device[shard.device] += shard.data.nbytes
  device, params = per_device.most_common(1)[0] if per_device else (jax.devices()[0], 0)
  limit = _memory_limit(device)
  if limit is not None:
    return LiveCapacity(int(limit), int(params), int(page_bytes),
                        pages_that_fit(limit, params, page_bytes))
  available = _host_available_bytes()
  pool = min(HOST_POOL_FRACTION * available, HOST_POOL_BYTES)
  return LiveCapacity(available, int(params), int(page_bytes), int(pool // page_bytes),
                      host=True)


def _memory_limit(device) -> int | None:
  """A GPU's memory limit; None for a device that states none (a host's CPU)."""
  return (device.memory_stats() or {}).get("bytes_limit")


def _host_available_bytes() -> int:
  with open("/proc/meminfo") as f:
    fields = dict(line.split(":", 1) for line in f)
  return int(fields["MemAvailable"].split()[0]) * 1024


def format_pages(plans: list[Plan], page_size: int) -> str:
  """A markdown table, one row per plan and GPU kind."""
  contexts = " | ".join(f"sequences x {c // 1024}K" for c in PAGED_CONTEXTS)
  lines = [f"| mesh | GPU | pages | pages/device | tokens | {contexts} |",
           "|---" * (5 + len(PAGED_CONTEXTS)) + "|"]
  for p in plans:
    for gpu in GPUS:
      cap = page_capacity(p, gpu, page_size)
      counts = " | ".join(f"{cap.sequences(c):,}" for c in PAGED_CONTEXTS)
      lines.append(f"| {p.mesh} | {gpu} | {cap.pages:,} | {cap.pages_per_device:,} | "
                   f"{cap.tokens:,} | {counts} |")
  return "\n".join(lines)


def format_rules(rules=sharding.PARTITION_RULES, leading=sharding.LEADING_AXIS_SPECS,
                 names: str = "HF parameter") -> str:
  """Partition rules (V3.2's by default) as a markdown table (pipes in the regexes escaped)."""
  lines = [f"| {names} (regex) | PartitionSpec |", "|---|---|"]
  for pattern, spec in rules:
    escaped = pattern.replace("|", "\\|")
    lines.append(f"| `{escaped}` | `{spec}` |")
  lines += [f"| stacked {kind} axis | `{axis}` |" for kind, axis in leading.items()]
  return "\n".join(lines)


_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                "collective_permute", "collective_broadcast")


def lower_decode_step(model: str, mesh_spec: str, batch: int = 8, context: int = 4096):
  """Lowers one full-size bf16 decode step for CUDA on an abstract GPU mesh (nothing runs).

  Returns ``(collective counts, Triton kernel calls, num_partitions)`` of the StableHLO. The
  collectives counted are those the program states itself (the MoE's ``psum`` under
  ``shard_map``); XLA's SPMD partitioner adds the rest when it compiles for the devices.
  """
  from mla_jax.backends.pallas import PallasTritonBackend
  from mla_jax.generation import programs

  config = FULL_SIZE[model]()
  sizes = sharding.parse_mesh_spec(mesh_spec)
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = AbstractMesh(tuple(sizes[a] for a in sharding.AXES), sharding.AXES,
                      axis_types=(AxisType.Auto,) * len(sharding.AXES), abstract_device=device)
  check_mesh(config, mesh)
  with jax.sharding.use_abstract_mesh(mesh):
    lm = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), backend=PallasTritonBackend(),
                                         param_dtype=jnp.bfloat16, mesh=mesh,
                                         grouped_matmul="ragged_dot"))
    graphdef, state = nnx.split(lm)
    caches = jax.eval_shape(lambda: lm.init_cache(batch, context, jnp.bfloat16))

    def placed(tree, shardings):
      return jax.tree.map(lambda s, sub: jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), sub), shardings, tree)

    batch_spec = NamedSharding(mesh, sharding.BATCH_SPEC)
    replicated = NamedSharding(mesh, sharding.REPLICATED)
    args = (placed(state, state_shardings(state, mesh)),
            placed(caches, cache_shardings(caches, mesh)),
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_spec),
            Progress(jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=batch_spec),
                     jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_spec)),
            jax.ShapeDtypeStruct((), jnp.uint32, sharding=replicated),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
    settings = programs.DecodeSettings(lm.step_plan(1, None, capacity=context), steps=1)
    text = programs.trace(graphdef, *args, settings=settings).lower(
        lowering_platforms=("cuda",)).as_text()
  counts = collections.Counter(re.findall(r"stablehlo\.(" + "|".join(_COLLECTIVES) + r")\b",
                                          text))
  partitions = re.search(r"mhlo\.num_partitions = (\d+)", text)
  return dict(counts), text.count("__gpu$xla.gpu.triton"), int(partitions.group(1))
