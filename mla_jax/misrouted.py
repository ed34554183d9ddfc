"""A deliberately wrong DeepSeek-V3.2 layer: the engine bug the routing contract exists to stop.

Its "dense" decision reads the backend's capability only (ignoring the layer's own flag and
``force_mqa``), so a short prefill of this MQA-only layer skips indexer scoring; the top-k
buffer keeps its -1 fill, every query attends to nothing and the output is zero. The
notebooks and the retrieval probe use it to show what the bug does to a model; nothing in the
library builds it unless asked (``CausalLM(..., attention_class=MisroutedV32Attention)``).
"""

from __future__ import annotations

import jax.numpy as jnp

from mla_jax.attention import AttentionOutput, DeepseekV32Attention


class MisroutedV32Attention(DeepseekV32Attention):
  """DELIBERATELY WRONG: skips indexer scoring for "dense" prefills it never runs densely."""

  def __call__(self, x_BTD, cache, *, new_lens_B=None, num_cached_tokens=None,
               force_mqa=False, shared_topk_BTK=None, kv_rows=None, indexer_loss=None):
    if indexer_loss is not None:
      raise ValueError("the misrouted layer is an inference demonstration; it does not train")
    c = self.config
    b, t, _ = x_BTD.shape
    new_lens_B = (jnp.full((b,), t, jnp.int32) if new_lens_B is None
                  else jnp.asarray(new_lens_B, jnp.int32))
    # The bug: the metadata looks at the backend only (and ignores force_mqa / the layer flag).
    metadata_says_dense = (self.backend.supports_dense_mha_prefill
                           and num_cached_tokens is not None
                           and num_cached_tokens + t <= c.indexer.topk)
    positions_BT = cache.lengths_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    q_resid_BTC, q_nope_BTHN, q_pe_BTHR, latent_BTL = self.project(x_BTD, positions_BT)
    new_cache = cache.write(latent_BTL, self.indexer.keys(x_BTD, positions_BT), new_lens_B)
    latent_BSL, keys_BSI = new_cache.rows(cache.capacity if kv_rows is None else kv_rows)
    if metadata_says_dense:  # scoring skipped: the buffer keeps its -1 fill
      topk_BTK = jnp.full((b, t, c.indexer.topk), -1, jnp.int32)
    else:
      topk_BTK = self.indexer.select(x_BTD, q_resid_BTC, positions_BT, keys_BSI, self.backend,
                                     chunk_size=self.index_chunk_size)
    o_BTHV = self.forward_mqa(q_nope_BTHN, q_pe_BTHR, latent_BSL, topk_BTK)  # always MQA
    out_BTD = self.o_proj(o_BTHV.reshape(b, t, c.num_heads * c.v_head_dim))
    return AttentionOutput(out_BTD, new_cache, topk_BTK)
