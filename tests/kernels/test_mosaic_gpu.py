"""The Mosaic GPU kernels (issue 36), sparse MQA and the indexer logits: the GPU interpreter
against float64 NumPy, and CUDA lowering at DeepSeek-V3.2 and GLM-5 shapes on a CPU host.

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
from tests.kernels.numpy_reference import (assert_attention_matches, numpy_dequantize_rows,
                                           numpy_indexer_logits, numpy_pooled_indexer_logits,
                                           numpy_sparse_mqa)

if (_reason := unsupported_reason()) is not None:
  pytest.skip(_reason, allow_module_level=True)

from pallas_kernels.mosaic_gpu.indexer_logits import indexer_logits_mosaic  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from pallas_kernels.mosaic_gpu.sparse_mqa import (combine_splits, sparse_mqa_mosaic,  # noqa: E402
                                                  split_count)

sds = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
FP8 = jnp.float8_e4m3fn


def _as_bf16(x):
  return np.asarray(jnp.asarray(x, BF16), np.float64)


def _is_mosaic_program(text):
  """One Mosaic GPU custom call and no Triton."""
  return (any(f"@{name}" in text or f'"{name}"' in text for name in MOSAIC_CUSTOM_CALLS)
          and "__gpu$xla.gpu.triton" not in text)


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
  idx[0, 4] = S + 4
  idx[0, [7, 8, 10]] = idx[0, 11]  # the same row three times
  return q, kv, idx


@pytest.mark.parametrize("T, H, L, d_v, S, K, splits, races", [
    (3, 64, 128, 128, 100, 64, 1, True),     # one tile: the ring's first slot only
    (2, 64, 128, 128, 100, 300, 1, True),    # ragged, 5 tiles: both rings wrap around
    (2, 128, 192, 128, 300, 200, 2, True),   # two head blocks, two splits, rope past d_v
    (1, 64, 128, 128, 3000, 2048, 1, False),  # 32 tiles: 16 turns of the row ring
])
def test_interpreter_matches_float64(T, H, L, d_v, S, K, splits, races):
  """The warp-specialised kernel (producer, two consumers, rings of barriers); with the GPU
  interpreter's race detector on, a missing wait between the warpgroups fails it (off at K =
  2,048, where it would take 30 s)."""
  q, kv, idx = _case(T * H + K, T, H, L, S, K)
  if splits > 1:
    idx[0, :K // splits] = -1   # a split without a valid slot weighs 0 in the merge
  out, lse = sparse_mqa_mosaic(jnp.asarray(q, BF16), jnp.asarray(kv, BF16), jnp.asarray(idx),
                               sm_scale=L**-0.5, d_v=d_v, num_splits=splits,
                               interpret=plgpu.InterpretGPUParams(detect_races=races))
  ref_out, ref_lse = numpy_sparse_mqa(_as_bf16(q), _as_bf16(kv), idx, L**-0.5, d_v)
  assert_attention_matches(out, lse, ref_out, ref_lse, rtol=2e-2, lse_rtol=2e-2, lse_atol=2e-2)


def test_splits_merge_by_log_sum_exp():
  """``combine_splits`` against float64: splits with and without valid slots, a token with
  none in any split (out 0, LSE +inf), and NaN kept where a split holds it."""
  rng = np.random.default_rng(3)
  out = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
  lse = rng.standard_normal((3, 4, 2)).astype(np.float32) * 3
  lse[1, 0, :] = np.inf    # token 0: split 1 had no valid slot
  out[1, 0, :] = 0.0
  lse[:, 1, :] = np.inf    # token 1: no split had one
  out[:, 1, :] = 0.0
  lse[2, 2, 1] = np.nan    # token 2, head 1: a selected row held NaN
  got_out, got_lse = combine_splits(jnp.asarray(out), jnp.asarray(lse))
  weight = np.exp(np.where(np.isinf(lse), -np.inf, lse.astype(np.float64)))
  total = weight.sum(axis=0)
  with np.errstate(invalid="ignore", divide="ignore"):
    want_lse = np.where(total == 0, np.inf, np.log(total))
    want_out = np.where(total[..., None] == 0, 0.0,
                        (weight[..., None] * out).sum(axis=0) / total[..., None])
  np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5)
  np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-6)
  assert np.isnan(got_lse[2, 1]) and np.isnan(got_out[2, 1]).all()


@pytest.mark.parametrize("tokens, heads, topk, splits", [
    (1, 128, 2048, 32),     # DeepSeek-V3.2 decode, batch 1: 64 CTAs (2 head blocks x 32)
    (64, 128, 2048, 2),     # batch 64: 256 CTAs
    (1024, 128, 2048, 1),   # a prefill chunk: no split
    (1, 64, 100, 2),        # never more splits than tiles
])
def test_split_count_spreads_small_batches(tokens, heads, topk, splits):
  assert split_count(tokens, heads, topk) == splits


@pytest.mark.parametrize("pool", [False, True])
def test_interpreter_vmaps_over_sequences_and_reads_a_shared_pool(pool):
  """A decode batch (T = 1) as ``jax.vmap``: each sequence over its own rows ``kv[b]``, or all
  over one page pool (unbatched, read in place)."""
  B, H, L, S, K = 3, 64, 128, 50, 64
  rng = np.random.default_rng(7)
  q = rng.standard_normal((B, 1, H, L)).astype(np.float32)
  kv = rng.standard_normal((S,) if pool else (B, S), dtype=np.float32)[..., None] * np.ones(L)
  kv = kv + rng.standard_normal(kv.shape)
  kv[..., 0, :] = np.nan  # row 0: read by the invalid slots only
  idx = rng.integers(1, S, (B, 1, K)).astype(np.int32)
  idx[:, :, ::5] = -1
  run = jax.vmap(lambda q, kv, i: sparse_mqa_mosaic(q, kv, i, sm_scale=0.1, d_v=128,
                                                    interpret=interpret_params()),
                 in_axes=(0, None if pool else 0, 0))
  out, lse = run(jnp.asarray(q, BF16), jnp.asarray(kv, BF16), jnp.asarray(idx))
  for b in range(B):
    ref_out, ref_lse = numpy_sparse_mqa(_as_bf16(q[b]), _as_bf16(kv if pool else kv[b]), idx[b],
                                        0.1, 128)
    assert_attention_matches(out[b], lse[b], ref_out, ref_lse, rtol=2e-2, lse_rtol=2e-2,
                             lse_atol=2e-2)


def _fp8_rows(rng, S, A, R, Z):
  """fp8 rows with power-of-two scales (as mla_jax.fp8_cache writes them) and NaN in row 0's
  scales and RoPE, which only invalid slots read."""
  values = jnp.asarray(rng.standard_normal((S, A)) * 4, FP8)
  scales = (2.0 ** rng.integers(-3, 3, (S, Z))).astype(np.float32)
  scales[0] = np.nan
  rope = rng.standard_normal((S, R)).astype(np.float32)
  rope[0] = np.nan
  return Fp8LatentRows(values, jnp.asarray(scales), jnp.asarray(rope, BF16))


@pytest.mark.parametrize("T, H, A, R, Z, S, K", [
    (3, 64, 128, 64, 2, 90, 100),    # two scale tiles of 64; top-k padded to two tiles
    (2, 128, 256, 64, 2, 70, 64),    # tiles of 128 (DeepSeek-V3.2's), two head blocks
])
def test_interpreter_dequantizes_fp8_rows(T, H, A, R, Z, S, K):
  rng = np.random.default_rng(T * H + A)
  rows = _fp8_rows(rng, S, A, R, Z)
  q = rng.standard_normal((T, H, A + R)).astype(np.float32)
  idx = rng.integers(1, S, (T, K)).astype(np.int32)
  idx[0, ::3] = -1
  idx[1, :] = -1
  idx[-1, 4] = S + 2
  out, lse = sparse_mqa_mosaic(jnp.asarray(q, BF16), rows, jnp.asarray(idx), sm_scale=0.05,
                               d_v=A, interpret=interpret_params())
  ref_out, ref_lse = numpy_sparse_mqa(_as_bf16(q), numpy_dequantize_rows(rows), idx, 0.05, A)
  assert_attention_matches(out, lse, ref_out, ref_lse, rtol=6e-2, lse_rtol=6e-2, lse_atol=6e-2)


@pytest.mark.parametrize("H", [128, 64])  # DeepSeek-V3.2, GLM-5: 576-wide rows, 512 values
@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mqa_lowers_at_full_shape(H, fp8):
  """In seconds (an operand order once sent layout inference into a search of minutes that
  failed); fp8 rows in the 656-byte cache layout."""
  S, idx = 65536, sds((4, 2048), jnp.int32)
  if fp8:
    fn = lambda q, v, s, r, i: sparse_mqa_mosaic(q, Fp8LatentRows(v, s, r), i,
                                                 sm_scale=576**-0.5, d_v=512)
    rows = (sds((S, 512), FP8), sds((S, 4), jnp.float32), sds((S, 64), BF16))
  else:
    fn = lambda q, kv, i: sparse_mqa_mosaic(q, kv, i, sm_scale=576**-0.5, d_v=512)
    rows = (sds((S, 576), BF16),)
  t0 = time.perf_counter()
  text = _compat.lower_for_cuda(fn, sds((4, H, 576), BF16), *rows, idx)
  assert time.perf_counter() - t0 < 60
  assert _is_mosaic_program(text)


def test_a_batch_over_a_shared_pool_lowers_with_the_pool_once():
  """vmap over 8 decode rows, the 64K-row pool unbatched: one kernel, no per-sequence copy."""
  fn = jax.vmap(lambda q, i, kv: sparse_mqa_mosaic(q, kv, i, sm_scale=0.04, d_v=512),
                in_axes=(0, 0, None))
  text = _compat.lower_for_cuda(fn, sds((8, 1, 128, 576), BF16), sds((8, 1, 2048), jnp.int32),
                                sds((65536, 576), BF16))
  assert _is_mosaic_program(text)
  assert "tensor<65536x576xbf16>" in text and "x65536x576xbf16>" not in text


@pytest.mark.parametrize("rows, message", [
    (Fp8LatentRows(jnp.zeros((8, 512), FP8), jnp.ones((8, 16)), jnp.zeros((8, 64), BF16)),
     "scale tiles a multiple of 64"),
    (jnp.zeros((8, 576), jnp.float32), "bf16 or f16 queries only"),
])
def test_what_it_does_not_take_is_named(rows, message):
  q = jnp.zeros((2, 64, 576), BF16 if isinstance(rows, Fp8LatentRows) else rows.dtype)
  with pytest.raises(NotImplementedError, match=message):
    sparse_mqa_mosaic(q, rows, jnp.zeros((2, 64), jnp.int32), sm_scale=0.1, d_v=512)


def test_heads_not_a_multiple_of_64_are_named():
  with pytest.raises(NotImplementedError, match="H % 64"):
    sparse_mqa_mosaic(jnp.zeros((2, 32, 576), BF16), jnp.zeros((8, 576), BF16),
                      jnp.zeros((2, 64), jnp.int32), sm_scale=0.1, d_v=512)


# ---- the indexer logits ------------------------------------------------------------------


def _indexer_case(rng, T, G, I, S, dtype, *, pool_rows=None, scales=False):
  """Queries, keys (or a pool) with NaN in a key no window reaches (or a pool row no column
  names), windows including an empty one and a causal one, fp8 scales."""
  P = pool_rows or S
  q = jnp.asarray(rng.standard_normal((T, G, I)), dtype)
  keys = rng.standard_normal((P, I)).astype(np.float32)
  keys[P - 1] = np.nan
  w = jnp.asarray(rng.standard_normal((T, G)), jnp.float32)
  starts = rng.integers(0, S // 2, T).astype(np.int32)
  ends = rng.integers(S // 2, S - 1, T).astype(np.int32)  # column S - 1 unscored
  starts[0], ends[0] = 5, 5                               # an empty window
  starts[-1], ends[-1] = 0, min(T, S - 1)                 # a short causal one
  k_scale = None
  if scales:  # NaN in the scale of the key no window (or column) reaches
    k_scale = jnp.asarray(2.0 ** rng.integers(-2, 3, P), jnp.float32).at[P - 1].set(jnp.nan)
  key_rows = None
  if pool_rows:
    key_rows = rng.permutation(P - 1)[:S].astype(np.int32)  # never the NaN row
    key_rows[::7] = -1
    key_rows[3] = P + 5
    key_rows = jnp.asarray(key_rows)
  k = jnp.asarray(keys, dtype if dtype == FP8 or not pool_rows else jnp.float32)
  return q, k, w, jnp.asarray(starts), jnp.asarray(ends), k_scale, key_rows


@pytest.mark.parametrize("T, G, I, S, dtype, pool_rows, scales", [
    (18, 64, 128, 128, BF16, None, False),   # two token blocks, two whole key tiles
    (5, 32, 64, 150, BF16, None, False),     # ragged keys: read as a pool of arange(S)
    (4, 8, 64, 100, BF16, 160, False),       # a float32 pool, cast to bf16 once gathered
    (6, 64, 128, 192, FP8, None, True),      # fp8 queries and keys, per-key scales
    (3, 16, 128, 70, FP8, 90, True),         # an fp8 pool and its scales
])
def test_indexer_interpreter_matches_float64(T, G, I, S, dtype, pool_rows, scales):
  rng = np.random.default_rng(T + G + S)
  q, k, w, starts, ends, k_scale, key_rows = _indexer_case(rng, T, G, I, S, dtype,
                                                           pool_rows=pool_rows, scales=scales)
  got = np.asarray(indexer_logits_mosaic(q, k, w, starts, ends, k_scale_S=k_scale,
                                         key_rows_S=key_rows, interpret=interpret_params()))
  as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  if key_rows is None:
    want = numpy_indexer_logits(as64(q), as64(k), w, starts, ends, k_scale)
  else:
    # A float pool is cast to the queries' dtype once gathered.
    pool = as64(k) if dtype == FP8 else _as_bf16(k)
    want = numpy_pooled_indexer_logits(as64(q), pool, w, starts, ends, k_scale, key_rows)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  assert np.isfinite(got[finite]).all()
  scale = np.abs(want[finite]).max()
  np.testing.assert_allclose(got[finite], want[finite], atol=2e-2 * scale, rtol=0)
  assert 0 < finite.sum() < finite.size


@pytest.mark.parametrize("G", [64, 32])  # DeepSeek-V3.2, GLM-5
@pytest.mark.parametrize("dtype, pool", [(BF16, False), (FP8, False), (BF16, True), (FP8, True)])
def test_indexer_lowers_at_full_shape(G, dtype, pool):
  fp8 = dtype == FP8
  fn = lambda q, k, w, s, e, ks, rows: indexer_logits_mosaic(q, k, w, s, e, k_scale_S=ks,
                                                             key_rows_S=rows)
  P, S, T = 65536, 8192, 512
  keys = sds((P if pool else S, 128), dtype)
  scale = sds((P if pool else S,), jnp.float32) if fp8 else None
  rows = sds((S,), jnp.int32) if pool else None
  t0 = time.perf_counter()
  text = _compat.lower_for_cuda(fn, sds((T, G, 128), dtype), keys, sds((T, G), jnp.float32),
                                sds((T,), jnp.int32), sds((T,), jnp.int32), scale, rows)
  assert time.perf_counter() - t0 < 60
  assert _is_mosaic_program(text)


@pytest.mark.parametrize("q_dtype, k_dtype, G, I, message", [
    (jnp.float32, jnp.float32, 64, 128, "bf16 or fp8 queries only"),
    (BF16, BF16, 4, 128, "G a multiple of 8"),
    (FP8, FP8, 64, 64, "I % 128"),
])
def test_indexer_refusals_are_named(q_dtype, k_dtype, G, I, message):
  with pytest.raises(NotImplementedError, match=message):
    indexer_logits_mosaic(jnp.zeros((2, G, I), q_dtype), jnp.zeros((8, I), k_dtype),
                          jnp.zeros((2, G)), jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32))


# ---- benchmarks/mosaic_gpu.py, the side-by-side table gpu_check.sh prints ---------------


def test_benchmark_checks_mosaic_against_float32(capsys):
  from benchmarks import mosaic_gpu

  with pytest.raises(SystemExit) as done:
    mosaic_gpu.main(["--only", "small_indexer_fp8", "--iters", "1"])
  assert done.value.code == 0
  row = [line for line in capsys.readouterr().out.splitlines() if "small_indexer_fp8" in line]
  assert row and "| ok " in row[0] and row[0].count("|") == 10


def test_benchmark_fails_a_wrong_mosaic_kernel(monkeypatch, capsys):
  from benchmarks import mosaic_gpu

  right = mosaic_gpu.mosaic_kernel
  monkeypatch.setattr(mosaic_gpu, "mosaic_kernel",
                      lambda *a: (lambda *args: right(*a)(*args) * 1.1))
  with pytest.raises(SystemExit) as done:
    mosaic_gpu.main(["--only", "small_indexer", "--iters", "1"])
  assert done.value.code == 1
  assert "MISMATCH" in capsys.readouterr().out


def test_benchmark_costs_the_parts_of_sparse_mqa(capsys):
  """``--parts`` (gpu_check.sh's stage): the kernel whole, without PV, without the gather."""
  from benchmarks import mosaic_gpu

  with pytest.raises(SystemExit) as done:
    mosaic_gpu.main(["--parts", "--only", "small_sparse", "--iters", "1"])
  assert done.value.code == 0
  row = [line for line in capsys.readouterr().out.splitlines() if "small_sparse" in line]
  assert row and row[0].count("|") == 2 + len(mosaic_gpu.PARTS) and "n/a" not in row[0]


@pytest.mark.parametrize("S, K", [(16384, 512), (132, 128)])
def test_deepseek_v4_flash_shapes_lower(S, K):
  """DeepSeek-V4-Flash (docs/models.md): 64 heads over 512-wide K=V rows, CSA's top-512
  compressed entries and the 128-row window."""
  fn = lambda q, kv, i: sparse_mqa_mosaic(q, kv, i, sm_scale=512**-0.5, d_v=512)
  text = _compat.lower_for_cuda(fn, sds((4, 64, 512), BF16), sds((S, 512), BF16),
                                sds((4, K), jnp.int32))
  assert _is_mosaic_program(text)
