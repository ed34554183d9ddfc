"""A complete decoder-only causal LM in the DeepSeek-V3.2 / GLM-5 shape.

Consecutive layers of identical structure form groups (``layer_groups``: the dense-MLP
prefix, the MoE body, a repeating full/shared indexer pattern); each group's parameters are
stacked on a leading axis and the group runs as one ``lax.scan``, so compile time follows the
number of groups rather than the depth. Checkpoints keep Hugging Face's per-layer names
(``mla_jax.models.hf_layout`` maps them).

Routes stay static and model-wide per step: the model resolves one ``StepPlan`` in Python
before the scans and every layer of every repetition reads it, so all trace the same route.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import checks, sharding
from mla_jax.attention import DeepseekV32Attention, MLAAttention, MLAAttentionBase
from mla_jax.backends import Backend, get_backend
from mla_jax.cache import LayerCache, cache_shape, empty_layer_cache, resolve_cache_dtype
from mla_jax.decoding.protocol import FlatRows
from mla_jax.layers import Linear, RMSNorm
from mla_jax.models.config import LayerGroup, ModelConfig, layer_groups
from mla_jax.models.mlp import MLP
from mla_jax.models.moe import MoE, resolve_grouped_matmul
from mla_jax.models.mtp import MTPLayer, check_mtp_inputs
from mla_jax.paged_cache import PagedLayerCache, empty_pools
from mla_jax.routing import PrefillRoute
from mla_jax.step_plan import StepPlan, plan_flat_step, plan_step, static_num_cached, step_route

ATTENTION_CLASSES = {"mqa-only": DeepseekV32Attention, "dense-capable": MLAAttention}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
  """Every layer's cache: per group, per unit position, a ``LayerCache`` stacked over reps."""

  groups: tuple[tuple[LayerCache, ...], ...]
  layout: tuple[LayerGroup, ...] = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    # Structure only (counts of groups and unit positions): pytree transforms rebuild the
    # cache with placeholder leaves, but always in the same tuples. A short ``groups`` would
    # otherwise run only the layers it covers (the model zips groups with its stacks).
    for g, group in enumerate(self.layout):
      if g >= len(self.groups):
        raise ValueError(f"ModelCache: group {g} (layers {group.first}..{group.end - 1}) of "
                         f"its layout has no caches: {len(self.groups)} group(s) of caches "
                         f"for {len(self.layout)} in the layout")
      if len(self.groups[g]) != group.unit_len:
        raise ValueError(f"ModelCache: group {g} (layers {group.first}..{group.end - 1}) "
                         f"holds {len(self.groups[g])} layer cache(s), but its unit has "
                         f"{group.unit_len} layer(s)")
    if len(self.groups) > len(self.layout):
      raise ValueError(f"ModelCache: group {len(self.layout)} has caches but no place in the "
                       f"layout ({len(self.groups)} group(s) of caches for {len(self.layout)})")

  @property
  def num_cached_B(self):
    return self.groups[0][0].num_cached_B[0]

  @property
  def num_layers(self) -> int:
    return self.layout[-1].end

  @property
  def capacity(self) -> int:
    return self.groups[0][0].layer_view(0).capacity

  def with_num_cached(self, num_cached_B) -> ModelCache:
    """The same buffers with every layer's lengths set to ``num_cached_B`` (an int [B] or a
    scalar for every sequence): a rollback or a fill, as later writes overwrite the rows
    past them."""
    return dataclasses.replace(self, groups=tuple(tuple(dataclasses.replace(
        c, num_cached_B=jnp.broadcast_to(num_cached_B, c.num_cached_B.shape).astype(
            c.num_cached_B.dtype))
        for c in unit) for unit in self.groups))

  @property
  def pools(self):
    """The arrays alone, per group and unit position (a paged cache's: what an engine keeps
    between steps, ``CausalLM.init_pools``'s structure)."""
    return tuple(tuple(c.pools for c in unit) for unit in self.groups)

  def layer(self, index: int) -> LayerCache:
    """Layer ``index``'s cache (a slice of its group's stacked cache)."""
    g, rep, position = LayerGroup.locate(self.layout, index)
    return jax.tree.map(lambda a: a[rep], self.groups[g][position])


