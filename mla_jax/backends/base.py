"""The backend contract: three attention operations and the capabilities a backend declares.

Modules never know which backend runs; backends never know about routes. Capabilities are
class-level constants so that routing reads them at trace time and no runtime branch exists
(``mla_jax.routing`` is the only place that combines them with the module's own).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax


@dataclasses.dataclass(frozen=True)
class Backend(abc.ABC):
  """Batched attention operations over per-sequence kernels.

  Subclasses implement the per-sequence ``_sparse_mqa`` and ``_indexer_logits`` (and
  ``_dense_mha`` when they declare ``supports_dense_mha_prefill``); this base vmaps them over
  the batch axis, which Pallas turns into an extra grid axis. Instances are frozen and
  hashable, so a module may hold one as a static attribute.
  """

  name: ClassVar[str]
  supports_dense_mha_prefill: ClassVar[bool] = False

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.supports_dense_mha_prefill and cls._dense_mha is Backend._dense_mha:
      raise TypeError(
          f"{cls.__name__} declares supports_dense_mha_prefill = True but does not implement"
          " _dense_mha"
      )

  @abc.abstractmethod
  def _sparse_mqa(self, q_THL, kv_SL, topk_TK, *, sm_scale, d_v):
    """Per-sequence sparse MQA; see ``pallas_kernels.sparse_mqa_reference``."""

  @abc.abstractmethod
  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T):
    """Per-sequence indexer logits; see ``pallas_kernels.indexer_logits_reference``."""

  def _dense_mha(self, q_THQ, k_SHQ, v_SHV, *, sm_scale, q_offset, kv_len):
    raise NotImplementedError(f"backend {self.name!r} has no dense MHA prefill kernel")

  def sparse_mqa(self, q_BTHL, kv_BSL, topk_BTK, *, sm_scale: float, d_v: int):
    """Returns ``(out_BTHV, lse_BTH)`` with natural-log LSE; invalid indices are -1 or >= S."""
    fn = lambda q, kv, idx: self._sparse_mqa(q, kv, idx, sm_scale=sm_scale, d_v=d_v)
    return jax.vmap(fn)(q_BTHL, kv_BSL, topk_BTK)

  def indexer_logits(self, q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT):
    """Returns float32 logits [B, T, S], -inf outside each row's ``[start, end)`` window."""
    return jax.vmap(self._indexer_logits)(q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT)

  def dense_mha(self, q_BTHQ, k_BSHQ, v_BSHV, *, sm_scale: float, q_offset_B, kv_len_B):
    """Causal attention; query t of sequence b sits at position ``q_offset_B[b] + t``."""
    fn = lambda q, k, v, off, n: self._dense_mha(q, k, v, sm_scale=sm_scale, q_offset=off, kv_len=n)
    return jax.vmap(fn)(q_BTHQ, k_BSHQ, v_BSHV, q_offset_B, kv_len_B)
