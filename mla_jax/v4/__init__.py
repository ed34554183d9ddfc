"""DeepSeek-V4 (HF ``model_type: deepseek_v4``): compressed sparse attention in JAX.

One shared K=V head of ``head_dim`` (512) per token, the last ``rope_dim`` (64) of it rotary,
and three attention layer types (docs/models.md):

* ``sliding_attention``: the last ``sliding_window`` tokens only;
* ``compressed_sparse_attention`` (CSA): the window plus the indexer's top-k of entries
  pooled over ``m = 4`` tokens with overlap;
* ``heavily_compressed_attention`` (HCA): the window plus every entry pooled over
  ``m' = 128`` tokens.

Each is absorbed MQA over a set of rows (window, compressed entries), so it runs on the
backends' sparse MQA; what a layer may select is fixed by its class (``attention``) and
decided once per step (``step_plan``). ``V4CausalLM`` is a decode model
(``mla_jax.decoding.protocol``): ``mla_jax.generate``, the engine and ``mla-jax serve`` run it,
over contiguous or paged caches (``cache``).
Residuals are mHC streams (``hyper``), feed-forwards DeepSeek MoE with hash-routed first
layers (``moe``).

Axis letters as in the package docstring, plus W (window slots), C (compressed entries),
M (tokens a compressed entry pools), N (mHC streams).
"""

from mla_jax.v4.checkpoint import load_pretrained, save_pretrained
from mla_jax.v4.config import V4Config
from mla_jax.v4.model import V4CausalLM

__all__ = ["V4CausalLM", "V4Config", "load_pretrained", "save_pretrained"]
