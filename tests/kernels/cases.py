"""Named abstract kernel calls (shapes only), shared by the lowering and compile checks.

Each builder returns ``(fn, args)``: ``fn(*args)`` calls one Pallas kernel on
``jax.ShapeDtypeStruct`` arguments, so it can be lowered for cuda on a CPU host.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.block_config import SparseMQABackwardConfig
from pallas_kernels.dense_mha import dense_mha
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.indexer_logits import indexer_logits
from pallas_kernels.indexer_logits_backward import indexer_logits_dk, indexer_logits_dq
from pallas_kernels.sparse_mqa import sparse_mqa
from pallas_kernels.sparse_mqa_backward import sparse_mqa_dq, sparse_mqa_drows, sparse_mqa_row_sum

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


def indexer_case(T, G, I, S, dtype=BF16, k_scale=False, pool_rows=None):
  """Contiguous keys [S, I]; or, given ``pool_rows``, S row ids into a pool of that many rows."""
  num_keys = S if pool_rows is None else pool_rows
  args = (sds((T, G, I), dtype), sds((num_keys, I), dtype), sds((T, G), F32), sds((T,), I32),
          sds((T,), I32))
  extra = {}
  if k_scale:
    extra["k_scale_S"] = sds((num_keys,), F32)
  if pool_rows is not None:
    extra["key_rows_S"] = sds((S,), I32)
  fn = lambda *a: indexer_logits(*a[:5], **dict(zip(extra, a[5:])))
  return fn, args + tuple(extra.values())


def indexer_grad_case(kernel, T, G, I, S, dtype=BF16, k_scale=False, pool_rows=None):
  """A backward kernel (``"dq"`` or ``"dk"``) of :func:`indexer_case`'s call: the float32
  cotangent [T, S] first, then the forward's arguments."""
  _, args = indexer_case(T, G, I, S, dtype, k_scale, pool_rows)
  grad = {"dq": indexer_logits_dq, "dk": indexer_logits_dk}[kernel]
  extra = [name for name, on in (("k_scale_S", k_scale), ("key_rows_S", pool_rows is not None))
           if on]
  fn = lambda dl, *a: grad(dl, *a[:5], **dict(zip(extra, a[5:])))
  return fn, (sds((T, S), F32), *args)


def mha_case(T, S, H, D, V, dtype=BF16, topk=None, segmented=False):
  """Causal dense MHA; given ``topk`` (K), the masked kernel with a [T, K] top-k; with
  ``segmented`` (T == S), the segmented kernel of a flat step with [T] segment ids."""
  args = (sds((T, H, D), dtype), sds((S, H, D), dtype), sds((S, H, V), dtype), sds((), I32),
          sds((), I32))
  if segmented:
    fn = lambda q, k, v, off, n, seg: dense_mha(q, k, v, sm_scale=D**-0.5, q_offset=off,
                                                kv_len=n, segment_ids_T=seg)
    return fn, args + (sds((T,), I32),)
  if topk is None:
    return lambda q, k, v, off, n: dense_mha(q, k, v, sm_scale=D**-0.5, q_offset=off, kv_len=n), args
  fn = lambda q, k, v, off, n, idx: dense_mha(q, k, v, sm_scale=D**-0.5, q_offset=off, kv_len=n,
                                              topk_TK=idx)
  return fn, args + (sds((T, topk), I32),)


def sparse_bwd_case(kernel, T, H, D, d_v, S, K, dtype=BF16, fp8=False):
  """One backward kernel of sparse MQA, ``"dq"`` or ``"drows"`` (float rows only), on the
  residuals and cotangents it reads: fp8 rows (A = d_v, tiles of 128) when ``fp8``."""
  config = getattr(SparseMQABackwardConfig.default_for(H, K, d_v), kernel)
  op = {"dq": sparse_mqa_dq, "drows": sparse_mqa_drows}[kernel]
  fn = lambda q, kv, *rest: op(q, kv, *rest, sm_scale=D**-0.5, config=config)
  if fp8:
    kv = Fp8LatentRows(sds((S, d_v), FP8), sds((S, d_v // 128), F32), sds((S, D - d_v), BF16))
  else:
    kv = sds((S, D), dtype)
  return fn, (sds((T, H, D), dtype), kv, sds((T, K), I32), sds((T, H, d_v), dtype),
              sds((T, H), F32), sds((T, H), F32))


def sparse_row_sum_case(T, K, S, L=576):
  """The backward's per-row sum of T x K row gradients (float32) into S rows."""
  return sparse_mqa_row_sum, (sds((T * K, L), F32), sds((T * K,), I32), sds((S,), I32),
                              sds((S,), I32))


def mha_backward_case(T, S, H, D, V, dtype=BF16, topk=None):
  """The backward kernels of ``mha_case``: ``fn`` is its VJP, the dq and the dk/dv calls."""
  fn, args = mha_case(T, S, H, D, V, dtype, topk)
  def vjp(q, k, v, dout, *rest):
    _, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, *rest)[0], q, k, v)
    return pullback(dout)
  return vjp, args[:3] + (sds((T, H, V), dtype),) + args[3:]


def batched(case, B):
  """``case`` vmapped over a leading batch of ``B`` (as the backends call the kernels)."""
  fn, args = case
  return jax.vmap(fn), tuple(sds((B, *a.shape), a.dtype) for a in args)


def mosaic_sparse_case(T, H, D, d_v, S, K, fp8=False, batch=None):
  """The Mosaic GPU sparse MQA forward (bf16 rows, or fp8 rows with tiles of 128); given
  ``batch``, vmapped over that many sequences reading one shared pool of S rows, as a decode
  step does. The top-k split is ``MosaicGpuBackend``'s for the launch."""
  from pallas_kernels.mosaic_gpu.sparse_mqa import sparse_mqa_mosaic, split_count

  run = functools.partial(sparse_mqa_mosaic, sm_scale=D**-0.5, d_v=d_v,
                          num_splits=split_count((batch or 1) * T, H, K))
  if fp8:
    rows = (sds((S, d_v), FP8), sds((S, d_v // 128), F32), sds((S, D - d_v), BF16))
    call = lambda q, i, v, s, r: run(q, Fp8LatentRows(v, s, r), i)
  else:
    rows = (sds((S, D), BF16),)
    call = lambda q, i, kv: run(q, kv, i)
  q, idx = sds((T, H, D), BF16), sds((T, K), I32)
  if batch is None:
    return call, (q, idx, *rows)
  return (jax.vmap(call, in_axes=(0, 0) + (None,) * len(rows)),
          (sds((batch, *q.shape), BF16), sds((batch, *idx.shape), I32), *rows))


def mosaic_indexer_case(T, G, I, S, dtype=BF16, pool_rows=None):
  """The Mosaic GPU indexer logits: fp8 keys with per-key scales; given ``pool_rows``, S row
  ids into a pool of that many rows."""
  from pallas_kernels.mosaic_gpu.indexer_logits import indexer_logits_mosaic

  fn = lambda q, k, w, s, e, ks, rows: indexer_logits_mosaic(q, k, w, s, e, k_scale_S=ks,
                                                             key_rows_S=rows)
  held = pool_rows or S
  return fn, (sds((T, G, I), dtype), sds((held, I), dtype), sds((T, G), F32), sds((T,), I32),
              sds((T,), I32), sds((held,), F32) if dtype == FP8 else None,
              sds((S,), I32) if pool_rows else None)
