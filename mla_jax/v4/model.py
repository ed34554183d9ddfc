"""``V4CausalLM``: the DeepSeek-V4 decoder, a decode model (``mla_jax.decoding.protocol``).

``logits, caches = lm(ids_BT, caches, new_lens_B=...)`` runs each sequence's tokens after its
cached ones (``caches.num_cached_B``) in caches from ``lm.init_cache``; a prefill is a step
from 0, decode a step of one. The same step serves both, and an engine's flat steps over its
pools (``init_pools``, ``paged_cache``): the cached decode is the full forward, token by
token, in every form.

The residual is ``hc_mult`` streams (``hyper``): each block reads a collapse of them and
writes back through its ``post`` / ``comb`` weights; the head collapses them once more.
Parameter names follow Hugging Face's ``DeepseekV4ForCausalLM`` (``mla_jax.v4.checkpoint``
maps the checkpoint's).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import checks, sharding
from mla_jax.backends import Backend, get_backend
from mla_jax.cache import resolve_cache_dtype
from mla_jax.decoding.protocol import FlatRows
from mla_jax.layers import Linear, RMSNorm
from mla_jax.models.lm import Embed, build_sharded
from mla_jax.v4 import cache as v4_cache
from mla_jax.v4.attention import ATTENTION_CLASSES, CompressedSelection
from mla_jax.v4.cache import StepGeometry, V4Cache, V4LayerCache
from mla_jax.v4.config import HASH_MOE, V4Config
from mla_jax.v4.hyper import HyperConnection, HyperHead, merge_block_output
from mla_jax.v4.moe import V4MoE
from mla_jax.v4.mtp import MTP_LAYER_TYPE, V4MTPLayer
from mla_jax.v4.sharding import cache_shardings, check_mesh, constrain_streams, state_shardings
from mla_jax.v4.step_plan import V4StepPlan, layer_scope, plan_v4_step


class V4DecoderLayer(nnx.Module):
  """One block: ``layer_type``'s attention and a hash-routed (``hashed``) or learned MoE, each
  read from and written back to the mHC streams."""

  def __init__(self, config: V4Config, layer_type: str, *, hashed: bool, rngs: nnx.Rngs,
               backend: Backend, param_dtype, grouped_matmul: str, mesh=None):
    self.self_attn = ATTENTION_CLASSES[layer_type](config, rngs=rngs, backend=backend,
                                                   param_dtype=param_dtype, mesh=mesh)
    self.mlp = V4MoE(config, hashed=hashed, rngs=rngs, grouped_matmul=grouped_matmul,
                     param_dtype=param_dtype, mesh=mesh)
    eps = config.rms_norm_eps
    self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
    hc = dict(sinkhorn_iters=config.hc_sinkhorn_iters, hc_eps=config.hc_eps, norm_eps=eps,
              rngs=rngs)
    self.attn_hc = HyperConnection(config.hidden_size, config.hc_mult, **hc)
    self.ffn_hc = HyperConnection(config.hidden_size, config.hc_mult, **hc)
    self.mesh = mesh

  def __call__(self, streams_BTND, ids_BT, cache: V4LayerCache, geo: StepGeometry,
               selection: CompressedSelection, kv_rows: int):
    post, comb, collapsed = self.attn_hc(streams_BTND)
    attn_BTD, cache = self.self_attn(self.input_layernorm(collapsed), cache, geo, selection,
                                     kv_rows)
    streams_BTND = constrain_streams(merge_block_output(streams_BTND, attn_BTD, post, comb),
                                     self.mesh)
    post, comb, collapsed = self.ffn_hc(streams_BTND)
    mlp_BTD = self.mlp(self.post_attention_layernorm(collapsed), ids_BT)
    return constrain_streams(merge_block_output(streams_BTND, mlp_BTD, post, comb),
                             self.mesh), cache


class V4Model(nnx.Module):
  def __init__(self, config: V4Config, *, rngs: nnx.Rngs, **layer_kwargs):
    self.embed_tokens = Embed(config.vocab_size, config.hidden_size, rngs=rngs,
                              param_dtype=layer_kwargs["param_dtype"])
    self.layers = nnx.List([
        V4DecoderLayer(config, layer_type, hashed=mlp_type == HASH_MOE, rngs=rngs,
                       **layer_kwargs)
        for layer_type, mlp_type in zip(config.layer_types, config.mlp_layer_types)])
    self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.hc_head = HyperHead(config.hidden_size, config.hc_mult, hc_eps=config.hc_eps,
                             norm_eps=config.rms_norm_eps, rngs=rngs)


class _Parts(nnx.Module):
  """What ``V4CausalLM`` holds, built in one call (sharded, it is built under ``jit``)."""

  def __init__(self, config: V4Config, rngs: nnx.Rngs, **layer_kwargs):
    param_dtype = layer_kwargs["param_dtype"]
    self.model = V4Model(config, rngs=rngs, **layer_kwargs)
    self.lm_head = (None if config.tie_word_embeddings else
                    Linear(config.hidden_size, config.vocab_size, rngs=rngs,
                           param_dtype=param_dtype))
    self.mtp = nnx.List([
        V4MTPLayer(config, V4DecoderLayer(config, MTP_LAYER_TYPE, hashed=False, rngs=rngs,
                                          **layer_kwargs), rngs=rngs, param_dtype=param_dtype)
        for _ in range(config.num_mtp_layers)])


class V4CausalLM(nnx.Module):
  """DeepSeek-V4 with the attention kernels of ``backend`` (``"auto" | "xla" | "pallas" |
  "mosaic-gpu"``).

  With ``mesh`` the model is built already sharded by ``mla_jax.v4.sharding``'s rules (each
  device makes only its own shards), computes sharded, and its caches are placed on the mesh;
  the same ``rngs`` give the same weights with and without a mesh.
  """

  def __init__(self, config: V4Config, *, rngs: nnx.Rngs, backend: str | Backend = "auto",
               param_dtype=jnp.float32, grouped_matmul: str = "auto", mesh=None):
    if not isinstance(config, V4Config):
      raise TypeError(f"config must be a V4Config, got {type(config).__name__}")
    checks.float_dtype(param_dtype, "param_dtype")
    if mesh is not None:
      check_mesh(config, mesh)
    backend = get_backend(backend)
    self.config, self.backend, self.mesh = config, backend, mesh
    build = lambda rngs: _Parts(config, rngs, backend=backend, param_dtype=param_dtype,
                                grouped_matmul=grouped_matmul, mesh=mesh)
    if mesh is None:
      parts = build(rngs)
    else:  # the same random streams, run under jit with the rules' output shardings
      rngs_def, rngs_state = nnx.split(rngs)
      parts = build_sharded(lambda state: build(nnx.merge(rngs_def, state)), rngs_state, mesh,
                            state_shardings)
    self.model, self.lm_head, self.mtp = parts.model, parts.lm_head, parts.mtp

  @property
  def dtype(self):
    return self.model.embed_tokens.weight.dtype

  # ---- the decode protocol (mla_jax.decoding.protocol) ------------------------------------

  # Window rings and compressor state per sequence, beside the pages (mla_jax.v4.cache).
  sequence_state: ClassVar[bool] = True
  key_chunk: ClassVar[None] = None  # the indexer scores every entry a row's table reaches

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def max_positions(self) -> int:
    return self.config.max_position_embeddings

  @property
  def num_mtp_layers(self) -> int:
    return self.config.num_mtp_layers

  @property
  def attentions(self) -> tuple:
    """The main layers' attention modules (their classes carry the capabilities)."""
    return tuple(layer.self_attn for layer in self.model.layers)

  @property
  def ratios(self) -> tuple[int, ...]:
    """The compression ratios of the compressed layers."""
    return tuple(a.ratio for a in self.attentions if a.compressed)

  def check_page_size(self, page_size: int) -> None:
    """A page holds whole compressed entries: every ratio divides the page size or is a
    multiple of it (``mla_jax.v4.cache``)."""
    v4_cache.check_page_size(page_size, self.ratios)

  def _page(self, capacity: int) -> int:
    """A contiguous cache's page: ``capacity`` rounded up to a multiple of every ratio."""
    multiple = v4_cache.page_multiple(self.ratios)
    return -(-capacity // multiple) * multiple

  def init_cache(self, batch: int, capacity: int, dtype=None, spare: int = 0) -> V4Cache:
    """Contiguous caches for ``batch`` sequences of up to ``capacity`` tokens (rounded up to
    a multiple of every compression ratio): each sequence one page of entries and one slot
    of state, every ring ``spare`` rows longer for steps that run ahead of where the next
    one starts (speculative decoding's rejected drafts); ``dtype`` defaults to the model's."""
    return self._contiguous(self.attentions, batch, capacity, dtype, spare)

  def init_mtp_cache(self, batch: int, capacity: int, dtype=None,
                     spare: int = 0) -> tuple[V4Cache, ...]:
    """The MTP layers' caches (their window rings), as ``init_cache``'s, one per layer."""
    return tuple(self._contiguous((layer.block.self_attn,), batch, capacity, dtype, spare)
                 for layer in self.mtp)

  def _contiguous(self, attentions, batch: int, capacity: int, dtype, spare: int) -> V4Cache:
    checks.static_int(batch, "batch", minimum=1)
    checks.static_int(capacity, "capacity", minimum=1,
                      maximum=self.config.max_position_embeddings)
    checks.static_int(spare, "spare", minimum=0)
    state_dtype, entry_dtype = self._cache_dtypes(dtype)
    page = self._page(capacity)
    seqs = jnp.arange(batch, dtype=jnp.int32)
    build = lambda: V4Cache(
        tuple(attn.init_cache(batch, batch, page, state_dtype, spare, entry_dtype=entry_dtype)
              for attn in attentions),
        jnp.zeros((batch,), jnp.int32), seqs[:, None], seqs, page)
    if self.mesh is None:
      return build()
    data = sharding.axis_size(self.mesh, sharding.DATA)
    if batch % data:
      raise ValueError(f"batch {batch} cannot be split over mesh axis 'data' of size {data}")
    return jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), self.mesh))()

  def _cache_dtypes(self, dtype):
    """``(state dtype, entry dtype)``: ``"fp8"`` stores the compressed entries and indexer
    keys in V3.2's fp8 layouts and keeps the rings (window, compressors' state) in the
    model's dtype; a float dtype is every array's."""
    if dtype is None:
      return self.dtype, self.dtype
    resolved = resolve_cache_dtype(dtype, "cache_dtype")
    if resolved != "fp8":
      return resolved, resolved
    if self.config.rope_dim == self.config.head_dim:
      raise ValueError(f"cache_dtype fp8: an entry has no latent part to quantize (rope_dim "
                       f"{self.config.rope_dim} == head_dim {self.config.head_dim})")
    return self.dtype, resolved

  def init_pools(self, num_rows: int, cache_dtype, *, page_size: int | None = None,
                 num_state_slots: int = 0, mtp: bool = False):
    """An engine's pools: ``num_rows / page_size`` pages of entries and ``num_state_slots``
    slots of state per layer (``mla_jax.v4.cache``) in ``cache_dtype`` (``_cache_dtypes``:
    with fp8, the entries and indexer keys), and no MTP pools (an engine does not draft with
    V4's MTP layers yet)."""
    if mtp:
      raise ValueError("max_speculative_tokens: an engine does not draft with DeepSeek-V4's "
                       "MTP layers yet (mla_jax.generate does, speculative_tokens=k)")
    checks.static_int(page_size, "page_size", minimum=1)
    self.check_page_size(page_size)
    if num_rows % page_size:
      raise ValueError(f"num_rows {num_rows} is no whole number of pages of {page_size}")
    dtype, entry_dtype = self._cache_dtypes(cache_dtype)
    return tuple(attn.init_cache(num_state_slots, num_rows // page_size, page_size, dtype,
                                 entry_dtype=entry_dtype)
                 for attn in self.attentions), ()

  def paged_cache(self, pools, rows: FlatRows) -> V4Cache:
    """The pools as one flat step's caches: row t one token of sequence ``rows.seq_T[t]``
    at ``rows.pos_T[t]``, each sequence's state in its slot (read from ``state_src_S``)."""
    return V4Cache(pools, rows.pos_T, rows.table_SN, rows.slot_S, rows.page_size,
                   rows.seq_T, rows.state_src_S, rows.snapshot_S, rows.snapshot_at_S)

  def step_plan(self, num_new_tokens: int, num_cached_tokens: int | None, *, capacity: int,
                kv_rows: int | None = None) -> V4StepPlan:
    """The plan of a step of ``num_new_tokens`` per sequence in contiguous caches of
    ``capacity`` positions (``init_cache`` rounds it up; so does the plan), reading entries
    of positions below ``kv_rows`` (default: all)."""
    return plan_v4_step(self.attentions, num_new_tokens=num_new_tokens,
                        num_cached_tokens=num_cached_tokens, capacity=self._page(capacity),
                        kv_rows=kv_rows)

  def flat_step_plan(self, fresh_tokens: int | None, *, kv_rows: int,
                     key_chunk: int | None = None, context_topk: str = "exact") -> V4StepPlan:
    """The plan of an engine's flat step whose block tables reach ``kv_rows`` positions
    (V4 has no dense route, so a step of fresh sequences is planned as any other)."""
    return plan_v4_step(self.attentions, num_new_tokens=1, num_cached_tokens=None,
                        capacity=kv_rows, segmented=True)

  def plan_layers(self, plan: V4StepPlan) -> list[CompressedSelection]:
    """What each layer selects under ``plan``."""
    return list(plan.selections)

  def dense_fresh_bound(self, max_step_tokens: int, max_model_len: int,
                        page_size: int) -> None:
    """V4 has no dense route."""
    return None

  def forward_hidden(self, ids_BT, caches: V4Cache, *, new_lens_B, plan: V4StepPlan):
    """The residual streams [B, T, N, D] of a step (before ``hc_head``: what ``logits`` and
    the MTP layers read) and the caches after it (``__call__``)."""
    if getattr(ids_BT, "ndim", None) != 2 or not jnp.issubdtype(ids_BT.dtype, jnp.integer):
      raise ValueError(f"token ids must be an int array [batch, tokens], got "
                       f"{getattr(ids_BT, 'shape', type(ids_BT).__name__)}")
    if not isinstance(caches, V4Cache) or len(caches.layers) != self.config.num_layers:
      raise ValueError(f"caches must be this model's V4Cache (one layer cache per layer, "
                       f"{self.config.num_layers}), got {type(caches).__name__}")
    checks.ids_in_vocab(ids_BT, self.config.vocab_size)
    b, t = ids_BT.shape
    new_lens_B = (jnp.full((b,), t, jnp.int32) if new_lens_B is None
                  else jnp.asarray(new_lens_B, jnp.int32))
    if caches.segment_ids_B is None:  # contiguous: refuse positions past the caches
      v4_cache.check_positions(caches, new_lens_B, t, self.config.max_position_embeddings)
    geo = caches.geometry(t, new_lens_B)
    config = self.config
    x_BTD = self.model.embed_tokens(ids_BT)
    streams_BTND = jnp.broadcast_to(x_BTD[:, :, None, :], (b, t, config.hc_mult,
                                                          x_BTD.shape[-1]))
    layers = []
    for i, (layer, cache, selection) in enumerate(zip(self.model.layers, caches.layers,
                                                      plan.selections)):
      with jax.named_scope(layer_scope(i)):
        streams_BTND, cache = layer(streams_BTND, ids_BT, cache, geo, selection, plan.kv_rows)
      layers.append(cache)
    caches = dataclasses.replace(caches, layers=tuple(layers))
    return streams_BTND, self._advanced(caches, new_lens_B)

  def _advanced(self, caches: V4Cache, new_lens_B) -> V4Cache:
    """The caches after a step: a contiguous one's sequences moved on by their new tokens,
    kept where the mesh places them."""
    if caches.segment_ids_B is not None:
      return caches
    caches = caches.with_num_cached(caches.num_cached_B + new_lens_B)
    if self.mesh is None:
      return caches
    return jax.lax.with_sharding_constraint(caches, cache_shardings(caches, self.mesh))

  def __call__(self, ids_BT, caches: V4Cache, *, new_lens_B=None, plan: V4StepPlan | None = None,
               return_hidden: bool = False):
    """Logits [B, T, V] (float32) of each sequence's next tokens after its cached ones, and
    the caches after (and with ``return_hidden`` the residual streams [B, T, N, D] before
    ``hc_head``, what the MTP layers read). ``new_lens_B``: real tokens per sequence (default
    all T; the rest padding, written nowhere); ``plan``: ``step_plan``'s (default: a step of
    T at the caches' capacity).

    Every position must stay below the caches' capacity: past it a compressed entry would be
    dropped. An eager call refuses it with a ``CheckError``; under ``jit`` the caller checks
    (``mla_jax.generate`` sizes the caches to fit).
    """
    if plan is None:
      plan = self.step_plan(ids_BT.shape[1], None, capacity=caches.capacity)
    streams_BTND, caches = self.forward_hidden(ids_BT, caches, new_lens_B=new_lens_B,
                                               plan=plan)
    logits = self.logits(streams_BTND)
    return (logits, caches, streams_BTND) if return_hidden else (logits, caches)

  def logits(self, streams_XND):
    """float32 logits [..., V] of residual streams [..., N, D]: ``hc_head``, ``norm``, then
    the tied embedding or ``lm_head``."""
    return self._head(self.model.norm(self.model.hc_head(streams_XND)))

  def _head(self, hidden_XD):
    """float32 logits [..., V] of hidden states [..., D] (the tied embedding or ``lm_head``)."""
    head = (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight[...]
    return jnp.einsum("...d,vd->...v", hidden_XD, head.astype(hidden_XD.dtype),
                      preferred_element_type=jnp.float32)

  def mtp_forward(self, index: int, streams_BTND, next_ids_BT, mtp_caches: tuple, *,
                  new_lens_B=None, plan=None, logits: bool = True):
    """MTP layer ``index`` (``mla_jax.v4.mtp``) on T rows after its cache's cached ones:
    ``(logits [B, T, V] or None, its output streams [B, T, N, D], the MTP caches after)``.
    ``plan`` (the main step's) is not needed: the MTP block is a sliding layer."""
    if not (isinstance(index, int) and 0 <= index < len(self.mtp)):
      raise ValueError(f"MTP layer index must be an int in [0, {len(self.mtp)}), got "
                       f"{index!r}")
    layer, cache = self.mtp[index], mtp_caches[index]
    b, t = next_ids_BT.shape
    new_lens_B = (jnp.full((b,), t, jnp.int32) if new_lens_B is None
                  else jnp.asarray(new_lens_B, jnp.int32))
    geo = cache.geometry(t, new_lens_B)
    with jax.named_scope(f"v4_mtp_{index}"):
      out_BTND, layer_cache = layer(streams_BTND, next_ids_BT,
                                    self.model.embed_tokens(next_ids_BT), cache.layers[0], geo)
    cache = self._advanced(dataclasses.replace(cache, layers=(layer_cache,)), new_lens_B)
    mtp_caches = (*mtp_caches[:index], cache, *mtp_caches[index + 1:])
    return (self.mtp_logits(index, out_BTND) if logits else None), out_BTND, mtp_caches

  def mtp_logits(self, index: int, streams_XND):
    """float32 logits of MTP layer ``index``'s output streams (its ``hc_head``, ``norm``, then
    the main LM head)."""
    return self._head(self.mtp[index].hidden(streams_XND))
