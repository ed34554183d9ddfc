"""DeepSeek-V4's fp8 caches: compressed entries and indexer keys in V3.2's fp8 layouts
(``mla_jax.fp8_cache``), the rings in the model's dtype (docs/models.md, Caches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import fp8_cache
from mla_jax.generation import generate
from mla_jax.v4.compressor import write_entries
from tests.test_v4_model import _step, build

PROMPT, NEW = 24, 12


def _forward(model, ids, cache_dtype):
  """Teacher-forced logits of ``ids`` in one step from empty caches, and the caches after."""
  logits, caches = _step(model, ids, model.init_cache(ids.shape[0], 64, cache_dtype))
  return np.asarray(logits), caches


@pytest.fixture(scope="module")
def runs():
  """Greedy tokens decoded with fp8 caches, then prompt + tokens teacher-forced through fp8
  and float32 caches."""
  model = build(seed=11, head_dim=136)  # entries of 128 latent values: two tiles of 64
  prompts = np.random.default_rng(11).integers(0, 256, (2, PROMPT)).tolist()
  decoded = generate(model, prompts, NEW, cache_dtype="fp8", return_logits=True)
  ids = jnp.asarray([p + t for p, t in zip(prompts, decoded.tokens)], jnp.int32)
  return model, decoded, _forward(model, ids, "fp8"), _forward(model, ids, jnp.float32)


def _dequantized(layer):
  return (np.asarray(fp8_cache.dense_latent(fp8_cache.readable(layer.entries), jnp.float32)),
          None if layer.index_keys is None else
          np.asarray(fp8_cache.dequantize_keys(fp8_cache.readable(layer.index_keys))))


def test_written_entries_and_keys_dequantize_to_float64_within_fp8_error(runs):
  """Fresh random rows written into a compressed layer's fp8 pools (e4m3 latent, a float32
  scale per 64 values, the RoPE part in bf16; e4m3 keys, a scale per key) dequantize to within
  fp8's error of the float64 rows; rows not kept stay empty."""
  model = runs[0]
  layer = model.attentions[1]
  cache = layer.init_cache(1, 4, 8, jnp.float32, entry_dtype="fp8")  # 8 entry rows
  assert cache.entries.tile == 64 and cache.entries.values.dtype == jnp.uint8  # e4m3 bits
  rng = np.random.default_rng(13)
  rows = jnp.asarray([6, 1, 3, 7], jnp.int32)
  keep = jnp.asarray([True, True, False, True])
  for pool, dequantize, width in (
      (cache.entries, lambda p: fp8_cache.dense_latent(p, jnp.float32), 136),
      (cache.index_keys, fp8_cache.dequantize_keys, model.config.index_head_dim)):
    new = rng.standard_normal((4, width)) * rng.uniform(0.01, 10, (4, 1))
    got = np.asarray(dequantize(fp8_cache.readable(
        write_entries(pool, jnp.asarray(new, jnp.float32), rows, keep))))
    for j, row in enumerate(np.asarray(rows)):
      want = new[j] if keep[j] else np.zeros(width)
      assert np.abs(got[row] - want).max() <= 6e-2 * np.abs(want).max(), (width, j)
    assert not got[[0, 2, 4, 5]].any()


def test_entries_of_a_step_are_its_float32_entries_quantized(runs):
  """The first compressed layer, whose input no fp8 read has touched yet, holds exactly the
  float32 cache's entries and keys quantized; deeper layers' differ by what the fp8 reads
  above them changed too (measured 0.069 of the largest entry). A step keeps the layout."""
  model, _, (_, fp8), (_, f32) = runs
  compressed = [i for i, layer in enumerate(f32.layers) if layer.entries is not None]
  first = compressed[0]
  assert f32.layers[first].index_keys is not None
  a = model.config.head_dim - model.config.rope_dim
  got_entries, got_keys = _dequantized(fp8.layers[first])
  want_entries, want_keys = f32.layers[first].entries, f32.layers[first].index_keys
  np.testing.assert_array_equal(got_entries, fp8_cache.dense_latent(
      fp8_cache.quantize_latent(want_entries, a, 64), jnp.float32))
  np.testing.assert_array_equal(
      got_keys, fp8_cache.dequantize_keys(fp8_cache.quantize_keys(want_keys)))
  for i in compressed:
    want = np.asarray(f32.layers[i].entries, np.float64)
    assert np.abs(_dequantized(fp8.layers[i])[0] - want).max() < 0.1 * np.abs(want).max(), i
  layout = lambda c: jax.tree.map(lambda a: (a.shape, a.dtype), c.layers)
  assert layout(fp8) == layout(model.init_cache(2, 64, "fp8"))
  assert fp8.layers[first].pool_kv.dtype == jnp.float32  # rings: the model's dtype


# Measured on this seed (2 prompts of 24 tokens, 12 new; logits up to 2.1): against the float32
# cache, teacher-forced, max |logprob delta| 0.105 and greedy agreement 1.000 (24 of 24). The
# bounds leave room for a near tie flipped on another jax version (2 of 24 tokens).
MAX_LOGPROB_DELTA, MIN_AGREEMENT = 0.15, 0.9


def test_generate_with_fp8_caches_against_float32_caches(runs):
  """Decoding with fp8 caches gives the logits of a forward over the same quantized entries
  (so decode steps write the fp8 entries right); against the float32 cache, teacher-forced
  over the same tokens, the log-probabilities stay within a bound and greedy tokens agree
  but for near ties."""
  _, decoded, (fp8_logits, _), (f32_logits, _) = runs
  fp8_logits, f32_logits = fp8_logits[:, PROMPT - 1:-1], f32_logits[:, PROMPT - 1:-1]
  np.testing.assert_array_equal(fp8_logits.argmax(-1), np.asarray(decoded.tokens))
  np.testing.assert_allclose(decoded.step_logits, fp8_logits[:, 1:], rtol=1e-3, atol=1e-3)
  logprobs = lambda x: np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), -1))
  delta = np.abs(logprobs(fp8_logits) - logprobs(f32_logits)).max()
  agreement = (fp8_logits.argmax(-1) == f32_logits.argmax(-1)).mean()
  print(f"fp8 vs float32 caches: max |logprob delta| {delta:.3g}, greedy agreement "
        f"{agreement:.3f}, max |logit| {np.abs(f32_logits).max():.3g}")
  assert delta < MAX_LOGPROB_DELTA and agreement >= MIN_AGREEMENT


def test_serve_takes_fp8_caches_for_a_v4_checkpoint():
  """mla-jax serve passes --cache-dtype fp8 on to its engine for a V4 checkpoint (the engine's
  fp8 pools: tests/test_v4_engine.py); the flags V4 cannot take under serve stay refused."""
  from mla_jax import cli
  from mla_jax.v4 import cli as v4_cli

  serve = ["serve", "--checkpoint", "tiny-v4", "--cache-dtype", "fp8"]
  v4_cli.check_flags(cli.build_parser().parse_args(serve), serving=True)
  with pytest.raises(SystemExit, match="^error: --speculative-tokens with mla-jax serve: not"):
    v4_cli.check_flags(cli.build_parser().parse_args([*serve, "--speculative-tokens", "1"]),
                       serving=True)
