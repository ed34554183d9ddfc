"""The sm_90a compile check of the Mosaic GPU kernels (issues 36, 47): each kernel of
``benchmarks/compile_report.py`` at DeepSeek-V3.2, GLM-5 and DeepSeek-V4-Flash shapes compiled
for an H200 without a GPU (``tests/kernels/sm90_compile.py``), then ptxas (jax's, else
/usr/local/cuda's): no spills, shared memory within the H200's 227 KiB, wgmma dots. Skipped,
with the reason, without the pinned jaxlib's CUDA plugin or a ptxas. CI also runs the report
under a second ptxas (.ci/run).
"""

import pytest

from pallas_kernels.mosaic_gpu._compat import unsupported_reason
from tests.kernels import sm90_compile

if (_reason := unsupported_reason() or sm90_compile.unavailable_reason()) is not None:
  pytest.skip(_reason, allow_module_level=True)

from benchmarks import compile_report  # noqa: E402

MOSAIC = [name for name in compile_report._cases() if name.startswith("mosaic_")]


@pytest.mark.parametrize("name", MOSAIC)
def test_compiles_for_sm90a_and_passes_its_checks(name):
  """No spill, shared memory within the H200's, wgmma dots; the sparse MQA kernels of bf16
  rows warp-specialised, prefill at most 2 CTAs per token, batch-1 decode at least 64."""
  case = compile_report._cases()[name]
  fn, args = case.build()
  (kernel,) = sm90_compile.compile_kernels(fn, *args)
  assert case.problems(kernel, sm90_compile.run_ptxas(sm90_compile.default_ptxas(), kernel)) == []


def test_the_report_fails_a_kernel_that_spills_or_breaks_its_structure(monkeypatch, capsys):
  """``compile_report.py --check`` (CI's step) exits 1 naming what failed."""
  monkeypatch.setenv("XLA_FLAGS", "")  # main() points XLA at its ptxas wrapper; restored after
  # A compiled kernel (a second compile of one in this process would find Mosaic's cache and
  # dump nothing): one warpgroup, 4 CTAs a token, spilling.
  kernel = sm90_compile.Kernel("k", "mosaic", "wgmma.mma_async", 1024, (1024, 4), 128)
  monkeypatch.setattr(sm90_compile, "compile_kernels", lambda fn, *args: [kernel])
  spilling = lambda ptxas, kernel: sm90_compile.PtxasReport("13.x", 255, 96, 96, "sm_90a")
  monkeypatch.setattr(sm90_compile, "run_ptxas", spilling)
  assert compile_report.main(["--only", "mosaic_sparse_mqa_prefill_8k_glm5"]) == 0
  assert compile_report.main(["--only", "mosaic_sparse_mqa_prefill_8k_glm5", "--check"]) == 1
  out = capsys.readouterr().out
  assert "| mosaic_sparse_mqa_prefill_8k_glm5 | 13.x | 255 | 192 |" in out
  for problem in ("spills 192 B", "not warp-specialised", "4 CTAs per token"):
    assert f"mosaic_sparse_mqa_prefill_8k_glm5: ptxas 13.x: {problem}" in out
