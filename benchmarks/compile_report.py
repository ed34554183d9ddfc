"""Every GPU kernel compiled for an H200 (sm_90a) at DeepSeek-V3.2 shapes, on a CPU host: one
Markdown row per kernel, shape and ptxas (docs/kernels.md, "The compile table").

    python benchmarks/compile_report.py                        # jax's ptxas, else CUDA's
    python benchmarks/compile_report.py --ptxas /usr/local/cuda/bin/ptxas \\
        --ptxas "$(python -c 'import nvidia.cu13, os; print(os.path.dirname(nvidia.cu13.__file__))')/bin/ptxas"
    python benchmarks/compile_report.py --check --only mosaic

Needs jax 0.12.0.1 and its CUDA PJRT plugin (``jax-cuda13-pjrt`` / ``-plugin``, compile only:
no GPU, no driver; ``tests/kernels/sm90_compile.py``); without them it says why and exits 0.
Each program is compiled once; every ``--ptxas`` then reports on the same PTX (the Triton
kernels' PTX is XLA's, emitted for the first ``--ptxas``). Columns:
- registers and spill bytes (stores + loads) a thread, from ``ptxas -v``;
- shared bytes a CTA: Mosaic's SMEM scratch, Triton's dynamic shared memory;
- wgmma: ``wgmma.mma_async`` instructions in the PTX (``mma.sync`` when the dots are those);
- setmaxnreg: each register budget the PTX sets (warp-specialised kernels);
- CTAs per token: the grid's CTAs over the tokens of the call (batch x tokens).
``--check`` (CI) exits 1 when a Mosaic GPU kernel spills under any ``--ptxas``, or fails its
case's other checks (``Case.problems``: shared memory, wgmma, warp specialisation, CTAs per
token).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.kernels import sm90_compile  # noqa: E402  (imports jax, compiles nothing)

HEADER = ("| kernel | ptxas | registers | spill bytes | shared bytes | wgmma | setmaxnreg "
          "| CTAs per token |\n|---|---|---|---|---|---|---|---|")


@dataclasses.dataclass(frozen=True)
class Case:
  build: object   # () -> (fn, abstract args), built lazily (imports the kernels)
  tokens: int     # tokens of the call, batch included
  # What ``--check`` holds a Mosaic GPU kernel to, beside no spill, shared memory within
  # the H200's and wgmma dots: warp-specialised (three warpgroups, each with its register
  # budget), and the bounds on CTAs per token.
  warp_specialised: bool = False
  max_ctas_per_token: float | None = None
  min_ctas_per_token: float | None = None

  def problems(self, kernel: sm90_compile.Kernel, r: sm90_compile.PtxasReport) -> list[str]:
    """What fails ``--check`` in this kernel under this ptxas (Triton kernels: nothing)."""
    if kernel.backend != "mosaic":
      return []
    per_token = kernel.ctas / self.tokens
    checks = {
        f"spills {r.spill_bytes} B": r.spill_bytes == 0,
        f"compiled for {r.arch}": r.arch == "sm_90a",
        f"{kernel.shared_bytes:,} B of shared memory": kernel.shared_bytes <= sm90_compile.SMEM_LIMIT,
        "no wgmma": kernel.wgmma > 0,
        f"not warp-specialised ({kernel.threads} threads, setmaxnreg {kernel.setmaxnreg})":
            not self.warp_specialised or (kernel.threads == 384 and len(kernel.setmaxnreg) == 3),
        f"{per_token:g} CTAs per token":
            (self.max_ctas_per_token is None or per_token <= self.max_ctas_per_token)
            and (self.min_ctas_per_token is None or per_token >= self.min_ctas_per_token),
    }
    return [f"ptxas {r.ptxas}: {what}" for what, ok in checks.items() if not ok]


def _cases() -> dict[str, Case]:
  from tests.kernels import cases as c

  # Issue 47: each selected row gathered at most twice per token (the head blocks of DSv3.2's
  # 128 heads), and a batch-1 decode token over 64 CTAs at least.
  prefill = dict(warp_specialised=True, max_ctas_per_token=2)
  mosaic = {
      # DeepSeek-V3.2: 128 heads over 576-wide rows (512 values), top-k 2048; prefill chunks of
      # 1,024 tokens over an 8K cache, decode over one 32K pool.
      "mosaic_sparse_mqa_prefill_8k": Case(lambda: c.mosaic_sparse_case(1024, 128, 576, 512, 8192, 2048), 1024, **prefill),
      "mosaic_sparse_mqa_prefill_8k_fp8": Case(lambda: c.mosaic_sparse_case(1024, 128, 576, 512, 8192, 2048, fp8=True), 1024),
      "mosaic_sparse_mqa_prefill_8k_glm5": Case(lambda: c.mosaic_sparse_case(1024, 64, 576, 512, 8192, 2048), 1024, **prefill),
      "mosaic_sparse_mqa_prefill_v4flash": Case(lambda: c.mosaic_sparse_case(1024, 64, 512, 512, 16384, 512), 1024, **prefill),
      "mosaic_sparse_mqa_decode_b1_32k": Case(lambda: c.mosaic_sparse_case(1, 128, 576, 512, 32768, 2048, batch=1), 1, warp_specialised=True, min_ctas_per_token=64),
      "mosaic_sparse_mqa_decode_b64_32k": Case(lambda: c.mosaic_sparse_case(1, 128, 576, 512, 64 * 32768, 2048, batch=64), 64, warp_specialised=True),
      "mosaic_sparse_mqa_decode_b1_32k_fp8": Case(lambda: c.mosaic_sparse_case(1, 128, 576, 512, 32768, 2048, fp8=True, batch=1), 1),
      "mosaic_sparse_mqa_decode_b64_32k_fp8": Case(lambda: c.mosaic_sparse_case(1, 128, 576, 512, 64 * 32768, 2048, fp8=True, batch=64), 64),
      "mosaic_indexer_prefill_8k_bf16": Case(lambda: c.mosaic_indexer_case(1024, 64, 128, 8192), 1024),
      "mosaic_indexer_prefill_8k_fp8": Case(lambda: c.mosaic_indexer_case(1024, 64, 128, 8192, c.FP8), 1024),
      "mosaic_indexer_prefill_8k_glm5": Case(lambda: c.mosaic_indexer_case(1024, 32, 128, 8192), 1024),
      "mosaic_indexer_prefill_8k_pool_bf16": Case(lambda: c.mosaic_indexer_case(1024, 64, 128, 8192, pool_rows=65536), 1024),
      "mosaic_indexer_prefill_8k_pool_fp8": Case(lambda: c.mosaic_indexer_case(1024, 64, 128, 8192, c.FP8, pool_rows=65536), 1024),
  }
  H, D, d_v, K = 128, 576, 512, 2048  # DeepSeek-V3.2
  triton = {
      "triton_sparse_mqa_prefill_8k": Case(lambda: c.sparse_case(1024, H, D, d_v, 8192, K), 1024),
      "triton_sparse_mqa_prefill_8k_fp8": Case(lambda: c.sparse_fp8_case(1024, H, d_v, D - d_v, 8192, K), 1024),
      "triton_sparse_mqa_decode_b1_32k": Case(lambda: c.batched(c.sparse_case(1, H, D, d_v, 32768, K), 1), 1),
      "triton_indexer_prefill_8k_bf16": Case(lambda: c.indexer_case(1024, 64, 128, 8192), 1024),
      "triton_indexer_prefill_8k_fp8": Case(lambda: c.indexer_case(1024, 64, 128, 8192, c.FP8, k_scale=True), 1024),
      "triton_dense_mha_prefill_2k": Case(lambda: c.mha_case(2048, 2048, 128, 192, 128), 2048),
      "triton_masked_mha_prefill_4k": Case(lambda: c.mha_case(4096, 4096, 128, 192, 128, topk=2048), 4096),
      "triton_sparse_mqa_dq_8k": Case(lambda: c.sparse_bwd_case("dq", 1024, H, D, d_v, 8192, K), 1024),
      "triton_sparse_mqa_drows_8k": Case(lambda: c.sparse_bwd_case("drows", 1024, H, D, d_v, 8192, K), 1024),
      "triton_sparse_mqa_row_sum_8k": Case(lambda: c.sparse_row_sum_case(1024, K, 8192), 1024),
      "triton_indexer_dq_8k": Case(lambda: c.indexer_grad_case("dq", 1024, 64, 128, 8192), 1024),
      "triton_indexer_dk_8k": Case(lambda: c.indexer_grad_case("dk", 1024, 64, 128, 8192), 1024),
  }
  return {**mosaic, **triton}


def report(name: str, case: Case, ptxas: list[str]) -> list[tuple[str, sm90_compile.Kernel,
                                                                   sm90_compile.PtxasReport]]:
  fn, args = case.build()
  kernels = sm90_compile.compile_kernels(fn, *args)
  if not kernels:
    raise RuntimeError(f"{name}: no GPU kernel in the compiled program (or compiled before in "
                       "this process: Mosaic GPU then reuses its kernel and dumps nothing)")
  rows = []
  for kernel in kernels:
    label = name if len(kernels) == 1 else f"{name} ({kernel.name})"
    rows += [(label, kernel, sm90_compile.run_ptxas(p, kernel)) for p in ptxas]
  return rows


def row(label: str, kernel: sm90_compile.Kernel, r: sm90_compile.PtxasReport,
        tokens: int) -> str:
  mma = str(kernel.wgmma) if kernel.wgmma or not kernel.mma_sync else f"0 (mma.sync {kernel.mma_sync})"
  budgets = ", ".join(kernel.setmaxnreg) or "none"
  per_token = kernel.ctas / tokens
  ctas = f"{per_token:g}" if per_token >= 1 else f"1/{round(1 / per_token)}"
  return (f"| {label} | {r.ptxas} | {r.registers} | {r.spill_bytes} | {kernel.shared_bytes:,} "
          f"| {mma} | {budgets} | {ctas} |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--ptxas", action="append", default=None,
                      help="a ptxas to report with (repeatable; default: jax's, else CUDA's)")
  parser.add_argument("--only", default="", help="substring filter on kernel names")
  parser.add_argument("--check", action="store_true",
                      help="exit 1 when a Mosaic GPU kernel fails its checks under any --ptxas "
                           "(a spill, shared memory, wgmma, warp specialisation, CTAs per token)")
  args = parser.parse_args(argv)
  ptxas = args.ptxas or [sm90_compile.default_ptxas()]
  missing = [p for p in ptxas if p is None or not os.access(p, os.X_OK)]
  if missing:
    parser.error(f"not an executable ptxas: {missing}")
  # Before jax compiles anything: XLA reads its flags once a process.
  sm90_compile.capture_triton_ptx(ptxas[0])
  from pallas_kernels.mosaic_gpu._compat import unsupported_reason

  if (reason := unsupported_reason() or sm90_compile.unavailable_reason()) is not None:
    print(f"compile report skipped: {reason}")
    return 0
  import jaxlib

  print(f"sm_90a (H200 topology), jaxlib {jaxlib.__version__}; ptxas: "
        + ", ".join(f"{sm90_compile.ptxas_version(p)} ({p})" for p in ptxas) + "\n")
  print(HEADER)
  failed = []
  for name, case in _cases().items():
    if args.only not in name:
      continue
    for label, kernel, r in report(name, case, ptxas):
      print(row(label, kernel, r, case.tokens), flush=True)
      failed += [f"{label}: {problem}" for problem in case.problems(kernel, r)]
  if failed:
    print("\nMosaic GPU kernels that fail their checks:\n" + "\n".join(f"- {f}" for f in failed))
  return 1 if failed and args.check else 0


if __name__ == "__main__":
  sys.exit(main())
