"""mla_jax: DeepSeek-style Multi-head Latent Attention with sparse top-k (DSA) in JAX/Flax NNX.

Axis letters, the suffixes of tensor names here and in ``pallas_kernels`` (``q_BTHQ`` is
[batch, query tokens, heads, qk width]):

  B batch              T query tokens         S key/cache tokens    D model hidden
  H heads              C q-latent rank        A kv-latent rank      L latent row (A + R)
  N nope dims          R rope dims            V value width         Q qk head width (N + R)
  G indexer heads      I indexer head dim     K top-k               E experts
  F MLP intermediate
"""

from mla_jax.attention import (AttentionOutput, DeepseekV32Attention, MLAAttention,
                               MLAAttentionBase)
from mla_jax.backends import Backend, XlaBackend, get_backend
from mla_jax.cache import LayerCache, init_layer_cache
from mla_jax.config import (IndexerConfig, MLAConfig, RopeConfig, YarnConfig, deepseek_v3,
                            deepseek_v32, glm5, tiny)
from mla_jax.generation import GenerationResult, generate
from mla_jax.models.config import ModelConfig, MoEConfig
from mla_jax.models.lm import CausalLM
from mla_jax.routing import PrefillRoute, resolve_prefill_route

__all__ = [
    "AttentionOutput", "Backend", "CausalLM", "DeepseekV32Attention", "GenerationResult",
    "ModelConfig", "MoEConfig", "generate", "IndexerConfig", "LayerCache",
    "MLAAttention", "MLAAttentionBase", "MLAConfig", "PrefillRoute", "RopeConfig", "XlaBackend",
    "YarnConfig", "deepseek_v3", "deepseek_v32", "get_backend", "glm5", "init_layer_cache",
    "resolve_prefill_route", "tiny",
]
