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

  def _run(self, x_BTD, cache, plan, new_lens_B, shared_topk_BTK):
    if plan.indexer_loss is not None:
      raise ValueError("the misrouted layer is an inference demonstration; it does not train")
    c = self.config
    b, t, _ = x_BTD.shape
    # The bug: the metadata looks at the backend only (ignoring the plan and the layer flag).
    metadata_says_dense = (self.backend.supports_dense_mha_prefill
                           and plan.num_cached_tokens is not None
                           and plan.num_cached_tokens + t <= c.indexer.topk)
    step = self._prepare(x_BTD, cache, plan, new_lens_B)
    latent_BSL, _ = step.cache.rows(plan.kv_rows)
    if metadata_says_dense:  # scoring skipped: the buffer keeps its -1 fill
      topk_BTK = jnp.full((b, t, c.indexer.topk), -1, jnp.int32)
    else:
      topk_BTK = self._select(step, plan, shared_topk_BTK)
    o_BTHV = self.forward_mqa(step.q_nope_BTHN, step.q_pe_BTHR, latent_BSL, topk_BTK)  # always MQA
    out_BTD = self.o_proj(o_BTHV.reshape(b, t, c.num_heads * c.v_head_dim))
    return AttentionOutput(out_BTD, step.cache, topk_BTK)
