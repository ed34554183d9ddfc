"""A complete decoder-only causal LM in the DeepSeek-V3.2 / GLM-5 shape.

Parameter paths follow Hugging Face (``model.layers.{i}.self_attn.q_a_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, ``lm_head.weight``), so checkpoint
loading is a mapping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.attention import DeepseekV32Attention, MLAAttention
from mla_jax.backends import Backend, get_backend
from mla_jax.cache import LayerCache, init_layer_cache
from mla_jax.layers import Linear, RMSNorm
from mla_jax.models.config import ModelConfig
from mla_jax.models.mlp import MLP
from mla_jax.models.moe import MoE
from mla_jax.routing import PrefillRoute

ATTENTION_CLASSES = {"mqa-only": DeepseekV32Attention, "dense-capable": MLAAttention}

ModelCache = tuple[LayerCache, ...]


class Embed(nnx.Module):
  def __init__(self, vocab_size: int, hidden_size: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    init = jax.random.normal(rngs.params(), (vocab_size, hidden_size), jnp.float32)
    self.weight = nnx.Param(init.astype(param_dtype))

  def __call__(self, ids_BT):
    return self.weight[...][ids_BT]


class DecoderLayer(nnx.Module):
  def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs, backend: Backend,
               param_dtype):
    d = config.mla.hidden_size
    self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
    self.self_attn = ATTENTION_CLASSES[config.attention](
        config.mla, rngs=rngs, backend=backend, param_dtype=param_dtype,
        shares_topk=config.shares_topk(layer_idx))
    self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype)
    if config.uses_moe(layer_idx):
      self.mlp = MoE(d, config.moe, rngs=rngs, param_dtype=param_dtype)
    else:
      self.mlp = MLP(d, config.intermediate_size, rngs=rngs, param_dtype=param_dtype)

  def __call__(self, h_BTD, cache, *, new_lens_B, num_cached_tokens, force_mqa, shared_topk_BTK):
    attn = self.self_attn(self.input_layernorm(h_BTD), cache, new_lens_B=new_lens_B,
                          num_cached_tokens=num_cached_tokens, force_mqa=force_mqa,
                          shared_topk_BTK=shared_topk_BTK)
    h_BTD = h_BTD + attn.out_BTD
    h_BTD = h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))
    return h_BTD, attn.cache, attn.topk_BTK


class Model(nnx.Module):
  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, backend: Backend, param_dtype):
    self.embed_tokens = Embed(config.vocab_size, config.mla.hidden_size, rngs=rngs,
                              param_dtype=param_dtype)
    self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs, backend=backend,
                                         param_dtype=param_dtype)
                            for i in range(config.num_layers)])
    self.norm = RMSNorm(config.mla.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)


class CausalLM(nnx.Module):
  """``logits, caches = lm(ids_BT, caches)``; see ``MLAAttentionBase.__call__`` for routing."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, backend: str | Backend = "auto",
               param_dtype=jnp.float32):
    if not isinstance(config, ModelConfig):
      raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    self.config = config
    self.backend = get_backend(backend)
    self.model = Model(config, rngs=rngs, backend=self.backend, param_dtype=param_dtype)
    self.lm_head = Linear(config.mla.hidden_size, config.vocab_size, rngs=rngs,
                          param_dtype=param_dtype)

  def init_cache(self, batch_size: int, capacity: int, dtype=jnp.float32) -> ModelCache:
    return tuple(init_layer_cache(self.config.mla, batch_size, capacity, dtype,
                                  index_keys=not self.config.shares_topk(i))
                 for i in range(self.config.num_layers))

  def prefill_routes(self, num_new_tokens: int, num_cached_tokens: int | None = 0, *,
                     force_mqa: bool = False) -> list[PrefillRoute]:
    """The route of every layer for a call with these static counts.

    The dense/skip decision is model-wide: unless every layer can take the dense route, all
    take MQA, so a shared-indexer layer never follows a full layer that skipped scoring.
    """
    routes = [layer.self_attn.prefill_route(num_new_tokens, num_cached_tokens,
                                            force_mqa=force_mqa)
              for layer in self.model.layers]
    if PrefillRoute.DENSE_MHA in routes and set(routes) != {PrefillRoute.DENSE_MHA}:
      return self.prefill_routes(num_new_tokens, num_cached_tokens, force_mqa=True)
    return routes

  def _check_ids(self, ids_BT, caches):
    if getattr(ids_BT, "ndim", None) != 2 or not jnp.issubdtype(ids_BT.dtype, jnp.integer):
      raise ValueError(f"token ids must be an int array [batch, tokens], got "
                       f"{getattr(ids_BT, 'dtype', type(ids_BT))} {getattr(ids_BT, 'shape', '')}")
    if len(caches) != self.config.num_layers:
      raise ValueError(f"expected {self.config.num_layers} layer caches, got {len(caches)}")
    if not isinstance(ids_BT, jax.core.Tracer):
      ids = np.asarray(ids_BT)
      if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
        raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got "
                         f"[{ids.min()}, {ids.max()}]")

  def __call__(self, ids_BT, caches: ModelCache, *, new_lens_B=None, num_cached_tokens=None,
               force_mqa: bool = False):
    """Float32 logits [B, T, vocab] and the updated per-layer caches."""
    self._check_ids(ids_BT, caches)
    if num_cached_tokens is None and not isinstance(caches[0].lengths_B, jax.core.Tracer):
      num_cached_tokens = int(np.asarray(caches[0].lengths_B).max())
    routes = self.prefill_routes(ids_BT.shape[1], num_cached_tokens, force_mqa=force_mqa)
    force_mqa = force_mqa or PrefillRoute.DENSE_MHA not in routes
    h_BTD = self.model.embed_tokens(ids_BT)
    new_caches, topk_BTK = [], None
    for layer, cache in zip(self.model.layers, caches):
      h_BTD, cache, layer_topk = layer(h_BTD, cache, new_lens_B=new_lens_B,
                                       num_cached_tokens=num_cached_tokens, force_mqa=force_mqa,
                                       shared_topk_BTK=topk_BTK)
      if not layer.self_attn.shares_topk:
        topk_BTK = layer_topk  # None after a dense step: nothing stale to reuse
      new_caches.append(cache)
    logits_BTV = self.lm_head(self.model.norm(h_BTD)).astype(jnp.float32)
    return logits_BTV, tuple(new_caches)
