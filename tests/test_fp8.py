"""fp8 weights kept fp8: block-scaled matmuls against float64 with ragged edge blocks, the
loaded fp8 model's bytes and accuracy against the dequantized model, bitwise saves."""

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from mla_jax import testing as mt
from mla_jax.checkpoints import (CheckpointError, load_pretrained, loading, open_checkpoint,
                                 open_safetensors, save_pretrained, write_safetensors)
from mla_jax.layers import Linear
from mla_jax.models.hf_layout import hf_params
from mla_jax.models.moe import routed_experts
from mla_jax.quant import BlockScaledArray, BlockScaledWeight, scale_shape
from tests.checkpoint_models import TOPK, fp8_config, random_model, write_fp8_checkpoint
from tests.helpers import routed_case, routed_reference

BLOCK = (128, 128)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _block_scaled(rng, shape, block=BLOCK):
  """Random e4m3 values and positive float32 scales, one per block of the last two axes."""
  values = (rng.standard_normal(shape) * 100).astype(FP8)
  return values, rng.uniform(0.001, 0.01, scale_shape(shape, block)).astype(np.float32)


def _dequantize64(values, scale, block=BLOCK):
  """float64, block by block (independent of the library's repeat-and-slice)."""
  out = values.astype(np.float64)
  for index in np.ndindex(scale.shape):
    *lead, i, j = index
    rows = slice(i * block[0], (i + 1) * block[0])
    cols = slice(j * block[1], (j + 1) * block[1])
    out[(*lead, rows, cols)] *= scale[index]
  return out


def test_linear_with_block_scales_matches_float64():
  rng = np.random.default_rng(0)
  values, scale = _block_scaled(rng, (200, 136))  # ragged blocks on both axes
  linear = Linear(136, 200, rngs=nnx.Rngs(0))
  linear.weight = BlockScaledWeight(jnp.asarray(values), jnp.asarray(scale), BLOCK)
  x = rng.standard_normal((3, 5, 136)).astype(np.float32)
  expected = x.astype(np.float64) @ _dequantize64(values, scale).T
  out = nnx.jit(lambda m, x: m(x))(linear, x)
  assert out.dtype == jnp.float32 and mt.relative_error(out, expected) < 1e-6
  out_bf16 = nnx.jit(lambda m, x: m(x))(linear, x.astype(jnp.bfloat16))
  assert out_bf16.dtype == jnp.bfloat16 and mt.relative_error(out_bf16, expected) < 2e-2
  with pytest.raises(ValueError, match=r"scale_inv shape \(2, 1\) != \(2, 2\)"):
    BlockScaledWeight(values, scale[:, :1], BLOCK)


@pytest.mark.parametrize("impl", ["ragged_dot", "tiled"])
def test_grouped_expert_matmul_with_block_scales(impl):
  """Experts [E, 200, 136] / [E, 136, 200]: block scales per expert, ragged edges, one expert
  that no token picks and one that many pick."""
  rng = np.random.default_rng(1)
  num_experts, f, d, tokens, top = 4, 200, 136, 16, 2
  weights = [_block_scaled(rng, shape) for shape in
             ((num_experts, f, d), (num_experts, f, d), (num_experts, d, f))]
  x, idx, combine = routed_case(rng, num_experts, d, tokens, top)
  run = jax.jit(functools.partial(routed_experts, impl=impl))
  out = run(x, idx, combine, *(BlockScaledArray(jnp.asarray(v), jnp.asarray(s), BLOCK)
                               for v, s in weights))
  gate, up, down = (_dequantize64(v, s) for v, s in weights)
  dequantized_first = run(x, idx, combine, *(w.astype(np.float32) for w in (gate, up, down)))
  np.testing.assert_allclose(out, dequantized_first, rtol=1e-5, atol=1e-5)
  expected = routed_reference(x, idx, combine, gate, up, down)
  assert mt.relative_error(out, expected) < 1e-5


def test_dequantizing_a_slice_reads_the_scales_it_needs(tmp_path):
  """Dequantized loading reads each device's slice on its own: any slice, block edges or not."""
  rng = np.random.default_rng(2)
  values, scale = _block_scaled(rng, (300, 260), block=(64, 128))
  write_safetensors({"w": values, "w_scale_inv": scale}, tmp_path / "t.safetensors")
  handles = open_safetensors(tmp_path / "t.safetensors")
  whole = _dequantize64(values, scale, (64, 128)).astype(np.float32)
  for rows, cols in [(slice(None), slice(None)), (slice(64, 128), slice(0, 128)),
                     (slice(70, 75), slice(100, 260)), (slice(299, 300), slice(3, 4)),
                     (slice(0, 150), slice(130, 250))]:
    piece = loading._dequantized_slice(handles["w"], handles["w_scale_inv"], (rows, cols),
                                       (64, 128))
    np.testing.assert_array_equal(piece, whole[rows, cols])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("fp8")
  model = random_model(fp8_config(), seed=5, param_dtype=jnp.bfloat16)
  write_fp8_checkpoint(model, root / "fp8")
  save_pretrained(model, root / "bf16")
  return root


def _param_bytes(model) -> int:
  return sum(var[...].nbytes for _, var in nnx.state(model, nnx.Param).flat_state())


def _logits(model, ids):
  run = nnx.jit(lambda m, i, c: m(i, c, num_cached_tokens=0)[0])
  return np.asarray(run(model, jnp.asarray(ids), model.init_cache(ids.shape[0], 16)))


