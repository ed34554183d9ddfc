"""``V4CausalLM``: the DeepSeek-V4 decoder, one step of T new tokens at a time.

``logits, caches = lm(ids_BT, caches, start_B)`` runs tokens at positions ``start_B + t``
against caches from ``lm.init_cache``; a prefill is a step from 0, decode a step of one.
The same step serves both, so the cached decode is the full forward, token by token.

The residual is ``hc_mult`` streams (``hyper``): each block reads a collapse of them and
writes back through its ``post`` / ``comb`` weights; the head collapses them once more.
Parameter names follow Hugging Face's ``DeepseekV4ForCausalLM`` (``mla_jax.v4.checkpoint``
maps the checkpoint's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import checks, sharding
from mla_jax.backends import Backend, get_backend
from mla_jax.layers import Linear, RMSNorm
from mla_jax.models.lm import Embed, build_sharded
from mla_jax.v4.attention import ATTENTION_CLASSES, CompressedSelection, compressed_selection
from mla_jax.v4.config import HASH_MOE, V4Config
from mla_jax.v4.hyper import HyperConnection, HyperHead, merge_block_output
from mla_jax.v4.moe import V4MoE
from mla_jax.v4.mtp import MTP_LAYER_TYPE, V4MTPLayer
from mla_jax.v4.sharding import cache_shardings, check_mesh, constrain_streams, state_shardings


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

  def __call__(self, streams_BTND, ids_BT, cache: dict, start_B):
    post, comb, collapsed = self.attn_hc(streams_BTND)
    attn_BTD, cache = self.self_attn(self.input_layernorm(collapsed), cache, start_B)
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

  def init_cache(self, batch: int, capacity: int, dtype=None, spare: int = 0) -> list[dict]:
    """Per-layer caches for ``batch`` sequences of up to ``capacity`` tokens.

    Per token a layer keeps its window's ring (``sliding_window`` rows, whatever the length),
    and its compressed entries, one per ``m`` tokens (with the indexer's keys for CSA); the
    compressors keep the projections of the last ``m`` or ``2m`` tokens. Every ring holds
    ``spare`` more slots: a step may then write up to ``spare`` positions past where the next
    step starts, and those writes are never read (speculative decoding's rejected drafts).
    """
    return self._caches([layer.self_attn for layer in self.model.layers], batch, capacity,
                        dtype, spare)

  def init_mtp_cache(self, batch: int, capacity: int, dtype=None, spare: int = 0) -> list[dict]:
    """The MTP layers' caches (their window rings), as ``init_cache``'s."""
    return self._caches([layer.block.self_attn for layer in self.mtp], batch, capacity, dtype,
                        spare)

  def _caches(self, attentions, batch: int, capacity: int, dtype, spare: int) -> list[dict]:
    checks.static_int(batch, "batch", minimum=1)
    checks.static_int(capacity, "capacity", minimum=1,
                      maximum=self.config.max_position_embeddings)
    checks.static_int(spare, "spare", minimum=0)
    dtype = self.dtype if dtype is None else checks.float_dtype(dtype, "dtype")
    build = lambda: [attn.init_cache(batch, capacity, dtype, spare) for attn in attentions]
    if self.mesh is None:
      return build()
    data = sharding.axis_size(self.mesh, sharding.DATA)
    if batch % data:
      raise ValueError(f"batch {batch} cannot be split over mesh axis 'data' of size {data}")
    return jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), self.mesh))()

  def positions_held(self, caches: list[dict]) -> int:
    """Positions the caches can take: each compressed layer's entries must hold every entry a
    position sees, ``(pos + 1) // m`` of them (the window is a ring: any length)."""
    held = self.config.max_position_embeddings
    for layer, cache in zip(self.model.layers, caches):
      if "entries" in cache:
        held = min(held, (cache["entries"].shape[1] + 1) * layer.self_attn.ratio - 1)
    return held

  def selections(self, caches: list[dict]) -> list[CompressedSelection]:
    """What each layer selects among the compressed entries these caches hold."""
    return [compressed_selection(layer.self_attn, cache["entries"].shape[1] if "entries" in
                                 cache else 0)
            for layer, cache in zip(self.model.layers, caches)]

  def __call__(self, ids_BT, caches: list[dict], start_B, *, return_hidden: bool = False):
    """Logits [B, T, V] (float32) of T new tokens at ``start_B + t``, and the caches after
    (and with ``return_hidden`` the residual streams [B, T, N, D] before ``hc_head``, what the
    MTP layers read).

    Every position must stay below ``positions_held(caches)`` (at least the capacity given to
    ``init_cache``): past it a compressed entry would be dropped. An eager call refuses it
    with a ``CheckError``; under ``jit`` the caller checks (``mla_jax.v4.generate`` does).
    """
    config = self.config
    start_B = jnp.asarray(start_B, jnp.int32)
    if len(caches) != config.num_layers:
      raise ValueError(f"caches must hold one cache per layer ({config.num_layers}), got "
                       f"{len(caches)}")
    num_new = ids_BT.shape[1]
    checks.new_tokens(jnp.full(start_B.shape, num_new, jnp.int32), start_B, num_tokens=num_new,
                      capacity=self.positions_held(caches),
                      max_positions=config.max_position_embeddings)
    x_BTD = self.model.embed_tokens(ids_BT)
    streams_BTND = jnp.broadcast_to(x_BTD[:, :, None, :], (*x_BTD.shape[:2], config.hc_mult,
                                                          x_BTD.shape[-1]))
    new_caches = []
    for layer, cache in zip(self.model.layers, caches):
      streams_BTND, cache = layer(streams_BTND, ids_BT, cache, start_B)
      new_caches.append(cache)
    new_caches = self._keep_placed(new_caches)
    logits = self._head(self.model.norm(self.model.hc_head(streams_BTND)))
    return (logits, new_caches, streams_BTND) if return_hidden else (logits, new_caches)

  def _keep_placed(self, caches):
    """On a mesh, caches keep their placement (batch over data) from step to step."""
    if self.mesh is None:
      return caches
    return jax.lax.with_sharding_constraint(caches, cache_shardings(caches, self.mesh))

  def _head(self, hidden_XD):
    """float32 logits [..., V] of hidden states [..., D] (the tied embedding or ``lm_head``)."""
    head = (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight[...]
    return jnp.einsum("...d,vd->...v", hidden_XD, head.astype(hidden_XD.dtype),
                      preferred_element_type=jnp.float32)

  def mtp_forward(self, index: int, streams_BTND, next_ids_BT, mtp_caches: list[dict], start_B,
                  *, logits: bool = True):
    """MTP layer ``index`` on T rows from ``start_B`` (``mla_jax.v4.mtp``): ``(logits [B, T, V]
    or None, its output streams [B, T, N, D], the MTP caches after)``."""
    layer = self.mtp[index]
    start_B = jnp.asarray(start_B, jnp.int32)
    out_BTND, cache = layer(streams_BTND, next_ids_BT, self.model.embed_tokens(next_ids_BT),
                            mtp_caches[index], start_B)
    mtp_caches = [*mtp_caches[:index], self._keep_placed(cache), *mtp_caches[index + 1:]]
    return (self.mtp_logits(index, out_BTND) if logits else None), out_BTND, mtp_caches

  def mtp_logits(self, index: int, streams_XND):
    """float32 logits of MTP layer ``index``'s output streams (its ``hc_head``, ``norm``, then
    the main LM head)."""
    return self._head(self.mtp[index].hidden(streams_XND))
