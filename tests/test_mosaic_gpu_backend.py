"""MosaicGpuBackend (issue 36): which kernel runs each op, the batched ops (per-sequence rows,
a shared page pool, fp8) against float64 NumPy, gradients through the Triton backwards, and the
routing contract on every step program an engine over it compiles.

The Mosaic kernels run in the GPU interpreter; the programs are traced, not compiled. Needs a
jax with Mosaic GPU's interpreter (0.11 and later): CI's newest-jax leg.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.backends import XlaBackend, get_backend
from mla_jax.backends import gpu_support

if not gpu_support.mosaic_gpu().available:
  pytest.skip(gpu_support.mosaic_gpu().reason, allow_module_level=True)

from mla_jax.backends.mosaic_gpu import MosaicGpuBackend  # noqa: E402
from mla_jax.models.config import tiny_lm  # noqa: E402
from mla_jax.models.lm import CausalLM  # noqa: E402
from mla_jax.serving.engine import Engine  # noqa: E402
from mla_jax.traces import summarize_jaxpr  # noqa: E402
from pallas_kernels.fp8_rows import Fp8LatentRows  # noqa: E402
from tests.kernels.numpy_reference import (assert_attention_matches,  # noqa: E402
                                           numpy_dequantize_rows, numpy_indexer_logits,
                                           numpy_pooled_indexer_logits, numpy_sparse_mqa)

BF16, FP8 = jnp.bfloat16, jnp.float8_e4m3fn
MOSAIC = MosaicGpuBackend(interpret=True)
sds = jax.ShapeDtypeStruct
MOSAIC_KERNELS = {"indexer_logits_mosaic", "sparse_mqa_mosaic_ws"}  # bf16 cache rows
ROUTES = {"mla_dense_mha", "mla_masked_mha", "mla_sparse_mqa", "mla_dense_mqa"}


def _bf16(x):
  return np.asarray(jnp.asarray(x, BF16), np.float64)


def test_get_backend_off_a_gpu_interprets():
  assert get_backend("mosaic-gpu") == MOSAIC


@pytest.mark.parametrize("op, args, expected", [
    ("sparse_mqa", (sds((2, 64, 576), BF16), sds((9, 576), BF16), 512), "mosaic_gpu"),
    ("sparse_mqa", (sds((2, 64, 576), BF16),
                    Fp8LatentRows(sds((9, 512), FP8), sds((9, 4), jnp.float32),
                                  sds((9, 64), BF16)), 512), "mosaic_gpu"),
    ("sparse_mqa", (sds((2, 64, 576), jnp.float32), sds((9, 576), jnp.float32), 512),
     "pallas_triton"),
    ("sparse_mqa", (sds((2, 16, 576), BF16), sds((9, 576), BF16), 512), "pallas_triton"),
    ("indexer_logits", (sds((2, 64, 128), BF16), sds((9, 128), BF16)), "mosaic_gpu"),
    ("indexer_logits", (sds((2, 64, 128), FP8), sds((9, 128), FP8)), "mosaic_gpu"),
    ("indexer_logits", (sds((2, 4, 32), jnp.float32), sds((9, 32), jnp.float32)),
     "pallas_triton"),
    ("dense_mha", (), "pallas_triton"),
    ("sparse_mqa_backward", (), "pallas_triton"),
])
def test_each_op_names_its_kernel(op, args, expected):
  assert MOSAIC.kernel_for(op, *args) == expected


def test_capabilities_are_class_constants():
  assert not MosaicGpuBackend.MOSAIC_OPS & MosaicGpuBackend.TRITON_OPS
  # The Triton prefill kernels are part of this backend, so it declares them for routing.
  assert MosaicGpuBackend.supports_dense_mha_prefill
  assert MosaicGpuBackend.supports_masked_mha_prefill
  with pytest.raises(ValueError, match="unknown op .flash. for mosaic_gpu"):
    MOSAIC.kernel_for("flash")


def _sparse_case(seed, B, T, H, L, S, K, *, pooled):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, H, L)).astype(np.float32)
  kv = rng.standard_normal((S, L) if pooled else (B, S, L)).astype(np.float32)
  kv[..., 0, :] = np.nan  # read by invalid slots only
  idx = rng.integers(1, S, (B, T, K)).astype(np.int32)
  idx[0, 0, ::3] = -1
  idx[-1, -1, :] = -1     # a token with no valid slot
  idx[0, -1, 2] = S + 1
  return q, kv, idx


@pytest.mark.parametrize("pooled", [False, True])
def test_sparse_mqa_batches_over_own_rows_or_a_pool(pooled):
  B, T, H, L, d_v, S, K = 2, 2, 64, 192, 128, 40, 70
  q, kv, idx = _sparse_case(3, B, T, H, L, S, K, pooled=pooled)
  out, lse = MOSAIC.sparse_mqa(jnp.asarray(q, BF16), jnp.asarray(kv, BF16), jnp.asarray(idx),
                               sm_scale=0.1, d_v=d_v, batched_rows=not pooled)
  for b in range(B):
    ref_out, ref_lse = numpy_sparse_mqa(_bf16(q[b]), _bf16(kv if pooled else kv[b]), idx[b],
                                        0.1, d_v)
    assert_attention_matches(out[b], lse[b], ref_out, ref_lse, rtol=2e-2, lse_rtol=2e-2,
                             lse_atol=2e-2)


def test_sparse_mqa_over_an_fp8_page_pool():
  B, T, H, A, R, S, K = 2, 1, 64, 128, 64, 50, 64
  rng = np.random.default_rng(4)
  scales = (2.0 ** rng.integers(-2, 2, (S, 2))).astype(np.float32)
  scales[0] = np.nan
  pool = Fp8LatentRows(jnp.asarray(rng.standard_normal((S, A)) * 3, FP8), jnp.asarray(scales),
                       jnp.asarray(rng.standard_normal((S, R)), BF16))
  q = rng.standard_normal((B, T, H, A + R)).astype(np.float32)
  idx = rng.integers(1, S, (B, T, K)).astype(np.int32)
  idx[:, :, ::4] = -1
  out, lse = MOSAIC.sparse_mqa(jnp.asarray(q, BF16), pool, jnp.asarray(idx), sm_scale=0.07,
                               d_v=A, batched_rows=False)
  for b in range(B):
    ref_out, ref_lse = numpy_sparse_mqa(_bf16(q[b]), numpy_dequantize_rows(pool), idx[b], 0.07,
                                        A)
    assert_attention_matches(out[b], lse[b], ref_out, ref_lse, rtol=6e-2, lse_rtol=6e-2,
                             lse_atol=6e-2)


@pytest.mark.parametrize("dtype", [BF16, FP8])
@pytest.mark.parametrize("pooled", [False, True])
def test_indexer_logits_batched_and_pooled(dtype, pooled):
  B, T, G, I, S, P = 2, 3, 16, 128, 64, 96
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((B, T, G, I)), dtype)
  keys = jnp.asarray(rng.standard_normal((P, I) if pooled else (B, S, I)), dtype)
  w = jnp.asarray(rng.standard_normal((B, T, G)), jnp.float32)
  starts = jnp.zeros((B, T), jnp.int32)
  ends = jnp.asarray(rng.integers(1, S + 1, (B, T)), jnp.int32)
  k_scale = None
  if dtype == FP8:
    k_scale = jnp.asarray(2.0 ** rng.integers(-2, 2, (P,) if pooled else (B, S)), jnp.float32)
  rows = jnp.asarray(np.stack([rng.permutation(P)[:S] for _ in range(B)]).astype(np.int32))
  rows = rows.at[:, ::5].set(-1) if pooled else None
  got = MOSAIC.indexer_logits(q, keys, w, starts, ends, k_scale_BS=k_scale, key_rows_BS=rows)
  as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  for b in range(B):
    if pooled:
      want = numpy_pooled_indexer_logits(as64(q[b]), as64(keys), w[b], starts[b], ends[b],
                                         k_scale, rows[b])
    else:
      want = numpy_indexer_logits(as64(q[b]), as64(keys[b]), w[b], starts[b], ends[b],
                                  None if k_scale is None else k_scale[b])
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isneginf(got[b]), np.isneginf(want))
    np.testing.assert_allclose(np.asarray(got[b])[finite], want[finite],
                               atol=2e-2 * np.abs(want[finite]).max(), rtol=0)


def _grads(backend, q, kv, idx, qi, k, w, ends):
  def loss(q, kv, qi, k, w):
    out, lse = backend.sparse_mqa(q, kv, idx, sm_scale=0.1, d_v=128)
    logits = backend.indexer_logits(qi, k, w, jnp.zeros_like(ends), ends)
    return (out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()
            + jnp.where(jnp.isfinite(logits), logits, 0).sum())
  return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, kv, qi, k, w)


def test_gradients_run_the_triton_backwards_and_match_xla():
  q, kv, idx = _sparse_case(6, 1, 2, 64, 192, 30, 64, pooled=False)
  kv[..., 0, :] = 0.0  # NaN in unselected rows is a forward concern; keep gradients finite
  rng = np.random.default_rng(6)
  args = (jnp.asarray(q, BF16), jnp.asarray(kv, BF16), jnp.asarray(idx),
          jnp.asarray(rng.standard_normal((1, 3, 8, 64)), BF16),
          jnp.asarray(rng.standard_normal((1, 64, 64)), BF16),
          jnp.asarray(rng.standard_normal((1, 3, 8)), jnp.float32),
          jnp.asarray([[10, 64, 0]], jnp.int32))
  got, want = _grads(MOSAIC, *args), _grads(XlaBackend(), *args)
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.isfinite(g).all() and np.abs(w).max() > 0
    np.testing.assert_allclose(g, w, atol=3e-2 * np.abs(w).max(), rtol=0)


def _mosaic_sized_model(attention: str, backend):
  """The tiny model at widths the Mosaic kernels take: 64 heads over 192-wide rows (128 latent
  + 64 RoPE), 8 indexer heads of 64, bf16 weights and caches."""
  config = tiny_lm(attention, moe=False)
  mla = dataclasses.replace(
      config.mla, num_heads=64, kv_lora_rank=128, qk_rope_head_dim=64,
      indexer=dataclasses.replace(config.mla.indexer, num_heads=8, head_dim=64, topk=64))
  return CausalLM(dataclasses.replace(config, mla=mla), rngs=nnx.Rngs(0), backend=backend,
                  param_dtype=BF16)


def _step_summaries(attention: str, backend):
  model = _mosaic_sized_model(attention, backend)
  engine = Engine(model, num_pages=16, page_size=16, max_num_seqs=4, max_step_tokens=32,
                  cache_dtype="bf16", log_interval=None)
  shapes = engine.buckets.all_shapes()
  assert any(s.decode_steps == 1 and not s.fresh for s in shapes)  # mixed flat steps
  # Keyed by kind and rows: the backends' key chunks differ, so do their key-block buckets.
  return {dataclasses.replace(s, key_blocks=0): (plan.route.name, summarize_jaxpr(traced.jaxpr))
          for s in shapes for plan, traced in [engine.trace_step(s)]}


@pytest.mark.parametrize("attention", ["mqa-only", "dense-capable"])
def test_every_step_program_keeps_the_routing_contract(attention):
  """Each step program of an engine over the Mosaic backend, mixed steps included: the
  MQA-only model scores and attends on the Mosaic kernels and nothing dense; the
  dense-capable one goes dense (Triton's kernel) only on steps of fresh sequences. No step
  holds a loop or branch on a device value outside its kernels, as the XLA backend's none."""
  mosaic = _step_summaries(attention, MOSAIC)
  xla = _step_summaries(attention, XlaBackend())
  for shape, (route, summary) in mosaic.items():
    assert route == xla[shape][0], shape
    dense = route == "DENSE_MHA"
    assert attention == "dense-capable" or not dense
    assert summary.scopes & ROUTES == {"mla_dense_mha" if dense else "mla_sparse_mqa"}, shape
    assert ("indexer_score" in summary.scopes) is not dense, shape
    assert set(summary.kernels) == ({"segmented_mha_prefill"} if dense else MOSAIC_KERNELS), shape
    for branch in ("cond", "while"):
      assert summary.primitives[branch] == xla[shape][1].primitives[branch] == 0, shape
