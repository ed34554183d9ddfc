"""The dense causal MHA suite (``dense_mha_base.py``) over every implementation."""

from tests.kernels import common
from tests.kernels import dense_mha_base as base


class DenseMHAReferenceTest(base.DenseMHATestBase):
  IMPLEMENTATION = common.REFERENCE


class DenseMHAPallasTest(base.DenseMHAKernelTestBase):
  IMPLEMENTATION = common.PALLAS_TRITON


class DenseMHAPallasInterpretTest(DenseMHAPallasTest):
  INTERPRET = True
