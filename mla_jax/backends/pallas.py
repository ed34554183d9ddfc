"""PallasTritonBackend: the Pallas kernels of ``pallas_kernels`` on the Triton backend.

Block sizes come from each kernel config's ``default_for(shape)``; the base class vmaps the
per-sequence kernels over the batch, which Pallas turns into an extra grid axis.
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
  supports_dense_mha_prefill: ClassVar[bool] = True

  interpret: bool = False

  def _sparse_mqa(self, q_THL, kv_SL, topk_TK, *, sm_scale, d_v):
    return sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale=sm_scale, d_v=d_v, interpret=self.interpret)

  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=None):
    return indexer_logits(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=k_scale_S,
                          interpret=self.interpret)

  def _dense_mha(self, q_THQ, k_SHQ, v_SHV, *, sm_scale, q_offset, kv_len):
    return dense_mha(
        q_THQ, k_SHQ, v_SHV, sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len,
        interpret=self.interpret,
    )
