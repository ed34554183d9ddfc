"""A layer over a paged cache equals the same layer over the contiguous cache, on every backend
and cache format: pages in a shuffled order, ragged prefill then decode, and both the indexer
and the sparse MQA reading physical rows straight from the pool (no per-sequence copy of the
keys or the latent rows in the traced program)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mla_jax as m
from mla_jax import sharding
from mla_jax import testing as mt
from mla_jax.backends.on_mesh import MeshOps
from mla_jax.backends.pallas import PallasTritonBackend
from mla_jax.cache import resolve_cache_dtype
from mla_jax.paged_cache import PagedLayerCache, empty_pools
from mla_jax.traces import walk_equations
from tests.conftest import module_backends
from tests.helpers import call
from tests.kernels.indexer_logits_base import pool_inputs

PAGE, PAGES_PER_SEQ, POOL_PAGES = 16, 6, 20


def _paged_cache(config, cache_dtype, rng) -> PagedLayerCache:
  """An empty one-layer pool of ``POOL_PAGES`` pages; two sequences on shuffled pages."""
  latent, keys = empty_pools(config, 1, POOL_PAGES * PAGE, resolve_cache_dtype(cache_dtype),
                             index_keys=True)
  table = jnp.asarray(rng.permutation(POOL_PAGES)[:2 * PAGES_PER_SEQ].reshape(2, -1), jnp.int32)
  return PagedLayerCache(latent, keys, table, jnp.zeros((1, 2), jnp.int32), PAGE)


@functools.partial(nnx.jit, static_argnames="cached")
def _paged_step(layer, x_BTD, paged, lens_B, cached):
  """The layer over layer 0 of ``paged`` (a view is no pytree: it is made inside the jit)."""
  out_BTD, view, _, _ = layer(x_BTD, paged.layer_view(jnp.int32(0)), new_lens_B=lens_B,
                              num_cached_tokens=cached)
  return out_BTD, view.buffers


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

  # Jitted: eager op-by-op dispatch of the XLA layer took most of this test's time.
  cache = m.init_layer_cache(config, 2, PAGE * PAGES_PER_SEQ, cache_dtype)
  want_prefill, cache, _, _ = call(layer, prompt, cache, new_lens=lens)
  want_decode, cache, _, _ = call(layer, token, cache)

  paged = _paged_cache(config, cache_dtype, rng)
  got_prefill, paged = _paged_step(layer, prompt, paged, lens, 0)
  got_decode, paged = _paged_step(layer, token, paged, jnp.ones((2,), jnp.int32), 40)
  view = paged.layer_view(jnp.int32(0))

  real = (np.arange(40)[None, :] < np.asarray(lens)[:, None])[..., None]
  np.testing.assert_allclose(np.where(real, got_prefill, 0), np.where(real, want_prefill, 0),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_decode, want_decode, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(view.num_cached_B, [41, 24])


def _outputs_shaped(jaxpr, shape) -> list[str]:
  """Primitives outside kernel bodies whose result has ``shape``."""
  return [eqn.primitive.name for eqn, in_kernel in walk_equations(jaxpr) if not in_kernel
          for v in eqn.outvars if tuple(getattr(v.aval, "shape", ())) == shape]


@pytest.mark.parametrize("cache_dtype", ["fp32", "fp8"])
@pytest.mark.parametrize("num_tokens", [40, 1], ids=["prefill", "decode"])
def test_paged_step_never_copies_a_sequences_keys(cache_dtype, num_tokens):
  """The paged layer's traced program (Pallas kernels, traced only) holds no [B, S, I] key
  buffer: the indexer kernel takes the whole key pool and reads the rows in place."""
  config = m.tiny()
  layer = m.DeepseekV32Attention(config, rngs=nnx.Rngs(0), backend=PallasTritonBackend())
  paged = _paged_cache(config, cache_dtype, np.random.default_rng(0))
  view = paged.layer_view(jnp.int32(0))
  x = jnp.zeros((2, num_tokens, config.hidden_size), jnp.float32)
  cached = 0 if num_tokens > 1 else 40
  step = lambda x: layer(x, view, num_cached_tokens=cached)[0]
  jaxpr = jax.make_jaxpr(step)(x)
  rows, head_dim = view.capacity, config.indexer.head_dim
  key_buffer = (2, rows, head_dim)
  assert _outputs_shaped(jaxpr, key_buffer) == []
  # The detector sees the copy the contiguous read makes (what the indexer used before).
  assert "gather" in _outputs_shaped(jax.make_jaxpr(lambda: view.rows(rows)[1])(), key_buffer)
  [indexer] = [eqn for eqn, _ in walk_equations(jaxpr) if eqn.primitive.name == "pallas_call"
               and eqn.params["name"] == "indexer_logits"]
  assert (POOL_PAGES * PAGE, head_dim) in [tuple(v.aval.shape) for v in indexer.invars]


def test_pool_mode_on_a_mesh_equals_unsharded():
  """``MeshOps`` replicates the key pool and splits the sequences and their row ids."""
  q, pool, w, starts, ends, scales, key_rows, _ = pool_inputs(4, 16, jnp.float8_e4m3fn)
  q, w, starts, ends, key_rows = (a[:2] for a in (q, w, starts, ends, key_rows))
  args = (q, pool, w, starts, ends, scales, key_rows)
  score = lambda ops: jax.jit(lambda *a: ops.indexer_logits(*a[:5], k_scale_BS=a[5],
                                                            key_rows_BS=a[6]))(*args)
  on_mesh = MeshOps(m.XlaBackend(), sharding.make_mesh("data=2", jax.devices()[:2]))
  np.testing.assert_allclose(score(on_mesh), score(MeshOps(m.XlaBackend())), rtol=1e-6)
