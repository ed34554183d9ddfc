"""RoPE against complex multiplication in float64; YaRN against docs/design.md §3's formulas."""

import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import mla_jax as m
from mla_jax import rope


def _complex_reference(x, positions, inv_freq, *, interleaved):
  half = x.shape[-1] // 2
  z = x[..., 0::2] + 1j * x[..., 1::2] if interleaved else x[..., :half] + 1j * x[..., half:]
  z = z * np.exp(1j * positions[:, None] * inv_freq[None, :])
  out = np.empty_like(x)
  if interleaved:
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
  else:
    out[..., :half], out[..., half:] = z.real, z.imag
  return out


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("preset", ["deepseek_v32", "glm5"])
def test_rope_matches_complex_multiplication(interleaved, preset):
  cfg = m.config.PRESETS[preset]()
  rng = np.random.default_rng(0)
  x = rng.standard_normal((37, cfg.qk_rope_head_dim))
  positions = rng.integers(0, cfg.max_position_embeddings, size=37)
  out = rope.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions), cfg.rope,
                        interleaved=interleaved, max_position=cfg.max_position_embeddings)
  ref = _complex_reference(x, positions.astype(np.float64),
                           rope.rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim),
                           interleaved=interleaved)
  assert np.linalg.norm(np.asarray(out) - ref) / np.linalg.norm(ref) < 1e-5


def test_pairings_differ_so_a_swap_is_caught():
  cfg = m.tiny()
  x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)), jnp.float32)
  pos = jnp.arange(8) + 5
  a = rope.apply_rope(x, pos, cfg.rope, interleaved=True, max_position=64)
  b = rope.apply_rope(x, pos, cfg.rope, interleaved=False, max_position=64)
  assert float(jnp.abs(a - b).max()) > 0.1


def test_rope_with_heads_axis_broadcasts_positions():
  cfg = m.tiny()
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 3, 16)), jnp.float32)
  pos = jnp.arange(10).reshape(2, 5)
  out = rope.apply_rope(x, pos, cfg.rope, interleaved=True, max_position=64)
  chex.assert_shape(out, (2, 5, 3, 16))
  one = rope.apply_rope(x[1, :, 2], pos[1], cfg.rope, interleaved=True, max_position=64)
  np.testing.assert_allclose(out[1, :, 2], one, rtol=1e-6, atol=1e-6)


def test_yarn_correction_range_is_10_23_for_deepseek_v32():
  cfg = m.deepseek_v32()
  assert rope.yarn_correction_range(cfg.rope.yarn, 64, 10000.0) == (10, 23)


def test_yarn_frequencies_follow_the_ramp():
  cfg = m.deepseek_v32()
  theta = 10000.0 ** (-np.arange(0, 64, 2) / 64)
  inv = rope.rope_inv_freq(cfg.rope, 64)
  np.testing.assert_allclose(inv[:11], theta[:11], rtol=1e-12)  # high frequencies kept
  np.testing.assert_allclose(inv[23:], theta[23:] / 40, rtol=1e-12)  # low ones divided by 40
  i = 15
  ramp = (i - 10) / 13
  assert inv[i] == pytest.approx(theta[i] / 40 * ramp + theta[i] * (1 - ramp), rel=1e-12)


@pytest.mark.parametrize("position", [0, 4095, 4096, 163839])
def test_frequency_table_matches_float64_at_long_positions(position):
  cfg = m.deepseek_v32()
  x = np.zeros((1, 64))
  x[0, 0::2] = 1.0  # unit complex numbers: the output is cos/sin of the angles
  out = rope.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray([position]), cfg.rope,
                        interleaved=True, max_position=cfg.max_position_embeddings)
  angles = position * rope.rope_inv_freq(cfg.rope, 64)
  np.testing.assert_allclose(np.asarray(out)[0, 0::2], np.cos(angles), atol=2e-6)
  np.testing.assert_allclose(np.asarray(out)[0, 1::2], np.sin(angles), atol=2e-6)


def test_yarn_magnitude_is_one_for_deepseek_and_scales_otherwise():
  assert rope.rope_attention_factor(m.deepseek_v32().rope) == 1.0
  yarn = m.YarnConfig(factor=40.0, mscale=1.0, mscale_all_dim=0.0)
  expected = 0.1 * math.log(40.0) + 1.0
  assert rope.rope_attention_factor(m.RopeConfig(yarn=yarn)) == pytest.approx(expected)


def test_no_yarn_means_plain_frequencies():
  cfg = m.glm5()
  np.testing.assert_allclose(rope.rope_inv_freq(cfg.rope, 64),
                             1e6 ** (-np.arange(0, 64, 2) / 64), rtol=1e-12)
