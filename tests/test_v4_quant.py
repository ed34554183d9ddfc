"""DeepSeek-V4's weights kept as released: MXFP4 experts (packed e2m1, e8m0 scales per 32)
and fp8 projections with e8m0 block scales, against float64 dequantize-then-matmul
references, and a tiny checkpoint in the release's layout (tests/v4_released.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from mla_jax import testing as mt
from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.reading import open_checkpoint
from mla_jax.checkpoints.writing import write_safetensors
from mla_jax.layers import Linear
from mla_jax.models.moe import routed_experts
from mla_jax.quant import MXFP4_BLOCK, BlockScaledArray, BlockScaledWeight, unpack_fp4
from mla_jax.v4.checkpoint import dequantize_mxfp4, load_pretrained
from mla_jax.v4.config import tiny_v4_config
from mla_jax.v4.model import V4CausalLM
from tests import v4_reference as ref
from tests.helpers import routed_case, routed_reference
from tests.test_v4_model import build, rel_err, run
from tests.v4_released import quantize_fp8, quantize_mxfp4, write_released

# e2m1 codes 0..15: sign bit 3, then exponent and mantissa (OCP MX spec, table 5).
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _mxfp4(rng, shape):
  """Random packed bytes (every code) and e8m0 scales 2^-8 .. 2^3, one per 32 of a row."""
  *lead, rows, cols = shape
  packed = rng.integers(0, 256, (*lead, rows, cols // 2), dtype=np.uint8)
  exponents = rng.integers(-8, 4, (*lead, rows, cols // 32))
  return packed, np.exp2(exponents).astype(ml_dtypes.float8_e8m0fnu)


def _dequantize64(packed, scale):
  """float64, nibble by nibble and group by group (independent of the library's bitcast)."""
  low, high = _E2M1[packed & 0xF], _E2M1[packed >> 4]
  values = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]))
  values[..., 0::2], values[..., 1::2] = low, high
  groups = values.reshape(*values.shape[:-1], -1, 32)
  return (groups * scale.astype(np.float64)[..., None]).reshape(values.shape)


def test_mxfp4_unpacks_every_code_exactly():
  rng = np.random.default_rng(0)
  packed, scale = _mxfp4(rng, (3, 64, 96))
  want = _dequantize64(packed, scale)
  got = jax.jit(lambda a: a.dequantize())(BlockScaledArray(jnp.asarray(packed),
                                                           jnp.asarray(scale), MXFP4_BLOCK,
                                                           packed=True))
  np.testing.assert_array_equal(np.asarray(got), want)  # e2m1 x 2^k is exact in float32
  np.testing.assert_array_equal(dequantize_mxfp4(packed.view(np.int8), scale), want)
  assert unpack_fp4(jnp.asarray(packed)).dtype == jnp.float4_e2m1fn
  values, scales = quantize_mxfp4(want[0].astype(np.float32))  # the writer round-trips it
  np.testing.assert_array_equal(dequantize_mxfp4(values, scales), want[0])


def test_mxfp4_linear_matches_float64():
  rng = np.random.default_rng(1)
  packed, scale = _mxfp4(rng, (48, 64))
  linear = Linear(64, 48, rngs=nnx.Rngs(0))
  linear.weight = BlockScaledWeight(jnp.asarray(packed), jnp.asarray(scale), MXFP4_BLOCK,
                                    packed=True)
  assert linear.weight.shape == (48, 64)
  x = rng.standard_normal((2, 5, 64)).astype(np.float32)
  expected = x.astype(np.float64) @ _dequantize64(packed, scale).T
  out = nnx.jit(lambda m, x: m(x))(linear, x)
  assert out.dtype == jnp.float32 and mt.relative_error(out, expected) < 1e-5
  out_bf16 = nnx.jit(lambda m, x: m(x))(linear, x.astype(jnp.bfloat16))
  assert out_bf16.dtype == jnp.bfloat16 and mt.relative_error(out_bf16, expected) < 2e-2
  with pytest.raises(ValueError, match=r"scale_inv shape \(48, 1\) != \(48, 2\)"):
    BlockScaledWeight(jnp.asarray(packed), jnp.asarray(scale[:, :1]), MXFP4_BLOCK, packed=True)
  with pytest.raises(ValueError, match="packed fp4 values must be uint8"):
    BlockScaledWeight(jnp.asarray(packed, jnp.int32), jnp.asarray(scale), MXFP4_BLOCK,
                      packed=True)


@pytest.mark.parametrize("impl", ["ragged_dot", "tiled"])
def test_grouped_expert_matmul_with_mxfp4(impl):
  """Experts [E, F, D] / [E, D, F] as packed fp4: the grouped matmul dequantizes them inside
  the program (one expert no token picks, one many pick); float32 and bf16 activations."""
  rng = np.random.default_rng(2)
  num_experts, f, d = 4, 64, 96
  weights = [_mxfp4(rng, shape) for shape in
             ((num_experts, f, d), (num_experts, f, d), (num_experts, d, f))]
  x, idx, combine = routed_case(rng, num_experts, d)
  run_experts = jax.jit(functools.partial(routed_experts, impl=impl, swiglu_limit=10.0))
  arrays = [BlockScaledArray(jnp.asarray(p), jnp.asarray(s), MXFP4_BLOCK, packed=True)
            for p, s in weights]
  expected = routed_reference(x, idx, combine, *(_dequantize64(p, s) for p, s in weights),
                              limit=10.0)
  assert mt.relative_error(run_experts(x, idx, combine, *arrays), expected) < 1e-5
  out_bf16 = run_experts(x.astype(jnp.bfloat16), idx, combine, *arrays)
  assert mt.relative_error(out_bf16, expected) < 2e-2


