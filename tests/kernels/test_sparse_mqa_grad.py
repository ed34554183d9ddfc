"""The sparse MQA gradient suite (``sparse_mqa_grad_base.py``) over every implementation."""

from tests.kernels import common
from tests.kernels import sparse_mqa_grad_base as base


class SparseMQAGradReferenceTest(base.SparseMQAGradTestBase):
  IMPLEMENTATION = common.REFERENCE


class SparseMQAGradPallasTest(base.SparseMQAGradKernelTestBase):
  IMPLEMENTATION = common.PALLAS_TRITON


class SparseMQAGradPallasInterpretTest(SparseMQAGradPallasTest):
  INTERPRET = True
