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

from mla_jax import checks
from mla_jax.backends import Backend, get_backend
from mla_jax.layers import Linear, RMSNorm
from mla_jax.models.lm import Embed
from mla_jax.v4.attention import ATTENTION_CLASSES, CompressedSelection, compressed_selection
from mla_jax.v4.config import V4Config
from mla_jax.v4.hyper import HyperConnection, HyperHead, merge_block_output
from mla_jax.v4.moe import V4MoE


class V4DecoderLayer(nnx.Module):
  def __init__(self, config: V4Config, layer: int, *, rngs: nnx.Rngs, backend: Backend,
               param_dtype, grouped_matmul: str):
    attention_class = ATTENTION_CLASSES[config.layer_types[layer]]
    self.self_attn = attention_class(config, rngs=rngs, backend=backend,
                                     param_dtype=param_dtype)
    self.mlp = V4MoE(config, layer, rngs=rngs, grouped_matmul=grouped_matmul,
                     param_dtype=param_dtype)
    eps = config.rms_norm_eps
    self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
    hc = dict(sinkhorn_iters=config.hc_sinkhorn_iters, hc_eps=config.hc_eps, norm_eps=eps,
              rngs=rngs)
    self.attn_hc = HyperConnection(config.hidden_size, config.hc_mult, **hc)
    self.ffn_hc = HyperConnection(config.hidden_size, config.hc_mult, **hc)

  def __call__(self, streams_BTND, ids_BT, cache: dict, start_B):
    post, comb, collapsed = self.attn_hc(streams_BTND)
    attn_BTD, cache = self.self_attn(self.input_layernorm(collapsed), cache, start_B)
    streams_BTND = merge_block_output(streams_BTND, attn_BTD, post, comb)
    post, comb, collapsed = self.ffn_hc(streams_BTND)
    mlp_BTD = self.mlp(self.post_attention_layernorm(collapsed), ids_BT)
    return merge_block_output(streams_BTND, mlp_BTD, post, comb), cache


class V4Model(nnx.Module):
  def __init__(self, config: V4Config, *, rngs: nnx.Rngs, backend: Backend, param_dtype,
               grouped_matmul: str):
    self.embed_tokens = Embed(config.vocab_size, config.hidden_size, rngs=rngs,
                              param_dtype=param_dtype)
    self.layers = nnx.List([
        V4DecoderLayer(config, i, rngs=rngs, backend=backend, param_dtype=param_dtype,
                       grouped_matmul=grouped_matmul) for i in range(config.num_layers)])
    self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.hc_head = HyperHead(config.hidden_size, config.hc_mult, hc_eps=config.hc_eps,
                             norm_eps=config.rms_norm_eps, rngs=rngs)


class V4CausalLM(nnx.Module):
  """DeepSeek-V4 with the attention kernels of ``backend`` (``"auto" | "xla" | "pallas" |
  "mosaic-gpu"``)."""

  def __init__(self, config: V4Config, *, rngs: nnx.Rngs, backend: str | Backend = "auto",
               param_dtype=jnp.float32, grouped_matmul: str = "auto"):
    if not isinstance(config, V4Config):
      raise TypeError(f"config must be a V4Config, got {type(config).__name__}")
    checks.float_dtype(param_dtype, "param_dtype")
    backend = get_backend(backend)
    self.config, self.backend = config, backend
    self.model = V4Model(config, rngs=rngs, backend=backend, param_dtype=param_dtype,
                         grouped_matmul=grouped_matmul)
    self.lm_head = (None if config.tie_word_embeddings else
                    Linear(config.hidden_size, config.vocab_size, rngs=rngs,
                           param_dtype=param_dtype))

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
    return [layer.self_attn.init_cache(batch, capacity, dtype) for layer in self.model.layers]

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
    hidden_BTD = self.model.norm(self.model.hc_head(streams_BTND))
    head = (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight[...]
    logits = jnp.einsum("btd,vd->btv", hidden_BTD, head.astype(hidden_BTD.dtype),
                        preferred_element_type=jnp.float32)
    return logits, new_caches
