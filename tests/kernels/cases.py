"""Named abstract kernel calls (shapes only), shared by the lowering and compile checks.

Each builder returns ``(fn, args)``: ``fn(*args)`` calls one Pallas kernel on
``jax.ShapeDtypeStruct`` arguments, so it can be lowered for cuda on a CPU host.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dense_mha import dense_mha
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.indexer_logits import indexer_logits
from pallas_kernels.sparse_mqa import sparse_mqa

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


def indexer_case(T, G, I, S, dtype=BF16, k_scale=False):
  args = (sds((T, G, I), dtype), sds((S, I), dtype), sds((T, G), F32), sds((T,), I32), sds((T,), I32))
  if not k_scale:
    return indexer_logits, args
  return (lambda *a: indexer_logits(*a[:5], k_scale_S=a[5])), args + (sds((S,), F32),)


def mha_case(T, S, H, D, V, dtype=BF16):
  fn = lambda q, k, v, off, n: dense_mha(q, k, v, sm_scale=D**-0.5, q_offset=off, kv_len=n)
  return fn, (sds((T, H, D), dtype), sds((S, H, D), dtype), sds((S, H, V), dtype), sds((), I32), sds((), I32))
