"""The Mosaic GPU kernels against the Pallas-Triton ones, side by side (issue 36).

    python benchmarks/mosaic_gpu.py            # full DeepSeek-V3.2 / GLM-5 shapes on a GPU
    python benchmarks/mosaic_gpu.py --smoke    # small shapes; automatic off-GPU (interpreters)

Each shape runs the same inputs (``benchmarks/kernels.py``'s shapes and inputs) through both
forward kernels: the Mosaic one is checked against the float32 reference (rel. error < 2e-2,
bf16) and then both are timed in one pass (median of ``--iters`` warm calls), so the ratio
is measured side by side. ``backend="auto"`` stays Pallas-Triton until this table says the
Mosaic kernels win (mla_jax/backends/gpu_support.py). Exits 1 on a mismatch or a failure.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks import kernels  # noqa: E402
from benchmarks.kernels import _indexer, _sparse  # noqa: E402
from mla_jax.backends import gpu_support  # noqa: E402

SHAPES = {
    "full": [
        _sparse("dsv32_sparse_prefill_8k", T=1024, S=8192),
        _sparse("dsv32_sparse_prefill_64k", T=1024, S=65536),
        _sparse("glm5_sparse_prefill_8k", T=1024, S=8192, H=64),
        _sparse("dsv32_decode_b64_32k", T=1, S=32768, B=64),
        _sparse("dsv32_decode_b64_32k_fp8", T=1, S=32768, B=64, fp8=True),
        _sparse("glm5_decode_b64_32k_fp8", T=1, S=32768, H=64, B=64, fp8=True),
        _indexer("dsv32_indexer_prefill_8k_bf16", T=1024, S=8192),
        _indexer("dsv32_indexer_prefill_8k_fp8", T=1024, S=8192, fp8=True),
        _indexer("glm5_indexer_prefill_8k_bf16", T=1024, S=8192, G=32),
    ],
    # Widths the Mosaic kernels take (64 heads, 64-column multiples), small enough to interpret.
    "smoke": [
        _sparse("small_sparse", T=2, S=256, H=64, D=192, d_v=128, K=64),
        _sparse("small_decode_b2_fp8", T=1, S=256, H=64, D=192, d_v=128, K=64, B=2, fp8=True),
        _indexer("small_indexer", T=4, S=128, G=8, I=64),
        _indexer("small_indexer_fp8", T=4, S=128, G=8, I=128, fp8=True),
    ],
}


def mosaic_kernel(shape, on_gpu: bool):
  """The Mosaic GPU forward over the arguments ``kernels.build`` makes for ``shape``."""
  from pallas_kernels.mosaic_gpu._compat import interpret_params
  from pallas_kernels.mosaic_gpu.indexer_logits import indexer_logits_mosaic
  from pallas_kernels.mosaic_gpu.sparse_mqa import sparse_mqa_mosaic

  interpret = None if on_gpu else interpret_params()
  d = shape.dims
  if shape.kernel == "sparse_mqa":
    return jax.vmap(functools.partial(sparse_mqa_mosaic, sm_scale=d["D"] ** -0.5, d_v=d["d_v"],
                                      interpret=interpret))
  return functools.partial(indexer_logits_mosaic, interpret=interpret)


def measure(shape, on_gpu: bool, iters: int) -> tuple[str, bool]:
  triton, reference, args, flops, nbytes = kernels.build(shape, interpret=not on_gpu)
  mosaic = mosaic_kernel(shape, on_gpu)
  try:
    ok, err = kernels.compare(mosaic, reference, args)
    checked = f"{'ok' if ok else 'MISMATCH'} {err}"
  except Exception as e:  # noqa: BLE001 -- one shape's failure is reported, the rest still run
    print(f"<!-- {kernels._failure(shape.name, e)} -->", flush=True)
    ok, checked = False, "FAILED"
  t_mosaic = kernels._time_or_none(mosaic, args, iters, f"{shape.name} mosaic") if ok else None
  t_triton = kernels._time_or_none(triton, args, iters, f"{shape.name} triton") if ok else None
  ms = lambda t: "n/a" if t is None else f"{t * 1e3:.3f}"
  ratio = "n/a" if None in (t_mosaic, t_triton) else f"{t_triton / t_mosaic:.2f}x"
  gbs = "n/a" if t_mosaic is None else f"{nbytes / t_mosaic / 1e9:.0f}"
  tflops = "n/a" if t_mosaic is None else f"{flops / t_mosaic / 1e12:.1f}"
  return (f"| {shape.name} | {checked} | {ms(t_triton)} | {ms(t_mosaic)} | {ratio} | {tflops} "
          f"| {gbs} |"), ok and t_mosaic is not None


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="small shapes (automatic without a GPU)")
  parser.add_argument("--iters", type=int, default=None, help="timed calls per kernel")
  parser.add_argument("--only", default="", help="substring filter on shape names")
  args = parser.parse_args(argv)
  if not (support := gpu_support.mosaic_gpu()).available:
    sys.exit(f"mosaic-gpu: {support.reason}")
  on_gpu = jax.devices()[0].platform == "gpu"
  smoke = args.smoke or not on_gpu
  iters = (2 if smoke else 50) if args.iters is None else args.iters
  if iters < 1:
    parser.error("--iters must be >= 1")
  shapes = [s for s in SHAPES["smoke" if smoke else "full"] if args.only in s.name]
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
        f"{'interpreters, ' if not on_gpu else ''}{'smoke' if smoke else 'full'} shapes; "
        f"median of {iters}\n")
  print("| shape | Mosaic check: rel. err vs float32 | Triton ms | Mosaic ms "
        "| speedup (Triton ms / Mosaic ms) | Mosaic TFLOP/s | Mosaic GB/s |")
  print("|---|---|---|---|---|---|---|")
  failed = 0
  for shape in shapes:
    row, ok = measure(shape, on_gpu, iters)
    failed += not ok
    print(row, flush=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
