"""The Mosaic GPU sparse MQA kernel (issue 36): the GPU interpreter against float64 NumPy, and
CUDA lowering at DeepSeek-V3.2 and GLM-5 shapes on a CPU host.

Needs a jax whose Pallas Mosaic GPU has ``plgpu.kernel`` and the GPU interpreter (0.11 and
later); skipped with the reason on older ones (CI runs it in the newest-jax leg). Interpret
mode passes things lowering rejects, so every shape is checked both ways.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.mosaic_gpu._compat import (MOSAIC_CUSTOM_CALLS, interpret_params,
                                               unsupported_reason)
from tests.kernels.numpy_reference import assert_attention_matches, numpy_sparse_mqa

if (_reason := unsupported_reason()) is not None:
  pytest.skip(_reason, allow_module_level=True)

from pallas_kernels.mosaic_gpu.sparse_mqa import (sparse_mqa_mosaic,  # noqa: E402
                                                  sparse_mqa_mosaic_batched)

sds = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _case(seed, T, H, L, S, K):
  """Queries, rows with NaN in row 0 (read by invalid slots only), indices with -1 padding, an
  index past the rows, a token with no valid slot and one with repeated rows."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((T, H, L)).astype(np.float32)
  kv = rng.standard_normal((S, L)).astype(np.float32)
  kv[0] = np.nan
  idx = rng.integers(1, S, (T, K)).astype(np.int32)
  idx[0, ::3] = -1
  idx[min(1, T - 1), :] = -1  # no valid slot: out 0, LSE +inf
  idx[-1, 5] = S + 4
  idx[-1, 6:9] = idx[-1, 9]  # the same row three times
  return q, kv, idx


@pytest.mark.parametrize("T, H, L, d_v, S, K", [
    (3, 64, 128, 128, 100, 70),    # top-k padded to two tiles of 64
    (2, 128, 192, 128, 300, 64),   # two head blocks; rope columns past d_v
])
def test_interpreter_matches_float64(T, H, L, d_v, S, K):
  q, kv, idx = _case(T * H + K, T, H, L, S, K)
  out, lse = sparse_mqa_mosaic(jnp.asarray(q, BF16), jnp.asarray(kv, BF16), jnp.asarray(idx),
                               sm_scale=L**-0.5, d_v=d_v, interpret=interpret_params())
  as_bf16 = lambda x: np.asarray(jnp.asarray(x, BF16), np.float64)
  ref_out, ref_lse = numpy_sparse_mqa(as_bf16(q), as_bf16(kv), idx, L**-0.5, d_v)
  assert_attention_matches(out, lse, ref_out, ref_lse, rtol=2e-2, lse_rtol=2e-2, lse_atol=2e-2)


def test_interpreter_batches_sequences_over_their_own_rows():
  """A decode batch (T = 1): each sequence's indices name rows of its own ``kv[b]``."""
  B, H, L, S, K = 3, 64, 128, 50, 64
  rng = np.random.default_rng(7)
  q = rng.standard_normal((B, 1, H, L)).astype(np.float32)
  kv = rng.standard_normal((B, S, L)).astype(np.float32)
  idx = rng.integers(-1, S, (B, 1, K)).astype(np.int32)
  out, lse = sparse_mqa_mosaic_batched(jnp.asarray(q, BF16), jnp.asarray(kv, BF16),
                                       jnp.asarray(idx), sm_scale=0.1, d_v=128,
                                       interpret=interpret_params())
  as_bf16 = lambda x: np.asarray(jnp.asarray(x, BF16), np.float64)
  for b in range(B):
    ref_out, ref_lse = numpy_sparse_mqa(as_bf16(q[b]), as_bf16(kv[b]), idx[b], 0.1, 128)
    assert_attention_matches(out[b], lse[b], ref_out, ref_lse, rtol=2e-2, lse_rtol=2e-2,
                             lse_atol=2e-2)


@pytest.mark.parametrize("H", [128, 64])  # DeepSeek-V3.2, GLM-5: 576-wide rows, 512 values
def test_lowers_at_full_shape(H):
  """One Mosaic GPU custom call, no Triton; in seconds (an operand order once sent layout
  inference into a search of minutes that failed)."""
  fn = lambda q, kv, idx: sparse_mqa_mosaic(q, kv, idx, sm_scale=576**-0.5, d_v=512)
  t0 = time.perf_counter()
  text = _compat.lower_for_cuda(fn, sds((4, H, 576), BF16), sds((65536, 576), BF16),
                                sds((4, 2048), jnp.int32))
  assert time.perf_counter() - t0 < 60
  assert any(f"@{name}" in text or f'"{name}"' in text for name in MOSAIC_CUSTOM_CALLS)
  assert "__gpu$xla.gpu.triton" not in text


@pytest.mark.parametrize("rows, message", [
    (Fp8LatentRows(jnp.zeros((8, 512), jnp.float8_e4m3fn), jnp.ones((8, 4)),
                   jnp.zeros((8, 64), BF16)), "fp8 rows"),
    (jnp.zeros((8, 576), jnp.float32), "bf16/f16 rows only"),
])
def test_what_it_does_not_do_yet_is_named(rows, message):
  q = jnp.zeros((2, 64, 576), rows.dtype if hasattr(rows, "dtype") else BF16)
  with pytest.raises(NotImplementedError, match=message):
    sparse_mqa_mosaic(q, rows, jnp.zeros((2, 64), jnp.int32), sm_scale=0.1, d_v=512)


def test_heads_not_a_multiple_of_64_are_named():
  with pytest.raises(NotImplementedError, match="H % 64"):
    sparse_mqa_mosaic(jnp.zeros((2, 32, 576), BF16), jnp.zeros((8, 576), BF16),
                      jnp.zeros((2, 64), jnp.int32), sm_scale=0.1, d_v=512)
