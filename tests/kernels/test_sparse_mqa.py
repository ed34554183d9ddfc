"""The sparse MQA suite (``sparse_mqa_base.py``) over every implementation."""

from tests.kernels import common
from tests.kernels import sparse_mqa_base as base


class SparseMQAReferenceTest(base.SparseMQATestBase):
  IMPLEMENTATION = common.REFERENCE


class SparseMQAPallasTest(base.SparseMQAKernelTestBase):
  IMPLEMENTATION = common.PALLAS_TRITON


class SparseMQAPallasInterpretTest(SparseMQAPallasTest):
  INTERPRET = True
