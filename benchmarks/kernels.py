"""Pallas-Triton kernels vs their XLA references, side by side, as a markdown table.

    python benchmarks/kernels.py            # full named shapes on a GPU
    python benchmarks/kernels.py --smoke    # tiny shapes; automatic off-GPU (interpret mode)

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
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference  # noqa: E402
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference  # noqa: E402
from pallas_kernels.sparse_mqa import sparse_mqa, sparse_mqa_reference  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  kernel: str  # "sparse_mqa" | "indexer_logits" | "dense_mha"
  dims: dict
  grad: bool = False  # time forward + backward (module docstring)


def _sparse(name, T, S, H=128, D=576, d_v=512, K=2048, B=1, grad=False):
  return Shape(name, "sparse_mqa", dict(T=T, S=S, H=H, D=D, d_v=d_v, K=K, B=B), grad)


def _indexer(name, T, S, G=64, I=128, fp8=False, grad=False):
  return Shape(name, "indexer_logits", dict(T=T, S=S, G=G, I=I, fp8=fp8), grad)


def _mha(name, T, H, D, V, K=None, grad=False):
  """Causal MHA over T tokens; given ``K``, the masked kernel with a causal top-k of K."""
  return Shape(name, "dense_mha", dict(T=T, S=T, H=H, D=D, V=V, K=K), grad)


# Named shape sets, one definition per shape. Decode = T 1 per sequence, vmapped over the batch.
SHAPES = {
    "full": [
        _sparse("dsv32_sparse_prefill_8k", T=1024, S=8192),
        _sparse("dsv32_sparse_prefill_32k", T=1024, S=32768),
        _sparse("dsv32_sparse_prefill_64k", T=1024, S=65536),
        _sparse("dsv32_decode_b1_32k", T=1, S=32768, B=1),
        _sparse("dsv32_decode_b64_32k", T=1, S=32768, B=64),
        _sparse("dsv32_sparse_fwd_bwd_8k", T=1024, S=8192, grad=True),
        _sparse("glm5_sparse_fwd_bwd_8k", T=1024, S=8192, H=64, grad=True),
        _indexer("dsv32_indexer_prefill_8k_bf16", T=1024, S=8192),
        _indexer("dsv32_indexer_prefill_8k_fp8", T=1024, S=8192, fp8=True),
        _indexer("dsv32_indexer_fwd_bwd_8k_bf16", T=1024, S=8192, grad=True),
        _mha("dsv32_mha_prefill_512", T=512, H=128, D=192, V=128),
        _mha("dsv32_mha_prefill_2048", T=2048, H=128, D=192, V=128),
        _mha("glm5_mha_prefill_2048", T=2048, H=64, D=256, V=256),
        _mha("dsv32_mha_fwd_bwd_2048", T=2048, H=128, D=192, V=128, grad=True),
        _mha("glm5_mha_fwd_bwd_2048", T=2048, H=64, D=256, V=256, grad=True),
        _mha("dsv32_masked_mha_fwd_bwd_4096", T=4096, H=128, D=192, V=128, K=2048, grad=True),
    ],
    "smoke": [
        _sparse("tiny_sparse", T=8, S=256, H=4, D=80, d_v=64, K=64),
        _sparse("tiny_decode_b4", T=1, S=256, H=4, D=80, d_v=64, K=64, B=4),
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
    nbytes = 2 * (B * T * H * (D + d_v) + B * T * K * D) + 4 * B * T * (K + H)
    return (jax.vmap(functools.partial(sparse_mqa, interpret=interpret, **kw)),
            jax.vmap(functools.partial(sparse_mqa_reference, **kw)),
            (rand((B, T, H, D)), rand((B, S, D)), topk), (0, 1), flops, backward, nbytes)
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


def check(shapes, interpret, tol=2e-2):
  """Kernel vs XLA reference on every shape; returns the number of mismatches."""
  failures = 0
  for shape in shapes:
    kernel, reference, fn_args, _, _ = build(shape, interpret=interpret, seed=1)
    err = rel_err(jax.jit(kernel)(*fn_args), jax.jit(reference)(*fn_args))
    ok = err < tol
    failures += not ok
    print(f"{'OK  ' if ok else 'FAIL'} {shape.name}: rel err {err:.2e} (tol {tol:.0e})", flush=True)
  return failures


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (automatic without a GPU)")
  parser.add_argument("--iters", type=int, default=None, help="timed calls per function")
  parser.add_argument("--only", default="", help="substring filter on shape names")
  parser.add_argument("--check", action="store_true", help="compare kernels with XLA; exit 1 on mismatch")
  args = parser.parse_args(argv)
  on_gpu = jax.devices()[0].platform == "gpu"
  smoke = args.smoke or not on_gpu
  iters = args.iters or (5 if smoke else 50)
  shapes = [s for s in SHAPES["smoke" if smoke else "full"] if args.only in s.name]
  if args.check:
    sys.exit(1 if check(shapes, interpret=not on_gpu) else 0)
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
        f"{'interpret mode, ' if not on_gpu else ''}{'smoke' if smoke else 'full'} shapes; "
        f"median of {iters}\n")
  print("| shape | kernel ms | TFLOP/s | GB/s | XLA ms | XLA TFLOP/s | kernel/XLA |")
  print("|---|---|---|---|---|---|---|")
  for shape in shapes:
    kernel, reference, fn_args, flops, nbytes = build(shape, interpret=not on_gpu)
    t_kernel, t_ref = time_fn(kernel, fn_args, iters), time_fn(reference, fn_args, iters)
    print(f"| {shape.name} | {t_kernel * 1e3:.3f} | {flops / t_kernel / 1e12:.1f} | "
          f"{nbytes / t_kernel / 1e9:.0f} | {t_ref * 1e3:.3f} | {flops / t_ref / 1e12:.1f} | "
          f"{t_kernel / t_ref:.2f} |", flush=True)


if __name__ == "__main__":
  main()
