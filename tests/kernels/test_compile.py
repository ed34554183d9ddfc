"""Compiles each kernel's Triton IR to sm_90a PTX/cubin with pip ``triton``; fails on spills.

No GPU needed (docs/design.md §8). XLA compiles the same TTIR with its own Triton fork, so
this is a close proxy for register pressure, not the final word. Run the report with

    python -m tests.kernels.test_compile
"""

import os
import re
import subprocess
import tempfile
import types

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from pallas_kernels import _compat  # noqa: E402
from pallas_kernels.sparse_mqa_backward import ROW_SUM_STAGES, ROW_SUM_WARPS  # noqa: E402
from pallas_kernels.block_config import (  # noqa: E402
    DenseMHAKernelConfig, IndexerLogitsKernelConfig,
    SparseMQABackwardConfig, SparseMQAKernelConfig,
)
from tests.kernels.cases import (  # noqa: E402
    indexer_case, indexer_grad_case, mha_backward_case, mha_case, sparse_bwd_case, sparse_case,
    sparse_fp8_case, sparse_row_sum_case,
)

FP8 = jnp.float8_e4m3fn
# name -> (lowering case, default config the kernel picks for that shape)
KERNELS = {
    "sparse_mqa_dsv32_h128_576_512_k2048": (
        sparse_case(4, 128, 576, 512, 65536, 2048), SparseMQAKernelConfig.default_for(128, 2048, 512)),
    "sparse_mqa_dsv32_fp8_rows_h128_k2048": (
        sparse_fp8_case(4, 128, 512, 64, 65536, 2048), SparseMQAKernelConfig.default_for(128, 2048, 512)),
    # DeepSeek-V4-Flash (docs/models.md): H 64 over 512-wide K=V rows, CSA's top-512 entries
    # and the 128-row window; the indexer over 16K compressed keys (64K tokens at m = 4).
    "sparse_mqa_v4flash_h64_512_512_k512": (
        sparse_case(4, 64, 512, 512, 16384, 512), SparseMQAKernelConfig.default_for(64, 512, 512)),
    "sparse_mqa_v4flash_h64_512_512_k128": (
        sparse_case(4, 64, 512, 512, 132, 128), SparseMQAKernelConfig.default_for(64, 128, 512)),
    "indexer_v4flash_g64_i128_bf16": (
        indexer_case(512, 64, 128, 16384), IndexerLogitsKernelConfig.default_for(512, 16384)),
    "indexer_dsv32_g64_i128_bf16": (
        indexer_case(512, 64, 128, 8192), IndexerLogitsKernelConfig.default_for(512, 8192)),
    "indexer_dsv32_g64_i128_fp8": (
        indexer_case(512, 64, 128, 8192, FP8, k_scale=True), IndexerLogitsKernelConfig.default_for(512, 8192)),
    # Paged: the keys read in place from a 64K-row pool through each column's row id.
    "indexer_dsv32_g64_i128_bf16_pool": (
        indexer_case(512, 64, 128, 8192, pool_rows=65536), IndexerLogitsKernelConfig.default_for(512, 8192)),
    "indexer_dsv32_g64_i128_fp8_pool": (
        indexer_case(512, 64, 128, 8192, FP8, k_scale=True, pool_rows=65536),
        IndexerLogitsKernelConfig.default_for(512, 8192)),
    # The indexer backward (training): dq/dw and dk, DeepSeek-V3.2 (G 64) and GLM-5 (G 32).
    **{f"indexer_{kernel}_{model}_g{G}_i128_{suffix}": (
        indexer_grad_case(kernel, 512, G, 128, 8192, dtype, k_scale=dtype == FP8, pool_rows=pool),
        IndexerLogitsKernelConfig.backward_for(512, 8192))
       for kernel in ("dq", "dk") for model, G in (("dsv32", 64), ("glm5", 32))
       for suffix, dtype, pool in (("bf16", jnp.bfloat16, None), ("fp8", FP8, None),
                                   ("bf16_pool", jnp.bfloat16, 65536))
       if not (kernel == "dk" and dtype == FP8)},  # fp8 keys are constants: no dk
    "dense_mha_dsv32_qk192_v128": (
        mha_case(2048, 2048, 128, 192, 128), DenseMHAKernelConfig.default_for(2048, 2048, 192, 128)),
    "dense_mha_glm5_qk256_v256": (
        mha_case(2048, 2048, 64, 256, 256), DenseMHAKernelConfig.default_for(2048, 2048, 256, 256)),
    # The masked route's window (top-k 2048 < S <= 8192): the bit test on top of the causal body.
    "masked_mha_dsv32_qk192_v128_k2048": (
        mha_case(4096, 4096, 128, 192, 128, topk=2048),
        DenseMHAKernelConfig.default_for(4096, 4096, 192, 128)),
    "masked_mha_glm5_qk256_v256_k2048": (
        mha_case(4096, 4096, 64, 256, 256, topk=2048),
        DenseMHAKernelConfig.default_for(4096, 4096, 256, 256)),
    # The sparse MQA backward kernels (DeepSeek-V3.2 H 128, GLM-5 H 64; both 576/512 rows).
    **{f"sparse_mqa_{kernel}_{model}_h{H}_576_512_k2048{'_fp8_rows' * fp8}": (
        sparse_bwd_case(kernel, 4, H, 576, 512, 65536, 2048, fp8=fp8),
        getattr(SparseMQABackwardConfig.default_for(H, 2048, 512), kernel))
       for kernel, fp8 in (("dq", False), ("dq", True), ("drows", False))
       for model, H in (("dsv32", 128), ("glm5", 64))},
    # The backward's row sum at the default chunk (227 tokens of 2048 slots) into 64K rows.
    "sparse_mqa_row_sum_576_t227_k2048": (
        sparse_row_sum_case(227, 2048, 65536),
        types.SimpleNamespace(num_warps=ROW_SUM_WARPS, num_stages=ROW_SUM_STAGES)),
}