def test_fp8_model_bytes_and_accuracy(checkpoints):
  path = checkpoints / "fp8"
  fp8 = load_pretrained(path, dtype="fp8", backend="xla")
  held = {name: value.dtype for name, value in hf_params(fp8).items()}
  stored = {name: handle.dtype for name, handle in open_checkpoint(path).items()}
  assert held == stored  # which weights stay fp8 is read from the checkpoint
  # 7 attention + indexer projections x 3 layers, 3 dense MLP, (4 experts + shared) x 3 x 2
  assert sum(d == FP8 for d in held.values()) == 7 * 3 + 3 + (4 + 1) * 3 * 2
  ratio = _param_bytes(fp8) / _param_bytes(load_pretrained(path, backend="xla"))
  reference = load_pretrained(path, dtype=jnp.float32, backend="xla")  # dequantized, fp32
  ids = np.random.default_rng(2).integers(0, 256, (4, 12)).astype(np.int32)
  got, want = _logits(fp8, ids), _logits(reference, ids)
  delta = np.abs(got - want).max(axis=-1)
  agreement = float((got.argmax(-1) == want.argmax(-1)).mean())
  # Up to top-k keys every key is selected: bf16 rounding alone. Past it, a rounding can
  # change which keys the indexer selects at a position.
  within_topk = mt.relative_error(got[:, :TOPK], want[:, :TOPK])
  print(f"\nfp8 parameter bytes / bf16: {ratio:.3f}; vs the fp32 dequantized model: max "
        f"|delta logit| {delta.max():.3g} (median over positions {np.median(delta):.3g}), "
        f"top-1 agreement {agreement:.3f} over {delta.size} positions, relative error "
        f"{within_topk:.2g} up to top-k keys")
  assert ratio <= 0.55
  assert within_topk < 2e-2
  assert np.median(delta) < 0.1 and agreement >= 0.9


def test_fp8_save_writes_values_and_scales_back_bitwise(checkpoints, tmp_path):
  source = checkpoints / "fp8"
  model = load_pretrained(source, dtype="fp8", backend="xla")
  save_pretrained(model, tmp_path / "out", max_shard_bytes=200_000)
  a, b = open_checkpoint(source), open_checkpoint(tmp_path / "out")
  assert sorted(a) == sorted(b) and len(b.opened_files) == 0
  for name in a:
    assert a[name].st_dtype == b[name].st_dtype, name
    assert a[name].read().tobytes() == b[name].read().tobytes(), name
  assert len(set(b.opened_files)) > 2
  assert (json.loads((source / "config.json").read_text())
          == json.loads((tmp_path / "out" / "config.json").read_text()))
  again = hf_params(load_pretrained(tmp_path / "out", dtype="fp8", backend="xla"))
  assert all(again[n].tobytes() == v.tobytes() for n, v in hf_params(model).items())


def test_fp8_needs_float8_weights_and_one_dtype_per_stacked_parameter(checkpoints, tmp_path):
  with pytest.raises(CheckpointError, match="no weight is stored as float8"):
    load_pretrained(checkpoints / "bf16", dtype="fp8")
  tensors = {name: h.read() for name, h in open_checkpoint(checkpoints / "fp8").items()}
  name = "model.layers.2.mlp.experts.1.up_proj.weight"  # layer 1 of the MoE group stays fp8
  tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)
  del tensors[name + "_scale_inv"]
  write_safetensors(tensors, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text((checkpoints / "fp8" / "config.json").read_text())
  with pytest.raises(CheckpointError) as err:
    load_pretrained(tmp_path, dtype="fp8")
  message = str(err.value)
  assert f"missing (1):\n    {name}_scale_inv" in message
  assert (f"{name}: dtype BF16, but the model keeps this stacked parameter as float8_e4m3fn"
          in message)
  mixed = hf_params(load_pretrained(tmp_path, dtype=jnp.float32))  # dequantizing mixes freely
  assert mixed[name].dtype == np.float32


def test_fp8_weights_with_float32_compute_match_the_float32_dequantized_model(checkpoints):
  """``compute_dtype=float32``: the float8 weights stay float8 (dequantized inside each
  matmul) and everything else is float32, so the logits match the model dequantized to
  float32 at load up to rounding order; bf16 compute (the default) does not."""
  path = checkpoints / "fp8"
  fp8 = load_pretrained(path, dtype="fp8", compute_dtype=jnp.float32, backend="xla")
  held = hf_params(fp8)
  stored = open_checkpoint(path)
  for name, value in held.items():  # the scales are float32 as stored
    assert value.dtype == (FP8 if stored[name].dtype == FP8 else np.float32), name
  assert sum(v.dtype == FP8 for v in held.values()) == 7 * 3 + 3 + (4 + 1) * 3 * 2
  reference = load_pretrained(path, dtype=jnp.float32, backend="xla")
  ids = np.random.default_rng(2).integers(0, 256, (4, 12)).astype(np.int32)
  got, want = _logits(fp8, ids), _logits(reference, ids)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  bf16 = _logits(load_pretrained(path, dtype="fp8", backend="xla"), ids)
  assert np.abs(bf16 - want).max() > 1e-3  # the default still computes in bfloat16


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="fp8", compute_dtype="fp8"), "compute_dtype must be one of"),
    (dict(dtype="fp8", compute_dtype=jnp.int32), "compute_dtype must be one of"),
    (dict(dtype="fp8", compute_dtype=True), "compute_dtype must be one of"),
    (dict(dtype=jnp.bfloat16, compute_dtype=jnp.float32),
     "compute_dtype float32 differs from dtype bfloat16"),
])
def test_bad_compute_dtype_is_refused_by_name(checkpoints, kwargs, message):
  with pytest.raises(ValueError, match=message):
    load_pretrained(checkpoints / "fp8", **kwargs)
