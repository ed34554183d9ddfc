"""DeepSeek-V4's fp8 caches: compressed entries and indexer keys in V3.2's fp8 layouts
(``mla_jax.fp8_cache``), the rings in the model's dtype (docs/models.md, Caches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import fp8_cache
from mla_jax.generation import generate
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
  model = build(seed=11)
  prompts = np.random.default_rng(11).integers(0, 256, (2, PROMPT)).tolist()
  decoded = generate(model, prompts, NEW, cache_dtype="fp8", return_logits=True)
  ids = jnp.asarray([p + t for p, t in zip(prompts, decoded.tokens)], jnp.int32)
  return model, decoded, _forward(model, ids, "fp8"), _forward(model, ids, jnp.float32)


def _dequantized(layer):
  return (np.asarray(fp8_cache.dense_latent(fp8_cache.readable(layer.entries), jnp.float32)),
          None if layer.index_keys is None else
          np.asarray(fp8_cache.dequantize_keys(fp8_cache.readable(layer.index_keys))))


def test_entries_and_keys_are_stored_in_the_v32_fp8_layouts(runs):
  """Every compressed layer's entries (e4m3 latent, a float32 scale per tile, bf16 RoPE part)
  and indexer keys (e4m3, a scale per key) dequantize to within fp8's error (6e-2) of the
  float32 cache's, in float64; the first compressed layer, whose input no fp8 read has touched
  yet, holds exactly the quantized float32 entries and keys. A step keeps the layout."""
  model, _, (_, fp8), (_, f32) = runs
  compressed = [i for i, layer in enumerate(f32.layers) if layer.entries is not None]
  assert compressed and f32.layers[compressed[0]].index_keys is not None
  for i in compressed:
    want_entries, want_keys = f32.layers[i].entries, f32.layers[i].index_keys
    got_entries, got_keys = _dequantized(fp8.layers[i])
    assert fp8.layers[i].entries.values.dtype == jnp.uint8  # e4m3 held as bits
    for got, want in ((got_entries, want_entries), (got_keys, want_keys)):
      if want is None:
        continue
      want = np.asarray(want, np.float64)
      assert np.abs(got - want).max() / np.abs(want).max() < 6e-2, i
    if i == compressed[0]:
      a = model.config.head_dim - model.config.rope_dim
      exact = fp8_cache.dense_latent(fp8_cache.quantize_latent(want_entries, a), jnp.float32)
      np.testing.assert_array_equal(got_entries, exact)
      np.testing.assert_array_equal(
          got_keys, fp8_cache.dequantize_keys(fp8_cache.quantize_keys(want_keys)))
  layout = lambda c: jax.tree.map(lambda a: (a.shape, a.dtype), c.layers)
  assert layout(fp8) == layout(model.init_cache(2, 64, "fp8"))
  assert fp8.layers[compressed[0]].pool_kv.dtype == jnp.float32  # rings: the model's dtype


# Measured on this seed (2 prompts of 24 tokens, 12 new; logits up to 2.4): against the float32
# cache, teacher-forced, max |logprob delta| 0.089 and greedy agreement 1.000 (24 of 24). The
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


def test_fp8_pools_in_an_engine_are_refused_by_name():
  """The engine's pools stay float for V4 (its fp8 pools are not built yet), named before
  anything is allocated."""
  model = build(seed=12)
  with pytest.raises(ValueError, match="an engine does not hold DeepSeek-V4's entries in fp8"):
    model.init_pools(64, "fp8", page_size=8, num_state_slots=2)


def test_serving_a_v4_checkpoint_with_fp8_caches_is_refused_by_name(tmp_path):
  """mla-jax serve runs the engine, whose V4 pools are float: refused before loading
  (mla-jax generate takes --cache-dtype fp8 for V4)."""
  from mla_jax import cli

  (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4"}')
  with pytest.raises(SystemExit, match="--cache-dtype fp8 with mla-jax serve: not supported"):
    cli.main(["serve", "--checkpoint", str(tmp_path), "--cache-dtype", "fp8"])
