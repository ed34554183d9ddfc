"""The Mosaic GPU kernels against the Pallas-Triton ones and XLA, side by side (issues 36, 47).

    python benchmarks/mosaic_gpu.py            # full DeepSeek-V3.2 / GLM-5 shapes on a GPU
    python benchmarks/mosaic_gpu.py --parts    # what each part of sparse MQA costs
    python benchmarks/mosaic_gpu.py --smoke    # small shapes; automatic off-GPU (interpreters)

Each shape runs the same inputs (``benchmarks/kernels.py``'s shapes and inputs) through the
forward kernels: the Mosaic one is checked against the float32 reference (rel. error < 2e-2,
bf16) and then it, the Triton kernel and XLA's reference are timed in one pass (median of
``--iters`` warm calls), so the ratios are measured side by side. Sparse MQA's top-k split is
``MosaicGpuBackend``'s for the batch.

``--parts`` times the warp-specialised sparse MQA kernel (bf16 rows) whole, without its PV
wgmmas, without its row gather, and without both: what is left when a part is gone says what
that part costs, and which one bounds the kernel (docs/kernels.md, "The cost model").

``backend="auto"`` stays Pallas-Triton until this table says the Mosaic kernels win
(mla_jax/backends/gpu_support.py). Exits 1 on a mismatch or a failure.
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
        _sparse("dsv32_sparse_prefill_32k", T=1024, S=32768),
        _sparse("dsv32_sparse_prefill_64k", T=1024, S=65536),
        _sparse("glm5_sparse_prefill_8k", T=1024, S=8192, H=64),
        _sparse("dsv32_decode_b1_32k", T=1, S=32768, B=1),
        _sparse("dsv32_decode_b64_32k", T=1, S=32768, B=64),
        _sparse("dsv32_decode_b1_32k_fp8", T=1, S=32768, B=1, fp8=True),
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


# --parts: what the warp-specialised sparse MQA kernel leaves out in each timing.
PARTS = {"whole": frozenset(), "no PV": frozenset({"pv"}), "no gather": frozenset({"gather"}),
         "no gather, no PV": frozenset({"gather", "pv"})}


def mosaic_kernel(shape, on_gpu: bool, skip: frozenset[str] = frozenset()):
  """The Mosaic GPU forward over the arguments ``kernels.build`` makes for ``shape``;
  ``skip``: parts the sparse MQA kernel leaves out (``sparse_mqa_ws.forward``)."""
  from pallas_kernels.mosaic_gpu import sparse_mqa, sparse_mqa_ws
  from pallas_kernels.mosaic_gpu._compat import interpret_params
  from pallas_kernels.mosaic_gpu.indexer_logits import indexer_logits_mosaic

  interpret = None if on_gpu else interpret_params()
  d = shape.dims
  if shape.kernel != "sparse_mqa":
    return functools.partial(indexer_logits_mosaic, interpret=interpret)
  kw = dict(sm_scale=d["D"] ** -0.5, d_v=d["d_v"],
            num_splits=sparse_mqa.split_count(d["B"] * d["T"], d["H"], d["K"]),
            interpret=interpret)
  if not skip:
    return jax.vmap(functools.partial(sparse_mqa.sparse_mqa_mosaic, **kw))
  return jax.vmap(lambda q, kv, idx: sparse_mqa.combine_splits(
      *sparse_mqa_ws.forward(q, kv, idx, skip=skip, **kw)))


def measure(shape, on_gpu: bool, iters: int) -> tuple[str, bool]:
  triton, reference, args, flops, nbytes = kernels.build(shape, interpret=not on_gpu)
  mosaic = mosaic_kernel(shape, on_gpu)
  try:
    ok, err = kernels.compare(mosaic, reference, args)
    checked = f"{'ok' if ok else 'MISMATCH'} {err}"
  except Exception as e:  # noqa: BLE001 -- one shape's failure is reported, the rest still run
    print(f"<!-- {kernels._failure(shape.name, e)} -->", flush=True)
    ok, checked = False, "FAILED"
  time = lambda fn, what: kernels._time_or_none(fn, args, iters, f"{shape.name} {what}")
  t_mosaic = time(mosaic, "mosaic") if ok else None
  t_triton = time(triton, "triton") if ok else None
  t_xla = time(reference, "XLA") if ok else None
  ms = lambda t: "n/a" if t is None else f"{t * 1e3:.3f}"
  ratio = lambda t: "n/a" if None in (t_mosaic, t) else f"{t / t_mosaic:.2f}x"
  gbs = "n/a" if t_mosaic is None else f"{nbytes / t_mosaic / 1e9:.0f}"
  tflops = "n/a" if t_mosaic is None else f"{flops / t_mosaic / 1e12:.1f}"
  return (f"| {shape.name} | {checked} | {ms(t_xla)} | {ms(t_triton)} | {ms(t_mosaic)} "
          f"| {ratio(t_triton)} | {ratio(t_xla)} | {tflops} | {gbs} |"), ok and t_mosaic is not None


def measure_parts(shape, on_gpu: bool, iters: int) -> tuple[str, bool]:
  """One ``--parts`` row: the kernel whole and without each part, ms and TFLOP/s."""
  _, _, args, flops, _ = kernels.build(shape, interpret=not on_gpu)
  times = {part: kernels._time_or_none(mosaic_kernel(shape, on_gpu, skip), args, iters,
                                       f"{shape.name} {part}")
           for part, skip in PARTS.items()}
  cells = " | ".join("n/a" if t is None else f"{t * 1e3:.3f} ({flops / t / 1e12:.0f})"
                     for t in times.values())
  return f"| {shape.name} | {cells} |", None not in times.values()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="small shapes (automatic without a GPU)")
  parser.add_argument("--iters", type=int, default=None, help="timed calls per kernel")
  parser.add_argument("--only", default="", help="substring filter on shape names")
  parser.add_argument("--parts", action="store_true",
                      help="cost the parts of sparse MQA (bf16 rows): no PV, no gather")
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
  if args.parts:
    shapes = [s for s in shapes if s.kernel == "sparse_mqa" and not s.dims["fp8"]]
    print("| shape | " + " | ".join(f"{part}: ms (TFLOP/s)" for part in PARTS) + " |")
    print("|---|" + "---|" * len(PARTS))
  else:
    print("| shape | Mosaic check: rel. err vs float32 | XLA ms | Triton ms | Mosaic ms "
          "| Mosaic vs Triton (Triton ms / Mosaic ms) | Mosaic vs XLA | Mosaic TFLOP/s "
          "| Mosaic GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
  failed = 0
  for shape in shapes:
    row, ok = (measure_parts if args.parts else measure)(shape, on_gpu, iters)
    failed += not ok
    print(row, flush=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
