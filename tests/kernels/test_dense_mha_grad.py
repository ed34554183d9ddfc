"""The dense MHA gradient suite (``dense_mha_grad_base.py``) over every implementation."""

from tests.kernels import common
from tests.kernels import dense_mha_grad_base as base


class DenseMHAGradReferenceTest(base.DenseMHAGradTestBase):
  IMPLEMENTATION = common.REFERENCE


class DenseMHAGradPallasTest(base.DenseMHAGradKernelTestBase):
  IMPLEMENTATION = common.PALLAS_TRITON


class DenseMHAGradPallasInterpretTest(DenseMHAGradPallasTest):
  INTERPRET = True
