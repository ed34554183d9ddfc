"""Every kernel lowers for cuda on a CPU host to a Triton custom call (not Mosaic GPU).

Interpret mode accepts things Triton rejects (3-D dots, non-power-of-two tiles, masked gathers),
so this is the CI gate for "it will build on a GPU". Runs on jax 0.10.2 and 0.12 (the latter
needs an abstract GPU device; see pallas_kernels._compat.gpu_lowering_context).
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized

from mla_jax.backends.pallas import PallasTritonBackend
from pallas_kernels import _compat
from pallas_kernels.block_config import (
    DenseMHAKernelConfig, IndexerLogitsKernelConfig, SparseMQAKernelConfig, pow2_chunks,
)
from pallas_kernels.dense_mha import dense_mha
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.indexer_logits import indexer_logits
from pallas_kernels.sparse_mqa import sparse_mqa

sds = jax.ShapeDtypeStruct
BF16, I32, F32, FP8 = jnp.bfloat16, jnp.int32, jnp.float32, jnp.float8_e4m3fn


def sparse_case(T, H, D, d_v, S, K, dtype=BF16):
  fn = functools.partial(sparse_mqa, sm_scale=D**-0.5, d_v=d_v)
  return fn, (sds((T, H, D), dtype), sds((S, D), dtype), sds((T, K), I32))


def sparse_fp8_case(T, H, A, R, S, K, dtype=BF16):
  """fp8 rows in the cache layout: e4m3 latent, a float32 scale per tile, bf16 RoPE."""
  fn = functools.partial(sparse_mqa, sm_scale=(A + R)**-0.5, d_v=A)
  tiles = A // 128 if A % 128 == 0 else 1
  rows = Fp8LatentRows(sds((S, A), FP8), sds((S, tiles), F32), sds((S, R), BF16))
  return fn, (sds((T, H, A + R), dtype), rows, sds((T, K), I32))


def indexer_case(T, G, I, S, dtype=BF16, k_scale=False):
  args = (sds((T, G, I), dtype), sds((S, I), dtype), sds((T, G), F32), sds((T,), I32), sds((T,), I32))
  if not k_scale:
    return indexer_logits, args
  return (lambda *a: indexer_logits(*a[:5], k_scale_S=a[5])), args + (sds((S,), F32),)


def mha_case(T, S, H, D, V, dtype=BF16):
  fn = lambda q, k, v, off, n: dense_mha(q, k, v, sm_scale=D**-0.5, q_offset=off, kv_len=n)
  return fn, (sds((T, H, D), dtype), sds((S, H, D), dtype), sds((S, H, V), dtype), sds((), I32), sds((), I32))


CASES = {
    "sparse_mqa_tiny": (sparse_case(3, 5, 80, 64, 100, 7, F32), "sparse_mqa_attention"),
    "sparse_mqa_dsv32": (sparse_case(4, 128, 576, 512, 8192, 2048), "sparse_mqa_attention"),
    "sparse_mqa_tiny_fp8": (sparse_fp8_case(3, 5, 64, 16, 100, 7, F32), "sparse_mqa_attention"),
    "sparse_mqa_dsv32_fp8": (sparse_fp8_case(4, 128, 512, 64, 8192, 2048),
                             "sparse_mqa_attention"),
    "indexer_tiny_fp32": (indexer_case(37, 4, 32, 150, F32), "indexer_logits"),
    "indexer_dsv32_bf16": (indexer_case(128, 64, 128, 4096), "indexer_logits"),
    "indexer_dsv32_fp8": (indexer_case(128, 64, 128, 4096, FP8, k_scale=True), "indexer_logits"),
    "mha_tiny": (mha_case(37, 150, 2, 48, 32, F32), "dense_mha_prefill"),
    "mha_dsv32": (mha_case(512, 512, 128, 192, 128), "dense_mha_prefill"),
    "mha_glm5": (mha_case(512, 512, 64, 256, 256), "dense_mha_prefill"),
}


def triton_kernel_names(hlo_text):
  assert "mosaic_gpu" not in hlo_text, "kernel went to Mosaic GPU: compiler_params missing?"
  calls = hlo_text.count(_compat.TRITON_CUSTOM_CALL)
  names = re.findall(r'name = "([a-z_]+)"', hlo_text)
  return calls, names


class LoweringTest(parameterized.TestCase):

  @parameterized.named_parameters((name, *case) for name, case in CASES.items())
  def test_lowers_to_one_triton_call(self, case, kernel_name):
    fn, args = case
    calls, names = triton_kernel_names(_compat.lower_for_cuda(fn, *args))
    self.assertEqual(calls, 1)
    self.assertIn(kernel_name, names)

  @parameterized.named_parameters(
      ("sparse_mqa", "sparse_mqa", "sparse_mqa_attention"),
      ("sparse_mqa_fp8", "sparse_mqa_fp8", "sparse_mqa_attention"),
      ("indexer_logits", "indexer_logits", "indexer_logits"),
      ("indexer_logits_fp8", "indexer_logits_fp8", "indexer_logits"),
      ("dense_mha", "dense_mha", "dense_mha_prefill"),
  )
  def test_batched_backend_lowers_to_one_triton_call(self, op, kernel_name):
    backend, B = PallasTritonBackend(), 3
    if op == "sparse_mqa":
      fn = functools.partial(backend.sparse_mqa, sm_scale=0.1, d_v=512)
      args = (sds((B, 1, 128, 576), BF16), sds((B, 4096, 576), BF16), sds((B, 1, 2048), I32))
    elif op == "sparse_mqa_fp8":
      fn = functools.partial(backend.sparse_mqa, sm_scale=0.1, d_v=512)
      rows = Fp8LatentRows(sds((B, 4096, 512), FP8), sds((B, 4096, 4), F32),
                           sds((B, 4096, 64), BF16))
      args = (sds((B, 1, 128, 576), BF16), rows, sds((B, 1, 2048), I32))
    elif op.startswith("indexer_logits"):
      dtype = FP8 if op.endswith("fp8") else BF16
      args = (sds((B, 4, 64, 128), dtype), sds((B, 300, 128), dtype), sds((B, 4, 64), F32),
              sds((B, 4), I32), sds((B, 4), I32))
      fn = backend.indexer_logits
      if dtype == FP8:  # the per-key scales travel through the backend
        fn = lambda *a: backend.indexer_logits(*a[:5], k_scale_BS=a[5])
        args += (sds((B, 300), F32),)
    else:
      fn = lambda q, k, v, off, n: backend.dense_mha(q, k, v, sm_scale=0.1, q_offset_B=off, kv_len_B=n)
      args = (sds((B, 64, 4, 192), BF16), sds((B, 100, 4, 192), BF16), sds((B, 100, 4, 128), BF16),
              sds((B,), I32), sds((B,), I32))
    calls, names = triton_kernel_names(_compat.lower_for_cuda(fn, *args))
    self.assertEqual(calls, 1)  # vmap becomes a grid axis, not a loop of kernels
    self.assertIn(kernel_name, names)

  def test_declared_cost_estimate(self):
    fn, args = CASES["sparse_mqa_dsv32"][0]
    jaxpr = jax.make_jaxpr(fn)(*args)
    [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    self.assertEqual(eqn.params["name"], "sparse_mqa_attention")
    self.assertEqual(eqn.params["cost_estimate"].flops, 2 * 4 * 2048 * 128 * (576 + 512))


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