def test_fp8_with_e8m0_block_scales_matches_float64():
  """The releases' fp8 scales are e8m0 (powers of two), not V3.2's float32."""
  rng = np.random.default_rng(3)
  w = rng.standard_normal((40, 56)).astype(np.float32)
  values, scale = quantize_fp8(w, (16, 16))  # ragged edge blocks on both axes
  assert scale.dtype == ml_dtypes.float8_e8m0fnu
  linear = Linear(56, 40, rngs=nnx.Rngs(0))
  linear.weight = BlockScaledWeight(jnp.asarray(values), jnp.asarray(scale), (16, 16))
  dequantized = values.astype(np.float64) * np.repeat(np.repeat(
      scale.astype(np.float64), 16, 0), 16, 1)[:40, :56]
  x = rng.standard_normal((3, 56)).astype(np.float32)
  out = nnx.jit(lambda m, x: m(x))(linear, x)
  assert mt.relative_error(out, x.astype(np.float64) @ dequantized.T) < 1e-5
  assert mt.relative_error(out, x.astype(np.float64) @ w.T.astype(np.float64)) < 6e-2


@pytest.fixture(scope="module")
def released(tmp_path_factory):
  """A random tiny V4 and its release-layout checkpoint (16 x 16 fp8 blocks)."""
  model, path = build(seed=0), tmp_path_factory.mktemp("v4_released")
  write_released(model, path)
  return model, path


def test_released_checkpoint_keeps_its_dtypes(released):
  """fp8 projections stay e4m3 with e8m0 block scales; routed experts stay packed fp4, half a
  byte a value plus one byte per 32; the rest computes in the compute dtype."""
  model, path = released
  kept = load_pretrained(path, dtype="fp8", backend="xla")
  layer = kept.model.layers[1]
  experts = layer.mlp.experts.gate_proj
  assert isinstance(experts, BlockScaledWeight) and experts.packed
  assert experts.quantized.dtype == jnp.uint8 and experts.quantized.shape == (8, 32, 32)
  assert experts.scale_inv.dtype == jnp.float8_e8m0fnu and experts.scale_inv.shape == (8, 32, 2)
  q_b = layer.self_attn.q_b_proj.weight
  assert isinstance(q_b, BlockScaledWeight) and q_b.quantized.dtype == jnp.float8_e4m3fn
  assert q_b.scale_inv.dtype == jnp.float8_e8m0fnu and q_b.block == (16, 16)
  assert layer.self_attn.compressor.kv_proj.weight.dtype == jnp.bfloat16  # stored float
  assert kept.dtype == jnp.bfloat16


def test_released_model_matches_float64_reference(released):
  """Kept as stored and computing in float32, the model is the float64 reference of its
  dequantized weights (``dtype=float32`` dequantizes at load: fp8 and fp4 times a power of
  two are exact in float32), and within fp4's rounding of the model it was quantized from."""
  model, path = released
  kept = load_pretrained(path, dtype="fp8", compute_dtype=jnp.float32, backend="xla",
                         grouped_matmul="ragged_dot")  # XLA:CPU compiles it fastest
  dequantized = load_pretrained(path, dtype=jnp.float32, backend="xla")
  ids = np.random.default_rng(4).integers(0, 256, (1, 37))
  got = run(kept, jnp.asarray(ids, jnp.int32))
  want = ref.forward(ref.params_of(dequantized), dequantized.config, ids[0])
  assert rel_err(got[0], want) < 1e-5
  # e2m1 keeps one mantissa bit: a value moves by up to 1/4 of its group's top power of two.
  assert rel_err(got[0], ref.forward(ref.params_of(model), model.config, ids[0])) < 0.25


def _rewrite(path, out, edit):
  tensors = {name: h.read() for name, h in open_checkpoint(path).items()}
  edit(tensors)
  out.mkdir()
  write_safetensors(tensors, out / "model.safetensors")
  (out / "config.json").write_text((path / "config.json").read_text())
  return out


def test_fp4_expert_without_its_scales_is_named(released, tmp_path):
  _, path = released
  name = "layers.2.ffn.experts.5.w3.weight"
  bad = _rewrite(path, tmp_path / "bad", lambda t: t.pop("layers.2.ffn.experts.5.w3.scale"))
  for dtype in ("fp8", jnp.float32):
    with pytest.raises(CheckpointError, match=f"{name}: fp4 \\(MXFP4\\) without its scales"):
      load_pretrained(bad, dtype=dtype, backend="xla")


def test_mixed_expert_formats_are_named(released, tmp_path):
  """A stacked parameter keeps one format: an fp8 expert among fp4 ones is refused."""
  _, path = released
  name = "layers.1.ffn.experts.3.w1.weight"

  def edit(tensors):
    tensors[name], tensors[name.removesuffix("weight") + "scale"] = quantize_fp8(
        dequantize_mxfp4(tensors[name], tensors.pop(name.removesuffix("weight") + "scale")),
        (16, 16))

  bad = _rewrite(path, tmp_path / "mixed", edit)
  with pytest.raises(CheckpointError, match=f"{name}: stored fp8, but the model keeps this "
                                            "stacked parameter as fp4"):
    load_pretrained(bad, dtype="fp8", backend="xla")
  load_pretrained(bad, dtype=jnp.float32, backend="xla")  # dequantized, each its own way


def test_keeping_weights_of_a_float_checkpoint_is_refused(tmp_path):
  from mla_jax.v4.checkpoint import save_pretrained

  save_pretrained(V4CausalLM(tiny_v4_config(), rngs=nnx.Rngs(0), backend="xla"), tmp_path)
  with pytest.raises(CheckpointError, match="none is stored as fp8 or fp4"):
    load_pretrained(tmp_path, dtype="fp8", backend="xla")
