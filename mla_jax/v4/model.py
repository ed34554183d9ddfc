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
    self.model = V4Model(config, rngs=rngs, **layer_kwargs)
    self.lm_head = (None if config.tie_word_embeddings else
                    Linear(config.hidden_size, config.vocab_size, rngs=rngs,
                           param_dtype=layer_kwargs["param_dtype"]))


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
    self.model, self.lm_head = parts.model, parts.lm_head

  @property
  def dtype(self):
    return self.model.embed_tokens.weight.dtype

  def init_cache(self, batch: int, capacity: int, dtype=None) -> list[dict]:
    """Per-layer caches for ``batch`` sequences of up to ``capacity`` tokens.

    Per token a layer keeps its window's ring (``sliding_window`` rows, whatever the length),
    and its compressed entries, one per ``m`` tokens (with the indexer's keys for CSA); the
    compressors keep the projections of the last ``m`` or ``2m`` tokens.
    """
    checks.static_int(batch, "batch", minimum=1)
    checks.static_int(capacity, "capacity", minimum=1,
                      maximum=self.config.max_position_embeddings)
    dtype = self.dtype if dtype is None else checks.float_dtype(dtype, "dtype")
    build = lambda: [layer.self_attn.init_cache(batch, capacity, dtype)
                     for layer in self.model.layers]
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

  def __call__(self, ids_BT, caches: list[dict], start_B):
    """Logits [B, T, V] (float32) of T new tokens at ``start_B + t``, and the caches after.

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
    if self.mesh is not None:  # the caches keep their placement from step to step
      new_caches = jax.lax.with_sharding_constraint(
          new_caches, cache_shardings(new_caches, self.mesh))
    hidden_BTD = self.model.norm(self.model.hc_head(streams_BTND))
    head = (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight[...]
    logits = jnp.einsum("btd,vd->btv", hidden_BTD, head.astype(hidden_BTD.dtype),
                        preferred_element_type=jnp.float32)
    return logits, new_caches
