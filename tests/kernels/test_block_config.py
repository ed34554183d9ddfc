"""Block configs: validated at construction, hashable, and defined for every size."""

import pytest
from absl.testing import parameterized

from pallas_kernels.block_config import (
    DenseMHAKernelConfig, IndexerLogitsKernelConfig,
    SparseMQABackwardConfig,
    SparseMQAKernelConfig, pow2_chunks,
)


class BlockConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("sparse", SparseMQAKernelConfig, dict(block_h=48), "block_h"),
      ("indexer", IndexerLogitsKernelConfig, dict(block_s=0), "block_s"),
      ("mha", DenseMHAKernelConfig, dict(num_warps=3), "num_warps"),
      ("stages", DenseMHAKernelConfig, dict(num_stages=0), "num_stages"),
  )
  def test_rejects_bad_values(self, cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
      cls(**kwargs)

  def test_defaults_are_hashable_and_valid(self):
    configs = {
        SparseMQAKernelConfig.default_for(128, 2048, 512), SparseMQAKernelConfig.default_for(1, 1, 64),
        IndexerLogitsKernelConfig.default_for(1, 1), DenseMHAKernelConfig.default_for(512, 512, 256, 256),
    }
    self.assertLen(configs, 4)
    self.assertEqual(SparseMQAKernelConfig.default_for(128, 2048, 512).block_h, 32)

  def test_pow2_chunks(self):
    self.assertEqual(pow2_chunks(576), ((0, 512), (512, 64)))
    self.assertEqual(pow2_chunks(192), ((0, 128), (128, 64)))
    self.assertEqual(pow2_chunks(48), ((0, 32), (32, 16)))
    self.assertEqual(pow2_chunks(256), ((0, 256),))

  def test_default_configs_accept_zero_sizes(self):
    for config in (SparseMQAKernelConfig.default_for(0, 0, 64),
                   IndexerLogitsKernelConfig.default_for(0, 0),
                   IndexerLogitsKernelConfig.backward_for(0, 0),
                   DenseMHAKernelConfig.default_for(0, 0, 48, 32)):
      self.assertGreaterEqual(config.num_warps, 1)

  def test_sparse_backward_config(self):
    with pytest.raises(TypeError, match="drows"):
      SparseMQABackwardConfig(drows=DenseMHAKernelConfig())
    wide = SparseMQABackwardConfig.default_for(128, 2048, 512)
    self.assertEqual((wide.dq.block_h, wide.dq.block_k, wide.drows.block_k), (32, 32, 16))
    self.assertLen({wide, SparseMQABackwardConfig.default_for(0, 0, 64)}, 2)
