"""MosaicGpuBackend: the DSA kernels on Mosaic GPU (Hopper, sm_90a), the rest on Pallas-Triton.

Sparse MQA and the indexer logits, the two kernels every DSA step runs, are the Mosaic GPU
kernels of ``pallas_kernels.mosaic_gpu``; the prefill MHA kernels and every backward pass are
the Pallas-Triton ones (``MOSAIC_OPS`` / ``TRITON_OPS``). Inputs the Mosaic kernels do not take
(float32, head counts that are not a multiple of 64, ...; each kernel's ``check_supported``)
go to the Triton kernel of the same op, decided at trace time from static shapes and dtypes:
:meth:`MosaicGpuBackend.kernel_for` says which for given inputs.

The routing capabilities are the Triton backend's while this jax has Pallas Triton (its dense
and masked MHA kernels are then part of this backend). On a jax without it (JAX deprecated it
in 0.11; ``gpu_support``) the class declares no dense or masked MHA, so routing never builds a
path that cannot run, and the Mosaic forwards are all it has: no backward passes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax

from mla_jax import checks
from mla_jax.backends import gpu_support
from mla_jax.backends.pallas import PallasTritonBackend
from pallas_kernels import indexer_logits as triton_indexer
from pallas_kernels import sparse_mqa as triton_sparse
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.mosaic_gpu import indexer_logits as mosaic_indexer
from pallas_kernels.mosaic_gpu import sparse_mqa as mosaic_sparse
from pallas_kernels.mosaic_gpu._compat import interpret_params

MOSAIC = "mosaic_gpu"
TRITON = "pallas_triton"
_HAS_TRITON = gpu_support.pallas_triton().available  # fixed for the process, as the jax is


@dataclasses.dataclass(frozen=True)
class MosaicGpuBackend(PallasTritonBackend):
  """Mosaic GPU forward kernels for sparse MQA and the indexer, Pallas-Triton for the rest.

  ``interpret=True`` runs the Mosaic kernels in the GPU interpreter and the Triton ones in
  Pallas's interpreter, on any host (slow, for tests).
  """

  # Parts each token's top-k is split into by the Mosaic sparse MQA kernel (merged by
  # log-sum-exp); None: ``split_count`` of each launch's tokens, so a small decode batch
  # spreads over the GPU (pallas_kernels/mosaic_gpu/sparse_mqa.py).
  sparse_mqa_splits: int | None = None

  name: ClassVar[str] = "mosaic_gpu"
  supports_dense_mha_prefill: ClassVar[bool] = _HAS_TRITON  # masked MHA follows (routing)
  # Which kernels each op runs on: Mosaic GPU forwards where the inputs fit them.
  MOSAIC_OPS: ClassVar[frozenset[str]] = frozenset({"sparse_mqa", "indexer_logits"})
  TRITON_OPS: ClassVar[frozenset[str]] = frozenset({
      "dense_mha", "masked_mha", "sparse_mqa_backward", "indexer_logits_backward"}
      if _HAS_TRITON else ())

  def __post_init__(self):
    super().__post_init__()
    if self.sparse_mqa_splits is not None:
      checks.static_int(self.sparse_mqa_splits, "sparse_mqa_splits", minimum=1)

  def kernel_for(self, op: str, *args) -> str:
    """``"mosaic_gpu"`` or ``"pallas_triton"``: the forward kernel that runs ``op`` (one of
    ``MOSAIC_OPS | TRITON_OPS``) on these per-sequence arguments (arrays or
    ``jax.ShapeDtypeStruct``: only shapes and dtypes are read)."""
    if op in self.TRITON_OPS:
      return TRITON
    if op not in self.MOSAIC_OPS:
      raise ValueError(f"unknown op {op!r} for {self.name}; its ops are "
                       f"{sorted(self.MOSAIC_OPS | self.TRITON_OPS)}")
    if op == "sparse_mqa":
      q_THL, kv_SL, d_v = args
      fp8 = isinstance(kv_SL, Fp8LatentRows)
      return _fits(mosaic_sparse.check_supported, q_THL.dtype, q_THL.shape[1], q_THL.shape[2],
                   d_v, kv_SL.tile if fp8 else None)
    q_TGI, k_SI = args
    return _fits(mosaic_indexer.check_supported, q_TGI.dtype, k_SI.dtype, q_TGI.shape[1],
                 q_TGI.shape[2])

  def sparse_mqa(self, q_BTHL, kv_BSL, topk_BTK, **kwargs):
    # The split depends on the tokens of the whole launch, which the per-sequence kernel
    # under the base class's vmap cannot see.
    if self.sparse_mqa_splits is None and q_BTHL.ndim == 4 and topk_BTK.ndim == 3:
      B, T, H, _ = q_BTHL.shape
      splits = mosaic_sparse.split_count(B * T, H, topk_BTK.shape[2])
      return dataclasses.replace(self, sparse_mqa_splits=splits).sparse_mqa(
          q_BTHL, kv_BSL, topk_BTK, **kwargs)
    return super().sparse_mqa(q_BTHL, kv_BSL, topk_BTK, **kwargs)

  def _sparse_mqa(self, q_THL, kv_SL, topk_TK, *, sm_scale, d_v):
    sm_scale, d_v = triton_sparse.validate_sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale, d_v)
    if self.kernel_for("sparse_mqa", q_THL, kv_SL, d_v) == TRITON:
      return super()._sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale=sm_scale, d_v=d_v)
    if (empty := triton_sparse._nothing_to_attend(q_THL, kv_SL, topk_TK, d_v)) is not None:
      return empty
    forward = functools.partial(mosaic_sparse.sparse_mqa_mosaic, sm_scale=sm_scale, d_v=d_v,
                                num_splits=self.sparse_mqa_splits,
                                interpret=self._mosaic_interpret())
    if not _HAS_TRITON:
      return _without_gradient(forward, q_THL, kv_SL, topk_TK)
    return triton_sparse.with_triton_backward(forward, q_THL, kv_SL, topk_TK, sm_scale=sm_scale,
                                              d_v=d_v, interpret=self.interpret)

  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=None,
                      key_rows_S=None):
    args = (q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S, key_rows_S)
    triton_indexer.validate_indexer_logits(*args)
    if self.kernel_for("indexer_logits", q_TGI, k_SI) == TRITON:
      return super()._indexer_logits(*args[:5], k_scale_S=k_scale_S, key_rows_S=key_rows_S)
    if (empty := triton_indexer._nothing_to_score(q_TGI, k_SI, key_rows_S)) is not None:
      return empty

    def forward(q, k, w, starts, ends, k_scale, key_rows):
      return mosaic_indexer.indexer_logits_mosaic(q, k, w, starts, ends, k_scale_S=k_scale,
                                                  key_rows_S=key_rows,
                                                  interpret=self._mosaic_interpret())
    if not _HAS_TRITON:
      return _without_gradient(forward, *args)
    return triton_indexer.with_triton_backward(forward, *args, interpret=self.interpret)

  def _mosaic_interpret(self):
    return interpret_params() if self.interpret else None


def _without_gradient(forward, *args):
  """``forward(*args)``, whose gradient is refused by name: the backward kernels are
  Pallas-Triton's, which this jax lacks."""
  @jax.custom_vjp
  def run(*args):
    return forward(*args)

  def backward(residuals, cotangents):
    raise gpu_support.BackendUnavailable(
        "backend 'mosaic-gpu' has no backward kernels without Pallas Triton "
        f"({gpu_support.pallas_triton().reason}); train with backend='xla'")

  run.defvjp(lambda *args: (forward(*args), None), backward)
  return run(*args)


def _fits(check, *args) -> str:
  try:
    check(*args)
  except NotImplementedError as e:
    if not _HAS_TRITON:
      raise NotImplementedError(f"{e}; and this jax has no Pallas Triton to run it instead "
                                f"({gpu_support.pallas_triton().reason})") from e
    return TRITON
  return MOSAIC
