"""Pallas-Triton kernels vs their XLA references, side by side, as a markdown table.

    python benchmarks/kernels.py            # full named shapes on a GPU
    python benchmarks/kernels.py --smoke    # tiny shapes; automatic off-GPU (interpret mode)
    python benchmarks/kernels.py --check    # each shape checked against XLA, then timed

Timing: one warm-up call (compile) excluded, then the median of ``--iters`` calls, each ended
by ``block_until_ready``. FLOPs follow docs/design.md §2: sparse MQA 2*T*K*H*(D + d_v), dense
MHA 2*H*(D + V) per causal (query, key) pair (the masked kernel is charged every causal pair
too), indexer 2*T*S*G*I. GB/s counts each input and output array once (a lower bound on real
traffic).

``*_fwd_bwd`` shapes time a training step's attention: the forward and the VJP of every float
input for fixed random cotangents on every output (out and LSE), through the kernel's custom
VJP (its backward kernels) against XLA's autodiff of the reference. Their FLOPs add what the
backward kernels compute: sparse MQA 2*T*K*H*(2D + d_v) for dq and 4*T*K*H*(D + d_v) for the
row gradients (both recompute the logits); MHA 2.5x the forward (five matmuls per pair
instead of two, flash attention's convention); the indexer 4*T*S*G*I (dq and dk each
recompute the dots). ``--check`` compares the gradients as well as the forward outputs.
A shape whose kernel or reference fails (XLA running out of memory at 8K, say) prints ``n/a``
and a comment saying why; the other shapes still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from mla_jax import fp8_cache  # noqa: E402
from pallas_kernels.fp8_rows import Fp8LatentRows  # noqa: E402
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference  # noqa: E402
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference  # noqa: E402
from pallas_kernels.sparse_mqa import sparse_mqa, sparse_mqa_reference  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  kernel: str  # "sparse_mqa" | "indexer_logits" | "dense_mha"
  dims: dict
  grad: bool = False  # time forward + backward (module docstring)
  xla: bool = True  # False: XLA's reference does not fit on an H200 (8K x 8K logits per head)


def _sparse(name, T, S, H=128, D=576, d_v=512, K=2048, B=1, fp8=False, grad=False):
  """``fp8``: the latent rows as the fp8 cache holds them (``Fp8LatentRows``, 656 bytes)."""
  return Shape(name, "sparse_mqa", dict(T=T, S=S, H=H, D=D, d_v=d_v, K=K, B=B, fp8=fp8), grad)


def _indexer(name, T, S, G=64, I=128, fp8=False, grad=False):
  return Shape(name, "indexer_logits", dict(T=T, S=S, G=G, I=I, fp8=fp8), grad)


def _mha(name, T, H, D, V, K=None, grad=False):
  """Causal MHA over T tokens; given ``K``, the masked kernel with a causal top-k of K. XLA's
  reference materializes [H, T, T] logits: at T 8192 it asks for 64 GiB at once and runs out
  of memory on an H200 (measured), so those shapes time the kernel alone."""
  return Shape(name, "dense_mha", dict(T=T, S=T, H=H, D=D, V=V, K=K), grad, xla=T < 8192)


# Named shape sets, one definition per shape. Decode = T 1 per sequence, vmapped over the batch.
SHAPES = {
    "full": [
        _sparse("dsv32_sparse_prefill_8k", T=1024, S=8192),
        _sparse("dsv32_sparse_prefill_32k", T=1024, S=32768),
        _sparse("dsv32_sparse_prefill_64k", T=1024, S=65536),
        _sparse("dsv32_decode_b1_32k", T=1, S=32768, B=1),
        _sparse("dsv32_decode_b64_32k", T=1, S=32768, B=64),
        _sparse("dsv32_decode_b1_32k_fp8", T=1, S=32768, B=1, fp8=True),
        _sparse("dsv32_decode_b64_32k_fp8", T=1, S=32768, B=64, fp8=True),
        _sparse("dsv32_sparse_fwd_bwd_8k", T=1024, S=8192, grad=True),
        _sparse("glm5_sparse_fwd_bwd_8k", T=1024, S=8192, H=64, grad=True),
        _indexer("dsv32_indexer_prefill_8k_bf16", T=1024, S=8192),
        _indexer("dsv32_indexer_prefill_8k_fp8", T=1024, S=8192, fp8=True),
        _indexer("dsv32_indexer_fwd_bwd_8k_bf16", T=1024, S=8192, grad=True),
        _mha("dsv32_mha_prefill_512", T=512, H=128, D=192, V=128),
        _mha("dsv32_mha_prefill_2048", T=2048, H=128, D=192, V=128),
        _mha("glm5_mha_prefill_2048", T=2048, H=64, D=256, V=256),
        _mha("dsv32_mha_prefill_8192", T=8192, H=128, D=192, V=128),
        _mha("dsv32_masked_mha_prefill_2048", T=2048, H=128, D=192, V=128, K=2048),
        _mha("dsv32_masked_mha_prefill_8192", T=8192, H=128, D=192, V=128, K=2048),
        _mha("dsv32_mha_fwd_bwd_2048", T=2048, H=128, D=192, V=128, grad=True),
        _mha("glm5_mha_fwd_bwd_2048", T=2048, H=64, D=256, V=256, grad=True),
        _mha("dsv32_masked_mha_fwd_bwd_4096", T=4096, H=128, D=192, V=128, K=2048, grad=True),
    ],
    "smoke": [
        _sparse("tiny_sparse", T=8, S=256, H=4, D=80, d_v=64, K=64),
        _sparse("tiny_decode_b4", T=1, S=256, H=4, D=80, d_v=64, K=64, B=4),
        _sparse("tiny_decode_b4_fp8", T=1, S=256, H=4, D=144, d_v=128, K=64, B=4, fp8=True),
        _sparse("tiny_sparse_fwd_bwd", T=8, S=256, H=4, D=80, d_v=64, K=64, grad=True),
        _indexer("tiny_indexer", T=32, S=256, G=4, I=32),
        _indexer("tiny_indexer_fwd_bwd", T=32, S=256, G=4, I=32, grad=True),
        _mha("tiny_mha", T=64, H=2, D=48, V=32),
        _mha("tiny_mha_fwd_bwd", T=64, H=2, D=48, V=32, grad=True),
        _mha("tiny_masked_mha_fwd_bwd", T=64, H=2, D=48, V=32, K=16, grad=True),
    ],
}


def _causal_topk(rng, T, K):
  """K random causal keys per query (all of them while t < K), -1 padded."""
  scores = np.where(np.arange(T)[None, :] <= np.arange(T)[:, None], rng.random((T, T)), -1.0)
  picks = np.argsort(-scores, axis=-1)[:, :K]
  return jnp.asarray(np.where(np.take_along_axis(scores, picks, -1) < 0, -1, picks), jnp.int32)


def _forward(shape: Shape, interpret: bool, rng, rand):
  """``(kernel_fn, reference_fn, args, float_argnums, flops, backward_flops, bytes)``."""
  d = shape.dims
  if shape.kernel == "sparse_mqa":
    B, T, S, H, D, d_v, K = d["B"], d["T"], d["S"], d["H"], d["D"], d["d_v"], d["K"]
    # Random indices with ~1% invalid (-1), so the masking path is exercised too.
    topk = rng.integers(0, S, (B, T, K))
    topk = jnp.asarray(np.where(rng.random((B, T, K)) < 0.01, -1, topk), jnp.int32)
    kw = dict(sm_scale=D**-0.5, d_v=d_v)
    flops = 2 * B * T * K * H * (D + d_v)
    backward = 2 * B * T * K * H * (2 * D + d_v) + 4 * B * T * K * H * (D + d_v)
    kv = rand((B, S, D))
    row_bytes = 2 * D
    if d["fp8"]:  # values | float32 tile scales | bf16 RoPE part
      kv = fp8_cache.quantize_latent(kv, d_v)
      row_bytes = d_v + 4 * (d_v // fp8_cache.latent_tile(d_v)) + 2 * (D - d_v)
    nbytes = 2 * B * T * H * (D + d_v) + row_bytes * B * T * K + 4 * B * T * (K + H)
    return (jax.vmap(functools.partial(sparse_mqa, interpret=interpret, **kw)),
            jax.vmap(functools.partial(sparse_mqa_reference, **kw)),
            (rand((B, T, H, D)), kv, topk), (0, 1), flops, backward, nbytes)
  if shape.kernel == "indexer_logits":
    T, S, G, I = d["T"], d["S"], d["G"], d["I"]
    dt = jnp.float8_e4m3fn if d["fp8"] else jnp.bfloat16
    ends = jnp.asarray(S - T + 1 + np.arange(T), jnp.int32)
    args = (rand((T, G, I), dt), rand((S, I), dt), rand((T, G), jnp.float32),
            jnp.zeros((T,), jnp.int32), ends)
    flops = 2 * T * S * G * I
    nbytes = jnp.dtype(dt).itemsize * (T * G * I + S * I) + 4 * (T * S + T * G)
    return (functools.partial(indexer_logits, interpret=interpret), indexer_logits_reference,
            args, (0, 1, 2), flops, 2 * flops, nbytes)
  T, S, H, D, V, K = d["T"], d["S"], d["H"], d["D"], d["V"], d["K"]
  kw = dict(sm_scale=D**-0.5, q_offset=jnp.int32(0), kv_len=jnp.int32(S))
  args = (rand((T, H, D)), rand((S, H, D)), rand((S, H, V)))
  if K is not None:
    kw["topk_TK"] = _causal_topk(rng, T, K)
  flops = 2 * H * (D + V) * T * (T + 1) // 2
  nbytes = 2 * (T * H * (D + V) + S * H * (D + V)) + 4 * T * H
  return (functools.partial(dense_mha, interpret=interpret, **kw),
          functools.partial(dense_mha_reference, **kw), args, (0, 1, 2), flops, 2.5 * flops,
          nbytes)


def forward_backward(fn, argnums, cotangents):
  """The gradient of ``sum(out * cotangent)`` over ``fn``'s finite outputs with respect to
  ``argnums``: one forward and one backward pass, the VJP for those cotangents."""
  def loss(*args):
    return sum(jnp.sum(jnp.where(jnp.isfinite(o), o.astype(jnp.float32) * c, 0.0))
               for o, c in zip(jax.tree.leaves(fn(*args)), cotangents))
  return jax.grad(loss, argnums)


def build(shape: Shape, interpret: bool, seed: int = 0):
  """Returns (kernel_fn, reference_fn, args, flops, bytes) for one shape."""
  rng = np.random.default_rng(seed)
  rand = lambda shp, dt=jnp.bfloat16: jnp.asarray(rng.standard_normal(shp), jnp.float32).astype(dt)
  kernel, reference, args, argnums, flops, backward, nbytes = _forward(shape, interpret, rng, rand)
  if not shape.grad:
    return kernel, reference, args, flops, nbytes
  outs = jax.tree.leaves(jax.eval_shape(reference, *args))
  cotangents = [rand(o.shape, jnp.float32) for o in outs]
  grad_bytes = sum(args[i].size * args[i].dtype.itemsize for i in argnums)
  return (forward_backward(kernel, argnums, cotangents),
          forward_backward(reference, argnums, cotangents), args, flops + backward,
          nbytes + grad_bytes + sum(4 * o.size for o in outs))


def time_fn(fn, args, iters):
  fn = jax.jit(fn)
  return timing.timed(lambda: fn(*args), iters)  # the warm-up call compiles


def rel_err(got, want):
  """max over outputs of ||got - want|| / ||want||, on finite entries (LSE of empty rows is inf)."""
  errs = []
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if not np.array_equal(np.isfinite(g), np.isfinite(w)):
      return float("inf")
    finite = np.isfinite(w)
    errs.append(np.linalg.norm(g[finite] - w[finite]) / max(np.linalg.norm(w[finite]), 1e-30))
  return max(errs)


def _upcast(args):
  """Floating-point inputs as float32 (fp8 cache rows and indices stay as they are)."""
  up = lambda a: (a.astype(jnp.float32) if not isinstance(a, Fp8LatentRows)
                  and a.dtype in (jnp.bfloat16, jnp.float16) else a)
  return jax.tree.map(up, args, is_leaf=lambda a: isinstance(a, Fp8LatentRows))


def compare(kernel, reference, fn_args, tol=2e-2) -> tuple[bool, str]:
  """The kernel and XLA's bf16 reference, each against the reference in float32 (matmuls at
  full precision) on the same inputs: ``(ok, text)``, ok when the kernel's error is under
  ``tol`` (bf16)."""
  with jax.default_matmul_precision("highest"):
    exact = jax.jit(reference)(*_upcast(fn_args))
  err_kernel = rel_err(jax.jit(kernel)(*fn_args), exact)
  err_xla = rel_err(jax.jit(reference)(*fn_args), exact)
  return err_kernel < tol, f"{err_kernel:.1e} (XLA bf16 {err_xla:.1e})"


def _failure(what, e) -> str:
  return f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _time_or_none(fn, args, iters, what):
  """Seconds per call, or None (printed) when it cannot run, e.g. XLA's reference materializing
  8K x 8K logits per head runs out of memory."""
  try:
    return time_fn(fn, args, iters)
  except Exception as e:  # noqa: BLE001 -- reported in the table, the other shapes still run
    print(f"<!-- {_failure(what, e)} -->", flush=True)
    return None


def measure(shape: Shape, on_gpu: bool, iters: int, check: bool) -> tuple[str, bool]:
  """One table row for ``shape`` and whether it passed (checked, when ``check``, and timed)."""
  kernel, reference, fn_args, flops, nbytes = build(shape, interpret=not on_gpu)
  checked = "-" if shape.xla else "- (no XLA reference)"
  ok = True
  if check and shape.xla:
    try:
      ok, err = compare(kernel, reference, fn_args)
      checked = f"{'ok' if ok else 'MISMATCH'} {err}"
    except Exception as e:  # noqa: BLE001 -- one shape's failure is reported, the rest still run
      print(f"<!-- {_failure(shape.name, e)} -->", flush=True)
      ok, checked = False, "FAILED"
  t_kernel = _time_or_none(kernel, fn_args, iters, f"{shape.name} kernel") if iters else None
  t_ref = (_time_or_none(reference, fn_args, iters, f"{shape.name} XLA")
           if iters and shape.xla else None)
  ok = ok and (t_kernel is not None or not iters)
  cell = lambda t, text: "n/a" if t is None else text(t)
  row = (f"| {shape.name} | {checked} | {cell(t_kernel, lambda t: f'{t * 1e3:.3f}')} | "
         f"{cell(t_kernel, lambda t: f'{flops / t / 1e12:.1f}')} | "
         f"{cell(t_kernel, lambda t: f'{nbytes / t / 1e9:.0f}')} | "
         f"{cell(t_ref, lambda t: f'{t * 1e3:.3f}')} | "
         f"{cell(t_ref, lambda t: f'{flops / t / 1e12:.1f}')} | "
         f"{'n/a' if None in (t_kernel, t_ref) else f'{t_ref / t_kernel:.2f}x'} |")
  return row, ok


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (automatic without a GPU)")
  parser.add_argument("--iters", type=int, default=None,
                      help="timed calls per function (0: check only, with --check)")
  parser.add_argument("--only", default="", help="substring filter on shape names")
  parser.add_argument("--check", action="store_true",
                      help="compare each kernel with the XLA reference in float32 (rel. error "
                           "< 2e-2; XLA's own bf16 error beside it) before timing it; exit 1 on "
                           "a mismatch")
  args = parser.parse_args(argv)
  on_gpu = jax.devices()[0].platform == "gpu"
  smoke = args.smoke or not on_gpu
  iters = (5 if smoke else 50) if args.iters is None else args.iters
  if iters < 0 or (iters == 0 and not args.check):
    parser.error("--iters must be >= 1 (or 0 with --check)")
  shapes = [s for s in SHAPES["smoke" if smoke else "full"] if args.only in s.name]
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
        f"{'interpret mode, ' if not on_gpu else ''}{'smoke' if smoke else 'full'} shapes; "
        f"median of {iters}\n")
  print("| shape | check: rel. err vs float32 | kernel ms | TFLOP/s | GB/s | XLA ms | XLA TFLOP/s "
        "| speedup (XLA ms / kernel ms) |")
  print("|---|---|---|---|---|---|---|---|")
  failed = 0
  for shape in shapes:
    row, ok = measure(shape, on_gpu, iters, args.check)
    failed += not ok
    print(row, flush=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