class Embed(nnx.Module):
  def __init__(self, vocab_size: int, hidden_size: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    init = jax.random.normal(rngs.params(), (vocab_size, hidden_size), jnp.float32)
    self.weight = nnx.Param(init.astype(param_dtype))

  def __call__(self, ids_BT):
    return self.weight[...][ids_BT]


class DecoderLayer(nnx.Module):
  def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs, backend: Backend,
               mesh, grouped_matmul: str, param_dtype, attention_class=None):
    d = config.mla.hidden_size
    self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
    self.self_attn = (attention_class or ATTENTION_CLASSES[config.attention])(
        config.mla, rngs=rngs, backend=backend, mesh=mesh, param_dtype=param_dtype,
        shares_topk=config.shares_topk(layer_idx))
    self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
    if config.uses_moe(layer_idx):
      self.mlp = MoE(d, config.moe, rngs=rngs, grouped_matmul=grouped_matmul, mesh=mesh,
                     param_dtype=param_dtype)
    else:
      self.mlp = MLP(d, config.intermediate_size, rngs=rngs, param_dtype=param_dtype)
    self.mesh = mesh

  def __call__(self, h_BTD, cache, plan: StepPlan, *, new_lens_B=None, shared_topk_BTK=None):
    h_BTD, attn = self.forward(h_BTD, cache, plan, new_lens_B=new_lens_B,
                               shared_topk_BTK=shared_topk_BTK)
    return h_BTD, attn.cache, attn.topk_BTK

  def forward(self, h_BTD, cache, plan: StepPlan, *, new_lens_B=None, shared_topk_BTK=None):
    """The new hidden states and the attention's whole ``AttentionOutput``."""
    attn = self.self_attn.attend(self.input_layernorm(h_BTD), cache, plan,
                                 new_lens_B=new_lens_B, shared_topk_BTK=shared_topk_BTK)
    h_BTD = sharding.constrain(h_BTD + attn.out_BTD, self.mesh)
    h_BTD = sharding.constrain(h_BTD + self.mlp(self.post_attention_layernorm(h_BTD)), self.mesh)
    return h_BTD, attn


class LayerUnit(nnx.Module):
  """One repetition of a group's unit: ``unit_len`` consecutive decoder layers.

  Layer l draws its parameters from ``fold_in(layers_key, l)``, so the weights do not depend
  on how layers are grouped (scanned or not).
  """

  def __init__(self, config: ModelConfig, group: LayerGroup, layers_key, rep, **layer_kwargs):
    self.layers = nnx.List([
        DecoderLayer(config, group.layer(0, u),
                     rngs=nnx.Rngs(params=jax.random.fold_in(layers_key, group.layer(rep, u))),
                     **layer_kwargs)
        for u in range(group.unit_len)])


class LayerStack(nnx.Module):
  """A group: its unit's parameters stacked over ``reps``, run by one ``lax.scan``."""

  def __init__(self, config: ModelConfig, group: LayerGroup, layers_key, **layer_kwargs):
    graphdef = None

    def init(rep):
      nonlocal graphdef
      unit = LayerUnit(config, group, layers_key, rep, **layer_kwargs)
      graphdef, state = nnx.split(unit)
      return state

    state = jax.vmap(init)(jnp.arange(group.reps))
    self.unit = nnx.merge(graphdef, state)
    self.group = group

  def __call__(self, h_BTD, topk_BTK, caches, plan: StepPlan, *, new_lens_B):
    """Runs every repetition; ``topk_BTK`` carries the last full layer's top-k (or None).

    Returns the new hidden states, top-k and caches, and the sum of the layers' indexer
    losses (0 unless ``plan.indexer_loss`` asks for them).

    The stacked caches ride in the scan's carry and each layer writes its new rows into them
    in place (``StackedLayerView``); scanning them as inputs and outputs instead would copy
    every layer's whole cache on every step.
    """
    graphdef, state = nnx.split(self.unit)

    def body(carry, xs):
      h_BTD, topk_BTK, unit_caches, loss = carry
      unit_state, rep = xs
      unit = nnx.merge(graphdef, unit_state)
      new_caches = []
      for layer, cache in zip(unit.layers, unit_caches):
        h_BTD, attn = layer.forward(h_BTD, cache.layer_view(rep), plan,
                                    new_lens_B=new_lens_B, shared_topk_BTK=topk_BTK)
        if plan.carry_topk and not layer.self_attn.shares_topk:
          topk_BTK = attn.topk_BTK
        if attn.indexer_loss is not None:
          loss = loss + attn.indexer_loss
        new_caches.append(attn.cache.buffers)
      return (h_BTD, topk_BTK, tuple(new_caches), loss), None

    reps = jnp.arange(self.group.reps, dtype=jnp.int32)
    carry = (h_BTD, topk_BTK, caches, jnp.zeros((), jnp.float32))
    (h_BTD, topk_BTK, caches, loss), _ = jax.lax.scan(body, carry, (state, reps))
    return h_BTD, topk_BTK, caches, loss


class Model(nnx.Module):
  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype,
               groups: tuple[LayerGroup, ...], **layer_kwargs):
    self.embed_tokens = Embed(config.vocab_size, config.mla.hidden_size, rngs=rngs,
                              param_dtype=param_dtype)
    layers_key = rngs.params()
    self.groups = nnx.List([LayerStack(config, group, layers_key, param_dtype=param_dtype,
                                       **layer_kwargs)
                            for group in groups])
    self.norm = RMSNorm(config.mla.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)


