"""Every kernel lowers for cuda on a CPU host to a Triton custom call (not Mosaic GPU).

Interpret mode accepts things Triton rejects (3-D dots, non-power-of-two tiles, masked gathers),
so this is the CI gate for "it will build on a GPU". Runs on jax 0.10.2 and 0.12 (the latter
needs an abstract GPU device; see pallas_kernels._compat.gpu_lowering_context).
"""

import functools
import re

import jax
from absl.testing import parameterized

from mla_jax.backends.pallas import PallasTritonBackend
from mla_jax.traces import walk_equations
from pallas_kernels import _compat
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.sparse_mqa import sparse_mqa
from tests.kernels.cases import (BF16, F32, FP8, I32, batched, indexer_case, indexer_grad_case,
                                 mha_backward_case, mha_case, sds, sparse_bwd_case, sparse_case,
                                 sparse_fp8_case, sparse_row_sum_case)


CASES = {
    "sparse_mqa_tiny": (sparse_case(3, 5, 80, 64, 100, 7, F32), "sparse_mqa_attention"),
    "sparse_mqa_dsv32": (sparse_case(4, 128, 576, 512, 8192, 2048), "sparse_mqa_attention"),
    "sparse_mqa_tiny_fp8": (sparse_fp8_case(3, 5, 64, 16, 100, 7, F32), "sparse_mqa_attention"),
    "sparse_mqa_dsv32_fp8": (sparse_fp8_case(4, 128, 512, 64, 8192, 2048),
                             "sparse_mqa_attention"),
    # DeepSeek-V4-Flash: 512-wide K=V rows (rope inside, so L = d_v), the window's 128 rows and
    # CSA's top-512 compressed entries; its indexer scores 128-wide compressed keys.
    "sparse_mqa_v4flash_window": (sparse_case(4, 64, 512, 512, 132, 128), "sparse_mqa_attention"),
    "sparse_mqa_v4flash_csa": (sparse_case(4, 64, 512, 512, 16384, 512), "sparse_mqa_attention"),
    "indexer_v4flash_bf16": (indexer_case(128, 64, 128, 16384), "indexer_logits"),
    "indexer_tiny_fp32": (indexer_case(37, 4, 32, 150, F32), "indexer_logits"),
    "indexer_dsv32_bf16": (indexer_case(128, 64, 128, 4096), "indexer_logits"),
    "indexer_dsv32_fp8": (indexer_case(128, 64, 128, 4096, FP8, k_scale=True), "indexer_logits"),
    "indexer_pool_tiny_fp32": (indexer_case(37, 4, 32, 150, F32, pool_rows=300), "indexer_logits"),
    "indexer_pool_dsv32_bf16": (indexer_case(128, 64, 128, 4096, pool_rows=65536),
                                "indexer_logits"),
    "indexer_pool_dsv32_fp8": (indexer_case(128, 64, 128, 4096, FP8, k_scale=True,
                                            pool_rows=65536), "indexer_logits"),
    "indexer_dq_tiny_fp32": (indexer_grad_case("dq", 37, 4, 32, 150, F32), "indexer_logits_dq"),
    "indexer_dk_tiny_fp32": (indexer_grad_case("dk", 37, 4, 32, 150, F32), "indexer_logits_dk"),
    "indexer_dq_dsv32_bf16": (indexer_grad_case("dq", 128, 64, 128, 4096), "indexer_logits_dq"),
    "indexer_dk_dsv32_bf16": (indexer_grad_case("dk", 128, 64, 128, 4096), "indexer_logits_dk"),
    "indexer_dq_glm5_bf16": (indexer_grad_case("dq", 128, 32, 128, 4096), "indexer_logits_dq"),
    "indexer_dk_glm5_bf16": (indexer_grad_case("dk", 128, 32, 128, 4096), "indexer_logits_dk"),
    "indexer_dq_dsv32_fp8": (indexer_grad_case("dq", 128, 64, 128, 4096, FP8, k_scale=True),
                             "indexer_logits_dq"),
    "indexer_dq_pool_tiny_fp32": (indexer_grad_case("dq", 37, 4, 32, 150, F32, pool_rows=300),
                                  "indexer_logits_dq"),
    "indexer_dk_pool_tiny_fp32": (indexer_grad_case("dk", 37, 4, 32, 150, F32, pool_rows=300),
                                  "indexer_logits_dk"),
    "indexer_dq_pool_dsv32_bf16": (indexer_grad_case("dq", 128, 64, 128, 4096, pool_rows=65536),
                                   "indexer_logits_dq"),
    "indexer_dk_pool_dsv32_bf16": (indexer_grad_case("dk", 128, 64, 128, 4096, pool_rows=65536),
                                   "indexer_logits_dk"),
    "mha_tiny": (mha_case(37, 150, 2, 48, 32, F32), "dense_mha_prefill"),
    "mha_dsv32": (mha_case(512, 512, 128, 192, 128), "dense_mha_prefill"),
    "mha_glm5": (mha_case(512, 512, 64, 256, 256), "dense_mha_prefill"),
    "masked_mha_tiny": (mha_case(37, 150, 2, 48, 32, F32, topk=7), "masked_mha_prefill"),
    "masked_mha_dsv32": (mha_case(4096, 4096, 128, 192, 128, topk=2048), "masked_mha_prefill"),
    "masked_mha_glm5": (mha_case(4096, 4096, 64, 256, 256, topk=2048), "masked_mha_prefill"),
    "segmented_mha_dsv32": (mha_case(512, 512, 128, 192, 128, segmented=True),
                            "segmented_mha_prefill"),
    # The sparse MQA backward: DeepSeek-V3.2 (H 128) and GLM-5 (H 64) share the 576/512 rows.
    "sparse_mqa_dq_tiny": (sparse_bwd_case("dq", 3, 5, 80, 64, 100, 7, F32), "sparse_mqa_dq"),
    "sparse_mqa_dq_dsv32": (sparse_bwd_case("dq", 4, 128, 576, 512, 8192, 2048), "sparse_mqa_dq"),
    "sparse_mqa_dq_glm5": (sparse_bwd_case("dq", 4, 64, 576, 512, 8192, 2048), "sparse_mqa_dq"),
    "sparse_mqa_dq_dsv32_fp8": (sparse_bwd_case("dq", 4, 128, 576, 512, 8192, 2048, fp8=True),
                                "sparse_mqa_dq"),
    "sparse_mqa_drows_tiny": (sparse_bwd_case("drows", 3, 5, 80, 64, 100, 7, F32),
                              "sparse_mqa_drows"),
    "sparse_mqa_drows_dsv32": (sparse_bwd_case("drows", 4, 128, 576, 512, 8192, 2048),
                               "sparse_mqa_drows"),
    "sparse_mqa_drows_glm5": (sparse_bwd_case("drows", 4, 64, 576, 512, 8192, 2048),
                              "sparse_mqa_drows"),
    "sparse_mqa_row_sum_tiny": (sparse_row_sum_case(3, 7, 100, 80), "sparse_mqa_row_sum"),
    "sparse_mqa_row_sum_dsv32": (sparse_row_sum_case(227, 2048, 8192), "sparse_mqa_row_sum"),
}