WITHOUT_DOTS = {"sparse_mqa_row_sum_576_t227_k2048"}  # sums only, no MMA expected


# The backward kernels: name -> (lowering case, backward config, kernel name).
_MHA_BWD = dict(dsv32=(4096, 128, 192, 128), glm5=(4096, 64, 256, 256))
BACKWARD_KERNELS = {
    f"{kernel}_{model}_qk{D}_v{V}": (
        mha_backward_case(S, S, H, D, V, topk=2048 if kernel.startswith("masked") else None),
        DenseMHAKernelConfig.backward_for(S, S, D, V)[kernel.endswith("dkv")], kernel)
    for model, (S, H, D, V) in _MHA_BWD.items()
    for kernel in ("dense_mha_dq", "dense_mha_dkv", "masked_mha_dq", "masked_mha_dkv")
}


def compile_kernel(case, config, kernel=None):
  """TTIR -> PTX (pip triton) -> cubin (ptxas-blackwell -v); returns a resource dict.

  ``kernel`` names the one to compile when the case lowers several (a backward pass).
  """
  os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.getcwd(), ".triton_cache"))
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  fn, args = case
  with _compat.capture_ttir() as modules:
    _compat.lower_for_cuda(fn, *args)
  [(name, ttir)] = [m for m in modules if kernel in (None, m[0])]
  with tempfile.TemporaryDirectory() as tmp:
    ttir_path, ptx_path = os.path.join(tmp, "kernel.ttir"), os.path.join(tmp, "kernel.ptx")
    with open(ttir_path, "w") as f:
      f.write(ttir)  # triton.compile wants the text form, not bytecode
    compiled = triton.compile(
        ttir_path, target=GPUTarget("cuda", 90, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
    ptx = compiled.asm["ptx"]
    with open(ptx_path, "w") as f:
      f.write(ptx)
    # The wheel's plain ptxas (CUDA 12.9) rejects Triton 3.9's PTX 9.4; ptxas-blackwell reads it.
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    proc = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", os.path.join(tmp, "kernel.cubin")],
        capture_output=True, text=True, check=True,
    )
  log = proc.stdout + proc.stderr
  return dict(
      name=name,
      registers=int(re.search(r"Used (\d+) registers", log).group(1)),
      spill_stores=int(re.search(r"(\d+) bytes spill stores", log).group(1)),
      spill_loads=int(re.search(r"(\d+) bytes spill loads", log).group(1)),
      smem=compiled.metadata.shared,
      mma="wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none",
  )


def report_line(label, config, r):
  blocks = ", ".join(f"{k}={v}" for k, v in vars(config).items())
  return (f"| {label} | {blocks} | {r['registers']} | {r['smem']} | "
          f"{r['spill_stores']}/{r['spill_loads']} | {r['mma']} |")


REPORT_HEADER = ("| kernel | config | registers | shared mem (B) | spill st/ld (B) | mma |\n"
                 "|---|---|---|---|---|---|")


@pytest.mark.parametrize("label", list(KERNELS))
def test_compiles_without_spills(label):
  case, config = KERNELS[label]
  result = compile_kernel(case, config)
  print("\n" + report_line(label, config, result))
  assert result["spill_stores"] == 0 and result["spill_loads"] == 0, result
  if label not in WITHOUT_DOTS:
    assert result["mma"] != "none", "the dots did not become tensor-core MMAs"


@pytest.mark.parametrize("label", list(BACKWARD_KERNELS))
def test_backward_compiles_without_spills(label):
  case, config, kernel = BACKWARD_KERNELS[label]
  result = compile_kernel(case, config, kernel)
  print("\n" + report_line(label, config, result))
  assert result["name"] == kernel
  assert result["spill_stores"] == 0 and result["spill_loads"] == 0, result
  assert result["mma"] != "none", "the dots did not become tensor-core MMAs"


if __name__ == "__main__":
  print(REPORT_HEADER)
  for label, (case, config) in KERNELS.items():
    print(report_line(label, config, compile_kernel(case, config)), flush=True)
  for label, (case, config, kernel) in BACKWARD_KERNELS.items():
    print(report_line(label, config, compile_kernel(case, config, kernel)), flush=True)