class _Parts(nnx.Module):
  """What ``CausalLM`` holds, built from one key (so that it can be built under ``jit``)."""

  def __init__(self, config: ModelConfig, key, param_dtype, scan_layers: bool, **layer_kwargs):
    rngs = nnx.Rngs(params=key)
    groups = (layer_groups(config) if scan_layers else
              tuple(LayerGroup(i, 1, 1) for i in range(config.num_layers)))
    self.model = Model(config, rngs=rngs, param_dtype=param_dtype, groups=groups,
                       **layer_kwargs)
    self.lm_head = Linear(config.mla.hidden_size, config.vocab_size, rngs=rngs,
                          param_dtype=param_dtype)
    # Drawn after the main model's keys, so adding MTP layers changes none of its weights.
    mtp_key = rngs.params()
    self.mtp = nnx.List([_mtp_layer(config, config.num_layers + i,
                                    nnx.Rngs(params=jax.random.fold_in(mtp_key, i)),
                                    param_dtype, layer_kwargs)
                         for i in range(config.num_mtp_layers)])


def _mtp_layer(config: ModelConfig, layer_idx: int, rngs: nnx.Rngs, param_dtype,
               layer_kwargs) -> MTPLayer:
  block = DecoderLayer(config, layer_idx, rngs=rngs, param_dtype=param_dtype, **layer_kwargs)
  return MTPLayer(config.mla.hidden_size, block, eps=config.rms_norm_eps, rngs=rngs,
                  param_dtype=param_dtype)


