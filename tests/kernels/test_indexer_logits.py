"""The indexer logits suite (``indexer_logits_base.py``) over every implementation."""

from tests.kernels import common
from tests.kernels import indexer_logits_base as base


class IndexerLogitsReferenceTest(base.IndexerLogitsTestBase):
  IMPLEMENTATION = common.REFERENCE


class IndexerLogitsPallasTest(base.IndexerLogitsKernelTestBase):
  IMPLEMENTATION = common.PALLAS_TRITON


class IndexerLogitsPallasInterpretTest(IndexerLogitsPallasTest):
  INTERPRET = True
