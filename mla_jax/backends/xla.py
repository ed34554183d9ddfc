"""XlaBackend: the plain-jnp kernel references, compiled by XLA. Runs on any platform."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from mla_jax.backends.base import Backend
from pallas_kernels import dense_mha_reference, indexer_logits_reference, sparse_mqa_reference


@dataclasses.dataclass(frozen=True)
class XlaBackend(Backend):
  """The specification path: every op is the ``*_reference`` beside its Pallas kernel."""

  name: ClassVar[str] = "xla"
  supports_dense_mha_prefill: ClassVar[bool] = True  # masked MHA follows (routing)

  # Measured, not derived: one layer of the `small` preset (top-k 64), a fresh prefill, batch 1,
  # XLA:CPU on 2 cores (jit, median of 5), masked / sparse MQA time: 0.44 at 512 tokens, 0.63 at
  # 960, 1.37 at 1024, 2.5 at 2048; re-measured on a busier machine with benchmarks/routes.py
  # (median of 7): 0.97 at 768, 1.00 at 960, 1.26 at 1024, 1.35 at 1280. The FLOP ratio alone
  # (docs/design.md §2) would cross far earlier, at 2K(L+A)/(Q+V) = 384 tokens for these dims
  # (XLA's own FLOP counts cross between 128 and 256, its byte counts between 1024 and 2048):
  # the reference's sparse gather costs more per pair on a CPU than its FLOPs say. Both depend
  # on the dims and the machine; retune with benchmarks/routes.py when either changes.
  masked_mha_max_tokens: int = 960
  # Measured, not derived: an engine's flat step of 512 rows, the tiny preset, XLA:CPU on 2
  # cores (best of 12 calls): a chunk's per-row key gather stops fitting the caches past
  # about 64 keys, so 64 beat 256 by 1.3x at 64 keys of reach and 1.8x at 1024 (16 and 32
  # win at 16 keys and lose at 1024). Retune when the dims or the machine change.
  key_chunk: int = 64

  def _sparse_mqa(self, q_THL, kv_SL, topk_TK, *, sm_scale, d_v):
    return sparse_mqa_reference(q_THL, kv_SL, topk_TK, sm_scale=sm_scale, d_v=d_v)

  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=None,
                      key_rows_S=None):
    return indexer_logits_reference(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=k_scale_S,
                                    key_rows_S=key_rows_S)

  def _dense_mha(self, q_THQ, k_SHQ, v_SHV, *, sm_scale, q_offset, kv_len, segment_ids_T=None):
    return dense_mha_reference(q_THQ, k_SHQ, v_SHV, sm_scale=sm_scale, q_offset=q_offset,
                               kv_len=kv_len, segment_ids_T=segment_ids_T)

  def _masked_mha(self, q_THQ, k_SHQ, v_SHV, topk_TK, *, sm_scale, q_offset, kv_len):
    return dense_mha_reference(
        q_THQ, k_SHQ, v_SHV, sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len, topk_TK=topk_TK
    )
