"""PallasTritonBackend: the Pallas kernels of ``pallas_kernels`` on the Triton backend.

Block sizes come from each kernel config's ``default_for(shape)``; the base class vmaps the
per-sequence kernels over the batch, which Pallas turns into an extra grid axis.

Each kernel is a ``jax.custom_vjp`` with Pallas-Triton backward kernels (sparse MQA: dq and
the selected rows' gradients, summed per row in a fixed order; indexer: dq/dw and dk; dense and
masked MHA: flash dq and dk/dv from the saved LSE), so ``jax.grad`` through this backend trains
with the kernels (``mla_jax.training.run_recipe(backend="pallas")``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from mla_jax.backends.base import Backend
from pallas_kernels.dense_mha import dense_mha
from pallas_kernels.indexer_logits import indexer_logits
from pallas_kernels.sparse_mqa import sparse_mqa


@dataclasses.dataclass(frozen=True)
class PallasTritonBackend(Backend):
  """Triton kernels on NVIDIA GPUs; ``interpret=True`` runs them on any host (slow, for tests)."""

  name: ClassVar[str] = "pallas_triton"
  supports_dense_mha_prefill: ClassVar[bool] = True  # masked MHA follows (routing)

  # From the kernels' cost estimates, to be tuned on a GPU: the masked kernel is charged every
  # causal pair at 2H(Q+V) FLOPs (dense_mha's estimate; the key blocks it skips only lower
  # that), sparse MQA K slots per query at 2H(L+A), so a fresh prefill of S tokens crosses over
  # at S + 1 = 2K(L+A)/(Q+V): 13,926 at DeepSeek-V3.2 dims, 8,704 at GLM-5's (K = 2048). 8192
  # sits below both; vLLM's measured FlashMLA tables for DSA prefill switch back to sparse MQA
  # earlier (at 4K tokens with tensor parallelism 1).
  masked_mha_max_tokens: int = 8192
  interpret: bool = False

  def _sparse_mqa(self, q_THL, kv_SL, topk_TK, *, sm_scale, d_v):
    return sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale=sm_scale, d_v=d_v,
                      interpret=self.interpret)

  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=None,
                      key_rows_S=None):
    return indexer_logits(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=k_scale_S,
                          key_rows_S=key_rows_S, interpret=self.interpret)

  def _dense_mha(self, q_THQ, k_SHQ, v_SHV, *, sm_scale, q_offset, kv_len, segment_ids_T=None):
    return dense_mha(q_THQ, k_SHQ, v_SHV, sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len,
                     segment_ids_T=segment_ids_T, interpret=self.interpret)

  def _masked_mha(self, q_THQ, k_SHQ, v_SHV, topk_TK, *, sm_scale, q_offset, kv_len):
    return dense_mha(q_THQ, k_SHQ, v_SHV, sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len,
                     topk_TK=topk_TK, interpret=self.interpret)
