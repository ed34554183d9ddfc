"""The route matrix, class-definition checks and the MQA-only notice."""

import itertools
import logging
from typing import ClassVar

import pytest
from flax import nnx

import mla_jax as m
from mla_jax.attention import MLAAttentionBase
from mla_jax.backends import XlaBackend
from mla_jax.routing import PrefillRoute, resolve_prefill_route
from tests.helpers import XlaNoDenseBackend, tiny_no_indexer

TOPK = m.tiny().indexer.topk
LENGTHS = (1, TOPK - 1, TOPK, TOPK + 1, 4 * TOPK)


@pytest.fixture(scope="module")
def layers():
  return {(cls, backend_cls): cls(m.tiny(), rngs=nnx.Rngs(0), backend=backend_cls())
          for cls in (m.MLAAttention, m.DeepseekV32Attention)
          for backend_cls in (XlaBackend, XlaNoDenseBackend)}


@pytest.mark.parametrize("cls, backend_cls, length, cached, force_mqa", list(itertools.product(
    (m.MLAAttention, m.DeepseekV32Attention), (XlaBackend, XlaNoDenseBackend), LENGTHS, (0, 5),
    (False, True))))
def test_route_matrix(layers, cls, backend_cls, length, cached, force_mqa):
  layer = layers[(cls, backend_cls)]
  route = resolve_prefill_route(layer, backend_cls(), num_new_tokens=length,
                                num_cached_tokens=cached, force_mqa=force_mqa)
  mha = cls is m.MLAAttention and backend_cls is XlaBackend and not force_mqa
  dense = mha and cached + length <= TOPK
  masked = mha and TOPK < cached + length <= XlaBackend.masked_mha_max_tokens
  assert route is (PrefillRoute.DENSE_MHA if dense else PrefillRoute.MASKED_MHA if masked
                   else PrefillRoute.SPARSE_MQA)
  assert layer.prefill_route(length, cached, force_mqa=force_mqa) is route
  assert route.needs_topk is not dense


def test_boundary_is_inclusive_and_counts_cached_tokens(layers):
  layer = layers[(m.MLAAttention, XlaBackend)]
  assert layer.prefill_route(TOPK) is PrefillRoute.DENSE_MHA
  assert layer.prefill_route(TOPK + 1) is PrefillRoute.MASKED_MHA  # the third route's window
  assert layer.prefill_route(3, TOPK - 3) is PrefillRoute.DENSE_MHA
  assert layer.prefill_route(3, TOPK - 2) is PrefillRoute.MASKED_MHA


@pytest.mark.parametrize("cls", [m.MLAAttention, m.DeepseekV32Attention])
def test_unknown_cached_length_is_conservative(layers, cls):
  assert layers[(cls, XlaBackend)].prefill_route(1, None) is PrefillRoute.SPARSE_MQA


@pytest.mark.parametrize("cls, backend_cls, cached, expected", [
    (m.MLAAttention, XlaBackend, 0, PrefillRoute.DENSE_MHA),
    (m.MLAAttention, XlaBackend, None, PrefillRoute.DENSE_MQA),  # decode is always MQA
    (m.MLAAttention, XlaNoDenseBackend, 0, PrefillRoute.DENSE_MQA),
    (m.DeepseekV32Attention, XlaBackend, 0, PrefillRoute.DENSE_MQA),
])
def test_routes_without_indexer(cls, backend_cls, cached, expected):
  layer = cls(tiny_no_indexer(), rngs=nnx.Rngs(0), backend=backend_cls())
  assert layer.prefill_route(4 * TOPK, cached) is expected
  assert layer.prefill_route(4 * TOPK, 0, force_mqa=True) is PrefillRoute.DENSE_MQA


def test_route_needs_static_token_count(layers):
  with pytest.raises(TypeError, match="num_new_tokens"):
    resolve_prefill_route(layers[(m.MLAAttention, XlaBackend)], XlaBackend(),
                          num_new_tokens=None, num_cached_tokens=0)
  with pytest.raises(ValueError, match="num_cached_tokens"):
    layers[(m.MLAAttention, XlaBackend)].prefill_route(3, -1)


def test_mqa_only_layer_holds_no_dense_prefill_path(layers):
  assert layers[(m.DeepseekV32Attention, XlaBackend)].dense_prefill_backend is None
  assert layers[(m.MLAAttention, XlaNoDenseBackend)].dense_prefill_backend is None
  assert layers[(m.MLAAttention, XlaBackend)].dense_prefill_backend is not None
  assert not hasattr(m.DeepseekV32Attention, "forward_mha")  # no dense method at all
  assert not issubclass(m.DeepseekV32Attention, m.MLAAttention)
  assert m.DeepseekV32Attention.supports_dense_mha_prefill is False
  assert m.MLAAttention.supports_dense_mha_prefill is True


def test_declaring_dense_support_without_a_dense_path_is_rejected():
  with pytest.raises(TypeError, match="forward_mha"):
    class Broken(m.DeepseekV32Attention):  # noqa: F841 - the definition itself must fail
      supports_dense_mha_prefill: ClassVar[bool] = True

  with pytest.raises(TypeError, match="forward_mha"):
    class AlsoBroken(MLAAttentionBase):  # noqa: F841
      supports_dense_mha_prefill: ClassVar[bool] = True

  class Fine(MLAAttentionBase):  # MQA-only subclasses need nothing more
    pass

  assert Fine.supports_dense_mha_prefill is False


def test_backend_declaring_dense_without_kernel_is_rejected():
  with pytest.raises(TypeError, match="_dense_mha"):
    class BrokenBackend(m.Backend):  # noqa: F841
      name: ClassVar[str] = "broken"
      supports_dense_mha_prefill: ClassVar[bool] = True

      def _sparse_mqa(self, *a, **k):
        raise NotImplementedError

      def _indexer_logits(self, *a, **k):
        raise NotImplementedError


def test_mqa_only_notice_is_logged_once(caplog):
  from mla_jax import attention

  class FreshMqaOnly(m.DeepseekV32Attention):
    pass

  attention._logged_mqa_only.discard(("FreshMqaOnly", "XlaBackend"))
  with caplog.at_level(logging.INFO, logger="mla_jax"):
    FreshMqaOnly(m.tiny(), rngs=nnx.Rngs(0), backend="xla")
    FreshMqaOnly(m.tiny(), rngs=nnx.Rngs(1), backend="xla")
  notices = [r for r in caplog.records if "top-k MQA path only" in r.getMessage()]
  assert len(notices) == 1 and notices[0].levelno == logging.INFO  # not a warning: by design


def test_backend_without_dense_kernel_raises_clearly():
  class SparseOnly(m.Backend):
    name: ClassVar[str] = "sparse_only"

    def _sparse_mqa(self, *a, **k):
      raise AssertionError("not called")

    def _indexer_logits(self, *a, **k):
      raise AssertionError("not called")

  assert SparseOnly.supports_dense_mha_prefill is False
  with pytest.raises(NotImplementedError, match="dense MHA"):
    SparseOnly()._dense_mha(None, None, None, sm_scale=1.0, q_offset=0, kv_len=0)


def test_unknown_backend_name():
  with pytest.raises(ValueError, match="backend must be one of"):
    m.get_backend("cuda")