class CausalLM(nnx.Module):
  """``logits, caches = lm(ids_BT, caches)``; see ``MLAAttentionBase.__call__`` for routing.

  With ``config.num_mtp_layers`` the model also holds its multi-token-prediction layers
  (``lm.mtp``, ``mla_jax.models.mtp``; empty without), run by ``mtp_forward`` on caches of
  their own (``init_mtp_cache``); ``lm(..., return_hidden=True)`` returns the hidden states
  they read.

  ``backend`` is the attention kernels; with ``mesh`` the model is created already sharded by
  ``mla_jax.sharding``'s rules: each device computes and holds only its own shards, and no
  full copy of a parameter ever sits on one device. The same ``rngs`` give the same weights
  with and without a mesh. ``grouped_matmul`` picks the MoE's grouped matmul
  (``models.moe.resolve_grouped_matmul``). ``scan_layers=False`` runs every layer on its own (one group per
  layer; the compile time then grows with depth), for comparisons. ``attention_class``
  replaces the config's attention module in every layer (a subclass of ``MLAAttentionBase``
  with the same parameters), for experiments such as ``mla_jax.misrouted``.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, backend: str | Backend = "auto",
               param_dtype=jnp.float32, mesh=None, grouped_matmul: str = "auto",
               scan_layers: bool = True, attention_class: type[MLAAttentionBase] | None = None):
    if not isinstance(config, ModelConfig):
      raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    checks.float_dtype(param_dtype, "param_dtype")
    if attention_class is not None and not (isinstance(attention_class, type) and
                                            issubclass(attention_class, MLAAttentionBase)):
      raise TypeError(f"attention_class must be a subclass of MLAAttentionBase, got "
                      f"{attention_class!r}")
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(0)), got {type(rngs).__name__}")
    backend = get_backend(backend)
    grouped_matmul = resolve_grouped_matmul(grouped_matmul)
    if mesh is not None:
      check_mesh(config, mesh)
    self.config = config
    self.backend = backend
    self.mesh = mesh
    self.grouped_matmul = grouped_matmul
    key = rngs.params()
    build = lambda k: _Parts(config, k, param_dtype, scan_layers, backend=backend, mesh=mesh,
                             grouped_matmul=grouped_matmul, attention_class=attention_class)
    parts = build(key) if mesh is None else build_sharded(build, key, mesh)
    self.model, self.lm_head, self.mtp = parts.model, parts.lm_head, parts.mtp

  @property
  def layer_groups(self) -> tuple[LayerGroup, ...]:
    return tuple(stack.group for stack in self.model.groups)

  def _locate(self, index: int) -> tuple[DecoderLayer, int]:
    """The stacked module holding layer ``index`` and the layer's repetition in it."""
    g, rep, position = LayerGroup.locate(self.layer_groups, index)
    return self.model.groups[g].unit.layers[position], rep

  def _attention_modules(self) -> list[MLAAttentionBase]:
    """One attention module per unit position of every group (their static attributes are
    every layer's; no parameter is touched)."""
    return ([layer.self_attn for stack in self.model.groups for layer in stack.unit.layers] +
            [layer.block.self_attn for layer in self.mtp])

  def layer_module(self, index: int) -> DecoderLayer:
    """Layer ``index`` as a module of its own (its parameters sliced out of its group)."""
    stacked, rep = self._locate(index)
    graphdef, state = nnx.split(stacked)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[rep], state))

  def init_cache(self, batch_size: int, capacity: int, dtype=jnp.float32,
                 spare: int = 0) -> ModelCache:
    """Empty caches for every layer, placed by the cache rules on the model's mesh.

    ``dtype``: ``"fp32" | "bf16" | "fp8"`` or a float dtype (``mla_jax.cache``); ``"fp8"``
    holds latent rows and indexer keys in the fp8 layouts, quantized on write. ``spare``
    (the decode protocol's): positions a step may write past where the next one starts; rows
    are addressed by position within ``capacity``, so nothing more is needed here.
    """
    checks.static_int(spare, "spare", minimum=0)
    dtype = resolve_cache_dtype(dtype)
    batch_size, capacity = cache_shape(self.config.mla, batch_size, capacity)

    def build():
      groups = []
      for group in self.layer_groups:
        unit = []
        for u in range(group.unit_len):
          layer = empty_layer_cache(self.config.mla, batch_size, capacity, dtype,
                                    index_keys=not self.config.shares_topk(group.layer(0, u)))
          unit.append(jax.tree.map(lambda a: jnp.broadcast_to(a, (group.reps, *a.shape)),
                                   layer))
        groups.append(tuple(unit))
      return ModelCache(tuple(groups), self.layer_groups)

    return self._place_caches(build, batch_size, cache_shardings)

  def _place_caches(self, build, batch_size: int, shardings_of):
    """``build()``'s caches, made in place by the cache rules on the model's mesh (batch over
    ``data``; ``shardings_of(abstract caches, mesh)``), or on the default device."""
    if self.mesh is None:
      return build()
    if sharding.axis_size(self.mesh, sharding.CONTEXT) > 1:
      raise ValueError(
          f"a mesh with a 'context' axis (size {sharding.axis_size(self.mesh, sharding.CONTEXT)})"
          " splits an engine's page pools only; generate's contiguous caches cannot be split "
          "over it: serve with mla_jax.serving.Engine, or build the model on a mesh without it")
    if batch_size % sharding.axis_size(self.mesh, sharding.DATA):
      raise ValueError(f"batch_size {batch_size} cannot be split over mesh axis 'data' of "
                       f"size {sharding.axis_size(self.mesh, sharding.DATA)}")
    return jax.jit(build, out_shardings=shardings_of(jax.eval_shape(build), self.mesh))()

  def init_mtp_cache(self, batch_size: int, capacity: int, dtype=jnp.float32,
                     spare: int = 0) -> tuple[LayerCache, ...]:
    """Empty caches of the MTP layers: one ``LayerCache`` per layer (``()`` without any),
    each with indexer keys in a DSA model; ``dtype`` as in ``init_cache`` (``"fp8"``
    included). They are placed like ``init_cache``'s on the model's mesh.

    MTP row p holds the pair (main hidden state at p, token at p + 1), so a speculative
    decoder keeps these lengths equal to the main cache's (or one behind while the token
    after the last cached one is not known yet) and rolls them back the same way
    (``dataclasses.replace(cache, num_cached_B=...)``; rows past the length are overwritten by
    later writes). With the main cache's capacity one ``step_plan`` serves both.
    """
    dtype = resolve_cache_dtype(dtype)
    batch_size, capacity = cache_shape(self.config.mla, batch_size, capacity)
    build = lambda: tuple(empty_layer_cache(self.config.mla, batch_size, capacity, dtype)
                          for _ in self.mtp)
    if not self.mtp:
      return ()
    return self._place_caches(
        build, batch_size,
        lambda caches, mesh: tuple(layer_cache_shardings(c, mesh) for c in caches))

  # ---- the decode protocol (mla_jax.decoding.protocol) ------------------------------------

  sequence_state: ClassVar[bool] = False  # every cached row lives in a page: no rings

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def max_positions(self) -> int:
    return self.config.mla.max_position_embeddings

  @property
  def num_mtp_layers(self) -> int:
    return self.config.num_mtp_layers

  @property
  def key_chunk(self) -> int | None:
    """Key positions a flat step's indexer scores a block (the backend's; None: no
    indexer)."""
    return None if self.config.mla.indexer is None else self.backend.key_chunk

  def check_page_size(self, page_size: int) -> None:
    """Any page size holds this model's rows: one latent row (and key) per token."""

  def init_pools(self, num_rows: int, cache_dtype, *, page_size: int | None = None,
                 num_state_slots: int = 0, mtp: bool = False):
    """An engine's page pools of ``num_rows`` token rows: ``(per group and unit position
    (latent, keys or None), per MTP layer the same, or () without ``mtp``)``, in the cache
    format ``cache_dtype`` (``PagedLayerCache`` reads them)."""
    config, cache_dtype = self.config, resolve_cache_dtype(cache_dtype, "cache_dtype")
    main = tuple(
        tuple(empty_pools(config.mla, group.reps, num_rows, cache_dtype,
                          index_keys=not config.shares_topk(group.layer(0, u)))
              for u in range(group.unit_len))
        for group in self.layer_groups)
    mtp_pools = tuple(empty_pools(config.mla, 1, num_rows, cache_dtype, index_keys=True)
                      for _ in range(config.num_mtp_layers if mtp else 0))
    return main, mtp_pools

  def paged_cache(self, pools, rows: FlatRows) -> ModelCache:
    """The main pools (``init_pools``' first part) as the caches of one flat step: each
    row a sequence of one token at its position, with its sequence's block table, the rows
    of a sequence sharing its segment (``StepPlan.segmented``)."""
    table_TN = rows.table_SN[rows.seq_T]
    return ModelCache(tuple(
        tuple(PagedLayerCache(latent, keys, table_TN,
                              jnp.broadcast_to(rows.pos_T, (group.reps, *rows.pos_T.shape)),
                              rows.page_size, rows.seq_T, rows.key_blocks, reps=group.reps,
                              context=rows.context)
              for latent, keys in unit)
        for group, unit in zip(self.layer_groups, pools)), self.layer_groups)

  def mtp_paged_caches(self, mtp_pools, table_BN, num_cached_B, *, page_size: int,
                       context: int = 1, segment_ids_B=None, key_blocks=None):
    """The MTP layers' pools (``init_pools``' second part) as their caches, one layer
    each, at ``num_cached_B`` (a flat step's rows: ``segment_ids_B`` and ``key_blocks`` as
    ``PagedLayerCache``'s)."""
    return tuple(PagedLayerCache(latent, keys, table_BN, num_cached_B[None], page_size,
                                 segment_ids_B, key_blocks, context=context).layer_view(0)
                 for latent, keys in mtp_pools)

  @staticmethod
  def mtp_pools_of(mtp_caches) -> tuple:
    """The pools behind ``mtp_paged_caches``' caches (after a step)."""
    return tuple(c.buffers.pools for c in mtp_caches)

  def plan_layers(self, plan: StepPlan) -> list[PrefillRoute]:
    """What each layer does under ``plan``: the route, model-wide."""
    return [plan.route] * self.config.num_layers

  def dense_fresh_bound(self, max_step_tokens: int, max_model_len: int,
                        page_size: int) -> int | None:
    """The tokens a fresh sequence may hold in an engine's flat step that takes the dense
    route (within the top-k, so dense attention is exact), or None when this model's flat
    plans take none."""
    indexer = self.config.mla.indexer
    bound = min(max_step_tokens, indexer.topk if indexer else max_model_len)
    rows = -(-bound // page_size) * page_size
    route = self.flat_step_plan(bound, kv_rows=rows, key_chunk=self.key_chunk).route
    return bound if route is PrefillRoute.DENSE_MHA else None

  def step_plan(self, num_new_tokens: int, num_cached_tokens: int | None, *, capacity: int,
                kv_rows: int | None = None, force_mqa: bool = False,
                indexer_loss: str | None = None) -> StepPlan:
    """The plan of one step of ``num_new_tokens`` per sequence after at most
    ``num_cached_tokens`` cached (None: unknown until run time, as in decode) in caches of
    ``capacity`` rows; see ``mla_jax.step_plan.plan_step``."""
    return plan_step(self._attention_modules(), self.backend, num_new_tokens=num_new_tokens,
                     num_cached_tokens=num_cached_tokens, capacity=capacity, kv_rows=kv_rows,
                     force_mqa=force_mqa, indexer_loss=indexer_loss,
                     shares_topk=self.config.indexer_types is not None)

  def flat_step_plan(self, fresh_tokens: int | None, *, kv_rows: int,
                     key_chunk: int | None = None, context_topk: str = "exact") -> StepPlan:
    """The plan of an engine's flat step over this model's layers (one token per row, rows
    of a sequence sharing its segment): see ``mla_jax.step_plan.plan_flat_step``."""
    return plan_flat_step(self._attention_modules(), self.backend, fresh_tokens=fresh_tokens,
                          kv_rows=kv_rows, key_chunk=key_chunk,
                          shares_topk=self.config.indexer_types is not None,
                          context_topk=context_topk)

  def prefill_routes(self, num_new_tokens: int, num_cached_tokens: int | None = 0, *,
                     force_mqa: bool = False) -> list[PrefillRoute]:
    """The route of every layer for a call with these static counts.

    The dense/skip decision is model-wide: unless every layer can take the dense route, all
    take MQA, so a shared-indexer layer never follows a full layer that skipped scoring.
    """
    route = step_route(self._attention_modules(), self.backend, num_new_tokens=num_new_tokens,
                       num_cached_tokens=num_cached_tokens, force_mqa=force_mqa)
    return [route] * self.config.num_layers

  def _check_ids(self, ids_BT, caches):
    if getattr(ids_BT, "ndim", None) != 2:
      raise ValueError(f"token ids must be an int array [batch, tokens], got "
                       f"{type(ids_BT).__name__} of shape {getattr(ids_BT, 'shape', None)}")
    if not jnp.issubdtype(ids_BT.dtype, jnp.integer):
      raise TypeError(f"token ids must be an int array, got dtype {ids_BT.dtype}")
    if ids_BT.shape[0] == 0:
      raise ValueError("token ids hold no sequence: the batch is empty (batch size 0)")
    if not isinstance(caches, ModelCache) or caches.layout != self.layer_groups:
      raise ValueError("caches must be the ModelCache of this model's init_cache (layer groups "
                       f"{self.layer_groups}), got {type(caches).__name__}")
    for g, (group, unit) in enumerate(zip(caches.layout, caches.groups)):
      for u, cache in enumerate(unit):  # a scan over fewer reps would stop short or fail
        reps = tuple(getattr(cache.num_cached_B, "shape", ()))[:1]
        if reps != (group.reps,):
          raise ValueError(f"caches: group {g} (layers {group.first}..{group.end - 1}), unit "
                           f"position {u} stacks {list(reps)} repetitions, but the group has "
                           f"{group.reps}")
    checks.ids_in_vocab(ids_BT, self.config.vocab_size)

  def __call__(self, ids_BT, caches: ModelCache, *, new_lens_B=None, plan: StepPlan | None = None,
               num_cached_tokens=None, force_mqa: bool = False, kv_rows: int | None = None,
               return_hidden: bool = False):
    """Float32 logits [B, T, vocab] and the updated caches; with ``return_hidden`` also the
    final hidden states [B, T, D] in the model's dtype: the output of ``model.norm`` that
    ``lm_head`` reads and the MTP layers take (``mtp_forward``).

    ``plan``: this step's ``StepPlan`` (``step_plan``). Without one it is built from the
    static settings: ``num_cached_tokens`` bounds the cached lengths (None: read from concrete
    lengths, unknown under ``jit``), ``force_mqa`` never takes the dense route, and
    ``kv_rows`` bounds the cache rows every layer reads (by default the rows this step can
    reach rounded up to a bucket, ``cache.bucket_rows``, when the cached bound is known, else
    the whole capacity).
    """
    self._check_ids(ids_BT, caches)
    new_lens_B = self._new_lens(ids_BT, caches, new_lens_B)
    if plan is None:
      plan = self.step_plan(ids_BT.shape[1],
                            static_num_cached(num_cached_tokens, caches.num_cached_B),
                            capacity=caches.capacity, kv_rows=kv_rows, force_mqa=force_mqa)
    elif (num_cached_tokens, force_mqa, kv_rows) != (None, False, None):
      raise ValueError("pass either a plan or the static settings it is built from "
                       "(num_cached_tokens, force_mqa, kv_rows), not both")
    hidden_BTD, caches, _ = self._forward(ids_BT, caches, plan, new_lens_B)
    logits_BTV = self.logits(hidden_BTD)
    return (logits_BTV, caches, hidden_BTD) if return_hidden else (logits_BTV, caches)

  def mtp_forward(self, index: int, hidden_BTD, next_ids_BT, mtp_caches, *, new_lens_B=None,
                  plan: StepPlan | None = None, logits: bool = True):
    """MTP layer ``index`` on T pairs: ``(logits_BTV, mtp_hidden_BTD, mtp_caches)``.

    Args:
      index: which MTP layer (a static int in ``[0, config.num_mtp_layers)``).
      hidden_BTD: at row t, the hidden state of position p = ``num_cached_B[b] + t`` of the
        layer's cache: the main model's (``lm(..., return_hidden=True)``) or, for a further
        draft step, a previous ``mtp_forward``'s ``mtp_hidden_BTD``.
      next_ids_BT: at row t, the token at position p + 1 (int ids).
      mtp_caches: ``init_mtp_cache``'s tuple; only layer ``index``'s entry is read and
        written: its T new rows go after its ``num_cached_B``, which grow by ``new_lens_B``.
      new_lens_B: valid pairs per sequence (right padding beyond); default all T.
      plan: the step's ``StepPlan`` from ``step_plan`` (it covers the MTP layers: an
        MQA-only model's plan never routes them dense). None: built from the cache's
        concrete lengths, as ``__call__`` does.
      logits: False skips the vocabulary projection (the logits come back None): for callers
        that need a few rows' only (``mtp_logits``).

    Returns:
      float32 logits [B, T, vocab] for the token at p + 2, the layer's output hidden states
      [B, T, D] before ``shared_head.norm`` (what the next draft step feeds back), and
      ``mtp_caches`` with layer ``index``'s cache updated.
    """
    check_mtp_inputs(self.config, index, hidden_BTD, next_ids_BT, mtp_caches)
    cache = mtp_caches[index]
    checks.ids_in_vocab(next_ids_BT, self.config.vocab_size)
    new_lens_B = self._new_lens(next_ids_BT, cache, new_lens_B)  # a LayerCache reads the same
    if plan is None:
      plan = self.step_plan(next_ids_BT.shape[1], static_num_cached(None, cache.num_cached_B),
                            capacity=cache.capacity)
    elif plan.bounds_num_cached:
      checks.within_cached_bound(cache.num_cached_B, plan.num_cached_tokens)
    logits_BTV, h_BTD, attn = self._mtp_step(index, hidden_BTD, next_ids_BT, cache, plan,
                                             new_lens_B, logits)
    return logits_BTV, h_BTD, mtp_caches[:index] + (attn.cache,) + mtp_caches[index + 1:]

  def mtp_logits(self, index: int, mtp_hidden_XD):
    """Float32 logits of MTP layer ``index``'s output hidden states (any leading axes)."""
    return self.logits(self.mtp[index].shared_head.norm(mtp_hidden_XD))

  def _mtp_step(self, index, hidden_BTD, next_ids_BT, cache, plan: StepPlan, new_lens_B,
                logits: bool = True):
    """MTP layer ``index`` on checked inputs: ``(logits_BTV or None, h_BTD,
    AttentionOutput)``."""
    layer = self.mtp[index]
    embed_BTD = sharding.constrain(self.model.embed_tokens(next_ids_BT), self.mesh)
    h_BTD, attn = layer(embed_BTD, hidden_BTD, cache, plan,
                        new_lens_B=new_lens_B.astype(jnp.int32))
    return self.mtp_logits(index, h_BTD) if logits else None, h_BTD, attn

  def forward_train(self, ids_BT, lens_B, *, indexer_loss: str | None = None):
    """A training forward from an empty cache: ``(logits [B, T, vocab], indexer loss)``.

    Routes as a prefill of ``T`` tokens does. ``indexer_loss`` (``None | "dense" |
    "sparse"``, see ``MLAAttentionBase.__call__``) sums the per-layer losses of the layers
    with an indexer of their own; the sum is 0 when it is None or no layer has one.
    """
    if getattr(ids_BT, "ndim", None) != 2:
      raise ValueError(f"token ids must be an int array [batch, tokens], got "
                       f"{getattr(ids_BT, 'shape', type(ids_BT))}")
    batch, width = ids_BT.shape
    limit = self.config.mla.max_position_embeddings
    if width > limit:
      raise ValueError(f"sequences of {width} tokens exceed max_position_embeddings {limit}")
    caches = self.init_cache(batch, width)
    self._check_ids(ids_BT, caches)
    plan = self.step_plan(width, 0, capacity=width, kv_rows=width, indexer_loss=indexer_loss)
    hidden_BTD, _, loss = self._forward(ids_BT, caches, plan,
                                        self._new_lens(ids_BT, caches, lens_B))
    return self.logits(hidden_BTD), loss

  def mtp_forward_train(self, ids_BT, lens_B, *, indexer_loss: str | None = None):
    """MTP layer 0's training forward from empty caches: ``(logits [B, T - 1, vocab],
    indexer loss)``; row p predicts token p + 2 from the main model's hidden state at p
    (``stop_gradient``: the main model is a frozen input) and the true token at p + 1.

    The main model routes as a prefill of ``T`` tokens, the MTP layer as one of its ``T - 1``
    pairs (the inference routes). ``indexer_loss`` is the MTP layer's own (0 when None).
    """
    if not self.mtp:
      raise ValueError("mtp_forward_train needs a model with MTP layers (num_mtp_layers >= 1)")
    if getattr(ids_BT, "ndim", None) != 2 or ids_BT.shape[1] < 2:
      raise ValueError(f"token ids must be an int array [batch, tokens >= 2], got "
                       f"{getattr(ids_BT, 'shape', type(ids_BT))}")
    batch, width = ids_BT.shape
    caches = self.init_cache(batch, width)
    self._check_ids(ids_BT, caches)
    lens_B = self._new_lens(ids_BT, caches, lens_B)
    plan = self.step_plan(width, 0, capacity=width, kv_rows=width)
    hidden_BTD, _, _ = self._forward(ids_BT, caches, plan, lens_B)
    pairs = width - 1
    mtp_plan = self.step_plan(pairs, 0, capacity=pairs, kv_rows=pairs, indexer_loss=indexer_loss)
    logits_BTV, _, attn = self._mtp_step(
        0, jax.lax.stop_gradient(hidden_BTD[:, :-1]), ids_BT[:, 1:],
        self.init_mtp_cache(batch, pairs)[0], mtp_plan, jnp.maximum(lens_B - 1, 0))
    loss = jnp.zeros((), jnp.float32) if attn.indexer_loss is None else attn.indexer_loss
    return logits_BTV, loss

  def _new_lens(self, ids_BT, caches, new_lens_B):
    """``new_lens_B`` (default: every token) as an int [B] array, checked eagerly here too:
    inside the layer scans the lengths are traced, so an eager call would otherwise check
    them only when run checked."""
    b, t = ids_BT.shape
    new_lens_B = jnp.full((b,), t, jnp.int32) if new_lens_B is None else jnp.asarray(new_lens_B)
    checks.new_tokens(new_lens_B, caches.num_cached_B, num_tokens=t, capacity=caches.capacity,
                      max_positions=self.config.mla.max_position_embeddings)
    return new_lens_B

  def forward_hidden(self, ids_BT, caches: ModelCache, *, new_lens_B, plan: StepPlan):
    """The final (normed) hidden states [B, T, D] and the updated caches, without the vocabulary
    projection: for callers that need the logits of a few rows only (``logits``), as an
    engine step does. ``plan`` is required (``step_plan`` or ``plan_flat_step``)."""
    self._check_ids(ids_BT, caches)
    new_lens_B = self._new_lens(ids_BT, caches, new_lens_B)
    hidden_BTD, caches, _ = self._forward(ids_BT, caches, plan, new_lens_B)
    return hidden_BTD, caches

  def logits(self, hidden_XD):
    """Float32 logits of final hidden states (any leading axes)."""
    return self.lm_head(hidden_XD).astype(jnp.float32)

  def _forward(self, ids_BT, caches, plan: StepPlan, new_lens_B):
    """The layer scans: the final (normed) hidden states, the new caches and the summed
    indexer losses."""
    b, t = ids_BT.shape
    if plan.bounds_num_cached:
      checks.within_cached_bound(caches.num_cached_B, plan.num_cached_tokens)
    # Shared-indexer layers read the top-k of the last full layer, carried through the scans.
    topk_BTK = None
    if plan.carry_topk:  # a union top-k over context ranks holds each rank's own top-k
      ranks = sharding.axis_size(self.mesh, sharding.CONTEXT) if plan.context_topk == "union" else 1
      topk_BTK = jnp.full((b, t, self.config.mla.indexer.topk * ranks), -1, jnp.int32)
    h_BTD = sharding.constrain(self.model.embed_tokens(ids_BT), self.mesh)
    new_groups, loss = [], jnp.zeros((), jnp.float32)
    for stack, group_caches in zip(self.model.groups, caches.groups):
      h_BTD, topk_BTK, group_caches, group_loss = stack(h_BTD, topk_BTK, group_caches, plan,
                                                        new_lens_B=new_lens_B)
      new_groups.append(group_caches)
      loss = loss + group_loss
    return self.model.norm(h_BTD), ModelCache(tuple(new_groups), caches.layout), loss


def check_mesh(config: ModelConfig, mesh) -> None:
  """Refuses, before anything is allocated, a mesh the model cannot be split over."""
  tensor, expert, context = (sharding.axis_size(mesh, a)
                             for a in (sharding.TENSOR, sharding.EXPERT, sharding.CONTEXT))
  mla = config.mla
  if mla.num_heads % (tensor * context):  # the context ranks split the heads too
    raise ValueError(f"{mla.num_heads} attention heads cannot be split over the tensor x "
                     f"context ranks (mesh axes 'tensor' x 'context': {tensor} x {context} = "
                     f"{tensor * context})")
  if config.moe is not None and config.moe.num_experts % expert:
    raise ValueError(f"{config.moe.num_experts} routed experts cannot be split over mesh axis "
                     f"'expert' of size {expert}")


def state_shardings(state: nnx.State, mesh):
  """A ``NamedSharding`` for every leaf of ``state`` (parameters by the partition rules)."""
  from mla_jax.models.hf_layout import param_layouts

  layouts = param_layouts(state)

  def spec(path, leaf):
    layout = layouts.get(path)
    if layout is None:
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = sharding.param_spec(layout.rule_name, layout.leading, len(leaf.shape))
    sharding.check_divisible(layout.rule_name, leaf.shape, spec, mesh)
    return jax.sharding.NamedSharding(mesh, spec)

  flat = [(path, spec(path, leaf)) for path, leaf in state.flat_state()]
  return nnx.State.from_flat_path(flat)


def cache_shardings(cache: ModelCache, mesh) -> ModelCache:
  """A ``NamedSharding`` per cache leaf: batch over ``data``, replicated elsewhere.

  Every leaf of a layer's cache (fp8 scales included) has the batch axis right after the
  stacked-layer axes, which ``num_cached_B`` [reps, B] counts.
  """

  return ModelCache(tuple(tuple(layer_cache_shardings(c, mesh) for c in unit)
                         for unit in cache.groups), cache.layout)


def layer_cache_shardings(c: LayerCache, mesh) -> LayerCache:
  """One layer's (or one stacked group position's) cache shardings; see ``cache_shardings``."""
  batch_axis = c.num_cached_B.ndim - 1
  return jax.tree.map(lambda a: jax.sharding.NamedSharding(
      mesh, sharding.cache_spec(batch_axis, a.ndim)), c)


def build_sharded(build, key, mesh, shardings_of=None):
  """``build(key)`` compiled with every parameter's output sharding: each device makes only
  its own shards (random init included), so no full copy exists anywhere.

  ``shardings_of(abstract module, mesh)`` gives the shardings of its state (default: this
  model's rules, ``state_shardings``)."""
  abstract = nnx.eval_shape(build, key)
  graphdef = nnx.graphdef(abstract)
  shardings = (shardings_of or (lambda m, mesh: state_shardings(nnx.state(m), mesh)))(
      abstract, mesh)
  state = jax.jit(lambda k: nnx.split(build(k))[1], out_shardings=shardings)(key)
  return nnx.merge(graphdef, state)