# The backward: one VJP is the forward and two kernels (dq; dk and dv).
BACKWARD_CASES = {
    "mha_bwd_tiny": (mha_backward_case(37, 150, 2, 48, 32, F32), "dense_mha"),
    "mha_bwd_dsv32": (mha_backward_case(512, 512, 128, 192, 128), "dense_mha"),
    "mha_bwd_glm5": (mha_backward_case(512, 512, 64, 256, 256), "dense_mha"),
    "masked_mha_bwd_tiny": (mha_backward_case(37, 150, 2, 48, 32, F32, topk=7), "masked_mha"),
    "masked_mha_bwd_dsv32": (mha_backward_case(4096, 4096, 128, 192, 128, topk=2048),
                             "masked_mha"),
    "masked_mha_bwd_glm5": (mha_backward_case(4096, 4096, 64, 256, 256, topk=2048),
                            "masked_mha"),
    # vmap (the backends' batch) becomes a grid axis of each kernel, not a loop of kernels.
    "mha_bwd_batched": (batched(mha_backward_case(64, 100, 4, 192, 128), 3), "dense_mha"),
    "masked_mha_bwd_batched": (batched(mha_backward_case(64, 100, 4, 192, 128, topk=16), 3),
                               "masked_mha"),
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

  @parameterized.named_parameters((name, *case) for name, case in BACKWARD_CASES.items())
  def test_backward_lowers_to_triton_calls(self, case, prefix):
    fn, args = case
    calls, names = triton_kernel_names(_compat.lower_for_cuda(fn, *args))
    self.assertEqual(calls, 3)
    for suffix in ("prefill", "dq", "dkv"):
      self.assertIn(f"{prefix}_{suffix}", names)

  @parameterized.named_parameters(
      ("sparse_mqa", "sparse_mqa", "sparse_mqa_attention"),
      ("sparse_mqa_fp8", "sparse_mqa_fp8", "sparse_mqa_attention"),
      ("indexer_logits", "indexer_logits", "indexer_logits"),
      ("indexer_logits_fp8", "indexer_logits_fp8", "indexer_logits"),
      ("indexer_logits_pool", "indexer_logits_pool", "indexer_logits"),
      ("indexer_logits_pool_fp8", "indexer_logits_pool_fp8", "indexer_logits"),
      ("dense_mha", "dense_mha", "dense_mha_prefill"),
      ("masked_mha", "masked_mha", "masked_mha_prefill"),
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
      pooled = "pool" in op  # one pool of 5000 key rows, 300 row ids per sequence
      keys = (5000,) if pooled else (B, 300)
      args = (sds((B, 4, 64, 128), dtype), sds((*keys, 128), dtype), sds((B, 4, 64), F32),
              sds((B, 4), I32), sds((B, 4), I32),
              sds(keys, F32) if dtype == FP8 else None,  # the per-key scales travel too
              sds((B, 300), I32) if pooled else None)
      fn = lambda *a: backend.indexer_logits(*a[:5], k_scale_BS=a[5], key_rows_BS=a[6])
    elif op == "dense_mha":
      fn = lambda q, k, v, off, n: backend.dense_mha(q, k, v, sm_scale=0.1, q_offset_B=off, kv_len_B=n)
      args = (sds((B, 64, 4, 192), BF16), sds((B, 100, 4, 192), BF16), sds((B, 100, 4, 128), BF16),
              sds((B,), I32), sds((B,), I32))
    else:
      fn = lambda q, k, v, idx, off, n: backend.masked_mha(q, k, v, idx, sm_scale=0.1,
                                                           q_offset_B=off, kv_len_B=n)
      args = (sds((B, 64, 4, 192), BF16), sds((B, 100, 4, 192), BF16), sds((B, 100, 4, 128), BF16),
              sds((B, 64, 16), I32), sds((B,), I32), sds((B,), I32))
    calls, names = triton_kernel_names(_compat.lower_for_cuda(fn, *args))
    self.assertEqual(calls, 1)  # vmap becomes a grid axis, not a loop of kernels
    self.assertIn(kernel_name, names)

  def test_indexer_gradient_lowers_to_its_three_kernels(self):
    fn, args = indexer_case(128, 64, 128, 4096)
    loss = lambda q, k, w, *rest: fn(q, k, w, *rest).max(axis=-1).sum()
    calls, names = triton_kernel_names(
        _compat.lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), *args))
    self.assertEqual(calls, 3)
    self.assertEqual(sorted(set(names) & {"indexer_logits", "indexer_logits_dq", "indexer_logits_dk"}),
                     ["indexer_logits", "indexer_logits_dk", "indexer_logits_dq"])

  def test_masked_kernel_declares_the_causal_pairs(self):
    """An upper bound (skipped blocks are data-dependent) that the routing threshold reads."""
    fn, args = CASES["masked_mha_dsv32"][0]
    # The kernel sits inside dense_mha's custom_vjp.
    [eqn] = [e for e, _ in walk_equations(jax.make_jaxpr(fn)(*args).jaxpr)
             if e.primitive.name == "pallas_call"]
    self.assertEqual(eqn.params["name"], "masked_mha_prefill")
    self.assertEqual(eqn.params["cost_estimate"].flops, 2 * 128 * (192 + 128) * 4096 * 4097 // 2)

  def test_declared_cost_estimate(self):
    fn, args = CASES["sparse_mqa_dsv32"][0]
    jaxpr = jax.make_jaxpr(fn)(*args)  # the kernel sits inside the op's custom_vjp
    [eqn] = [e for e, _ in walk_equations(jaxpr) if e.primitive.name == "pallas_call"]
    self.assertEqual(eqn.params["name"], "sparse_mqa_attention")
    self.assertEqual(eqn.params["cost_estimate"].flops, 2 * 4 * 2048 * 128 * (576 + 512))

  def test_sparse_mqa_gradient_lowers_to_its_kernels_without_scatter(self):
    """The VJP of the batched op: forward, dq, drows and row-sum kernels; the row gradients are
    summed without a scatter (XLA's GPU scatter-add uses atomics, in no fixed order)."""
    fn = jax.vmap(functools.partial(sparse_mqa, sm_scale=0.1, d_v=512))
    grad = jax.grad(lambda q, kv, idx: sum(x.sum() for x in fn(q, kv, idx)), argnums=(0, 1))
    hlo = _compat.lower_for_cuda(grad, sds((2, 8, 128, 576), BF16), sds((2, 4096, 576), BF16),
                                 sds((2, 8, 2048), I32))
    calls, names = triton_kernel_names(hlo)
    kernels = ["sparse_mqa_attention", "sparse_mqa_dq", "sparse_mqa_drows", "sparse_mqa_row_sum"]
    self.assertEqual(calls, len(kernels))
    self.assertEqual(sorted(set(names) & set(kernels)), kernels)
    self.assertFalse("stablehlo.scatter" in hlo, "the row gradients go through a scatter")
