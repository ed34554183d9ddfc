"""The deliberately misrouted layer: it reproduces the engine bug, and only when asked for."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import testing as mt
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.misrouted import MisroutedV32Attention


@pytest.fixture(scope="module")
def pair():
  """An honest model and a misrouted one with the same weights (read-only in the tests)."""
  good = CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0), backend="xla")
  mt.randomize_params(good, 3)
  bad = CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0), backend="xla",
                 attention_class=MisroutedV32Attention)
  nnx.update(bad, nnx.state(good, nnx.Param))
  return good, bad


def test_attention_class_is_used_in_every_layer_and_keeps_the_parameters(pair):
  good, bad = pair
  cfg = good.config
  assert all(type(bad.layer_module(i).self_attn) is MisroutedV32Attention
             for i in range(cfg.num_layers))
  assert nnx.state(good, nnx.Param).keys() == nnx.state(bad, nnx.Param).keys()


def test_short_prefill_skips_scoring_and_long_one_matches(pair):
  good, bad = pair
  k = good.config.mla.indexer.topk
  rng = np.random.default_rng(0)
  # Jitted: eager op-by-op dispatch of the models was most of this test's time.
  prefill = nnx.jit(lambda model, ids, caches: model(ids, caches, num_cached_tokens=0)[0])
  for length, same in ((k // 2, False), (k + 5, True)):
    ids = jnp.asarray(rng.integers(0, good.config.vocab_size, (1, length)), jnp.int32)
    good_logits = prefill(good, ids, good.init_cache(1, length))
    bad_logits = prefill(bad, ids, bad.init_cache(1, length))
    if same:  # past top-k the buggy metadata says sparse, and the layer scores
      chex.assert_trees_all_close(bad_logits, good_logits, rtol=1e-5, atol=1e-5)
    else:
      assert mt.relative_error(bad_logits, good_logits) > 1e-2


def test_attention_class_must_be_an_attention_module():
  with pytest.raises(TypeError, match="attention_class"):
    CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0), backend="xla", attention_class=int)
