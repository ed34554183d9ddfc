"""A layer over a paged cache equals the same layer over the contiguous cache, on every backend
and cache format: pages in a shuffled order, ragged prefill then decode, and the sparse MQA
reading physical rows straight from the pool."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mla_jax as m
from mla_jax import testing as mt
from mla_jax.cache import resolve_cache_dtype
from mla_jax.paged_cache import PagedLayerCache, empty_pools
from tests.conftest import module_backends

PAGE, PAGES_PER_SEQ, POOL_PAGES = 16, 6, 20


@pytest.mark.parametrize("backend", module_backends())
@pytest.mark.parametrize("cache_dtype", ["fp32", "fp8"])
def test_paged_layer_equals_contiguous(backend, cache_dtype):
  config = m.tiny()
  layer = m.DeepseekV32Attention(config, rngs=nnx.Rngs(0), backend=backend)
  mt.randomize_params(layer, 1)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.normal(size=(2, 40, config.hidden_size)), jnp.float32)
  token = jnp.asarray(rng.normal(size=(2, 1, config.hidden_size)), jnp.float32)
  lens = jnp.array([40, 23], jnp.int32)

  cache = m.init_layer_cache(config, 2, PAGE * PAGES_PER_SEQ, cache_dtype)
  want_prefill, cache, _, _ = layer(prompt, cache, new_lens_B=lens, num_cached_tokens=0)
  want_decode, cache, _, _ = layer(token, cache, num_cached_tokens=40)

  latent, keys = empty_pools(config, 1, POOL_PAGES * PAGE, resolve_cache_dtype(cache_dtype),
                             index_keys=True)
  table = jnp.asarray(rng.permutation(POOL_PAGES)[:2 * PAGES_PER_SEQ].reshape(2, -1), jnp.int32)
  paged = PagedLayerCache(latent, keys, table, jnp.zeros((1, 2), jnp.int32), PAGE)
  got_prefill, view, _, _ = layer(prompt, paged.layer_view(jnp.int32(0)), new_lens_B=lens,
                                  num_cached_tokens=0)
  got_decode, view, _, _ = layer(token, view.buffers.layer_view(jnp.int32(0)),
                                 num_cached_tokens=40)

  real = (np.arange(40)[None, :] < np.asarray(lens)[:, None])[..., None]
  np.testing.assert_allclose(np.where(real, got_prefill, 0), np.where(real, want_prefill, 0),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_decode, want_decode, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(view.lengths_B, [41, 24])
