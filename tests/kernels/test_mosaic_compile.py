"""The sm_90a compile check of the Mosaic GPU kernels (issue 36): each kernel at DeepSeek-V3.2,
GLM-5 and DeepSeek-V4-Flash shapes compiled for an H200 without a GPU
(``tests/kernels/mosaic_compile.py``); no spills, shared memory within the H200's 227 KiB.
Skipped, with the reason, without the pinned jaxlib's CUDA plugin or a ptxas. The table:

    python -m tests.kernels.test_mosaic_compile
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mosaic_gpu._compat import unsupported_reason
from tests.kernels import mosaic_compile

if (_reason := unsupported_reason() or mosaic_compile.unavailable_reason()) is not None:
  pytest.skip(_reason, allow_module_level=True)

from pallas_kernels.fp8_rows import Fp8LatentRows  # noqa: E402
from pallas_kernels.mosaic_gpu.indexer_logits import indexer_logits_mosaic  # noqa: E402
from pallas_kernels.mosaic_gpu.sparse_mqa import sparse_mqa_mosaic  # noqa: E402

sds = jax.ShapeDtypeStruct
BF16, FP8, I32, F32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.int32, jnp.float32
SMEM_LIMIT = 232448  # bytes a block may opt into on sm_90


def _sparse(H, rows=65536, width=576, d_v=512, K=2048, fp8=False):
  if fp8:
    fn = lambda q, v, s, r, i: sparse_mqa_mosaic(q, Fp8LatentRows(v, s, r), i,
                                                 sm_scale=width**-0.5, d_v=d_v)
    kv = (sds((rows, d_v), FP8), sds((rows, d_v // 128), F32), sds((rows, width - d_v), BF16))
  else:
    fn = lambda q, kv, i: sparse_mqa_mosaic(q, kv, i, sm_scale=width**-0.5, d_v=d_v)
    kv = (sds((rows, width), BF16),)
  return fn, (sds((4, H, width), BF16), *kv, sds((4, K), I32))


def _indexer(G, dtype, keys=8192, pool=None, T=512):
  fn = lambda q, k, w, s, e, ks, rows: indexer_logits_mosaic(q, k, w, s, e, k_scale_S=ks,
                                                             key_rows_S=rows)
  held = pool or keys
  return fn, (sds((T, G, 128), dtype), sds((held, 128), dtype), sds((T, G), F32), sds((T,), I32),
              sds((T,), I32), sds((held,), F32) if dtype == FP8 else None,
              sds((keys,), I32) if pool else None)


KERNELS = {
    "sparse MQA, DSv3.2 (H 128, 576/512, top-k 2048)": _sparse(128),
    "sparse MQA, GLM-5 (H 64, 576/512, top-k 2048)": _sparse(64),
    "sparse MQA, DSv3.2, fp8 rows": _sparse(128, fp8=True),
    "sparse MQA, GLM-5, fp8 rows": _sparse(64, fp8=True),
    "sparse MQA, V4-Flash (H 64, 512/512, top-k 512)": _sparse(64, 16384, 512, 512, 512),
    "indexer, DSv3.2 (G 64, I 128), bf16": _indexer(64, BF16),
    "indexer, DSv3.2, fp8": _indexer(64, FP8),
    "indexer, GLM-5 (G 32), bf16": _indexer(32, BF16),
    "indexer, DSv3.2, bf16, 64K-row pool": _indexer(64, BF16, pool=65536),
    "indexer, DSv3.2, fp8, 64K-row pool": _indexer(64, FP8, pool=65536),
}


def report(name):
  fn, shapes = KERNELS[name]
  (kernel, result), = mosaic_compile.compile_kernels(fn, *shapes).items()
  return result


@pytest.mark.parametrize("name", list(KERNELS))
def test_compiles_for_sm90a_without_spills(name):
  result = report(name)
  assert result.arch == "sm_90a"
  assert result.spill_store_bytes == result.spill_load_bytes == 0, result
  assert result.smem_bytes <= SMEM_LIMIT, result
  assert 0 < result.registers <= 255


def main():
  print(f"ptxas {mosaic_compile.ptxas_version()} ({mosaic_compile.ptxas_path()}), "
        f"jaxlib {mosaic_compile.PINNED_JAXLIB}\n")
  print("| kernel (sm_90a) | registers | shared mem (B) | spills (B, stores / loads) |")
  print("|---|---|---|---|")
  for name in KERNELS:
    r = report(name)
    print(f"| {name} | {r.registers} | {r.smem_bytes:,} | {r.spill_store_bytes} / "
          f"{r.spill_load_bytes} |", flush=True)


if __name__ == "__main__":
  main()
