"""PallasTritonBackend: the Pallas kernels of ``pallas_kernels`` on the Triton backend.

Block sizes come from each kernel config's ``default_for(shape)``; the base class vmaps the
per-sequence kernels over the batch, which Pallas turns into an extra grid axis.

The kernels have no backward yet: differentiating through one (``jax.grad``, ``jax.jvp``)
raises ``NotImplementedError`` naming the kernel, when the derivative is traced and before
anything runs, instead of a bare ``AssertionError`` from deep inside Pallas.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from mla_jax.backends.base import Backend
from pallas_kernels.dense_mha import dense_mha
from pallas_kernels.indexer_logits import indexer_logits
from pallas_kernels.sparse_mqa import sparse_mqa


def _without_derivative(kernel: str, function: str, fn, *args):
  """``fn(*args)``, refusing differentiation by name.

  A ``custom_jvp`` whose rule raises: ``jax.grad`` linearizes through the JVP, so the rule
  runs while the derivative is traced, before the forward kernel runs. Undifferentiated
  calls (and ones whose inputs carry no tangent) run ``fn`` as it is.
  """

  @jax.custom_jvp
  def op(*args):
    return fn(*args)

  @op.defjvp
  def _(primals, tangents):
    raise NotImplementedError(f"the Pallas kernel {kernel} ({function}) has no backward yet; "
                              "train with backend='xla'")

  return op(*args)


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
    return _without_derivative(
        "sparse_mqa_attention", "pallas_kernels.sparse_mqa",
        lambda q, kv, topk: sparse_mqa(q, kv, topk, sm_scale=sm_scale, d_v=d_v,
                                       interpret=self.interpret),
        q_THL, kv_SL, topk_TK)

  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=None,
                      key_rows_S=None):
    return indexer_logits(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=k_scale_S,
                          key_rows_S=key_rows_S, interpret=self.interpret)

  def _dense_mha(self, q_THQ, k_SHQ, v_SHV, *, sm_scale, q_offset, kv_len):
    return _without_derivative(
        "dense_mha_prefill", "pallas_kernels.dense_mha",
        lambda q, k, v, offset, n: dense_mha(q, k, v, sm_scale=sm_scale, q_offset=offset,
                                             kv_len=n, interpret=self.interpret),
        q_THQ, k_SHQ, v_SHV, q_offset, kv_len)

  def _masked_mha(self, q_THQ, k_SHQ, v_SHV, topk_TK, *, sm_scale, q_offset, kv_len):
    return _without_derivative(
        "masked_mha_prefill", "pallas_kernels.dense_mha",
        lambda q, k, v, topk, offset, n: dense_mha(q, k, v, sm_scale=sm_scale, q_offset=offset,
                                                   kv_len=n, topk_TK=topk,
                                                   interpret=self.interpret),
        q_THQ, k_SHQ, v_SHV, topk_TK, q_offset, kv_len)
