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
def test_compiles_for_sm90a_without_spills(name):
  case = compile_report._cases()[name]
  fn, args = case.build()
  (kernel,) = sm90_compile.compile_kernels(fn, *args)
  result = sm90_compile.run_ptxas(sm90_compile.default_ptxas(), kernel)
  assert kernel.backend == "mosaic" and result.arch == "sm_90a"
  assert result.spill_bytes == 0, result
  assert kernel.shared_bytes <= sm90_compile.SMEM_LIMIT, kernel.shared_bytes
  assert 0 < result.registers <= 255
  assert kernel.wgmma > 0
  if name.startswith("mosaic_sparse_mqa") and not name.endswith("fp8"):
    # Warp-specialised (issue 47): explicit budgets for the producer and both consumers,
    # each selected row gathered at most twice per token (the head blocks of DSv3.2).
    assert len(kernel.setmaxnreg) == 3 and kernel.threads == 384
    if "prefill" in name:
      assert kernel.ctas <= 2 * case.tokens
  if name == "mosaic_sparse_mqa_decode_b1_32k":
    assert kernel.ctas >= 64   # the top-k split over the GPU


def test_the_report_fails_on_a_mosaic_spill(monkeypatch, capsys):
  """``compile_report.py --fail-on-spill`` (CI's step) exits 1 when a Mosaic kernel spills."""
  monkeypatch.setenv("XLA_FLAGS", "")  # main() points XLA at its ptxas wrapper; restored after
  # A compiled kernel (a second compile of one in this process would find Mosaic's cache and
  # dump nothing) that spills.
  kernel = sm90_compile.Kernel("k", "mosaic", "wgmma.mma_async", 1024, (2, 1024), 384)
  monkeypatch.setattr(sm90_compile, "compile_kernels", lambda fn, *args: [kernel])
  spilling = lambda ptxas, kernel: sm90_compile.PtxasReport("13.x", 255, 96, 96, "sm_90a")
  monkeypatch.setattr(sm90_compile, "run_ptxas", spilling)
  assert compile_report.main(["--only", "mosaic_indexer_prefill_8k_glm5", "--fail-on-spill"]) == 1
  out = capsys.readouterr().out
  assert "| mosaic_indexer_prefill_8k_glm5 | 13.x | 255 | 192 |" in out
  assert "mosaic_indexer_prefill_8k_glm5 under ptxas 13.x: 192 B" in out
