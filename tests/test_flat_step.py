"""An engine's flat step, below the engine: its plans (segmented, from the bucket alone), the
indexer's per-row key blocks (exactly the one-shot top-k), and a flat step of several sequences
against each sequence run alone."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mla_jax as m
from mla_jax import testing as mt
from mla_jax.backends import XlaBackend
from mla_jax.indexer import KeyBlocks, blocks_needed, segmented_topk, topk_indices
from mla_jax.paged_cache import PagedLayerCache, empty_pools
from mla_jax.routing import PrefillRoute, route_for_layers
from mla_jax.step_plan import StepPlan, plan_flat_step
from tests.helpers import XlaNoDenseBackend

TOPK = m.tiny().indexer.topk


@pytest.mark.parametrize("cls, backend_cls, fresh", list(itertools.product(
    (m.MLAAttention, m.DeepseekV32Attention), (XlaBackend, XlaNoDenseBackend),
    (None, 1, TOPK, TOPK + 1, 40))))
def test_a_flat_plan_is_dense_only_when_every_sequence_is_fresh_within_the_topk(
    cls, backend_cls, fresh):
  """Never masked (a flat step reads only its own rows in the MHA form), whatever the masked
  window; the MQA-only class never dense; an unknown (None) freshness is MQA."""
  layer = cls(m.tiny(), rngs=nnx.Rngs(0), backend=backend_cls())
  backend = XlaBackend(masked_mha_max_tokens=960) if backend_cls is XlaBackend else backend_cls()
  plan = plan_flat_step([layer], backend, fresh_tokens=fresh, kv_rows=256, key_chunk=64)
  dense = (cls is m.MLAAttention and backend_cls is XlaBackend and fresh is not None
           and fresh <= TOPK)
  assert plan.route is (PrefillRoute.DENSE_MHA if dense else PrefillRoute.SPARSE_MQA)
  assert plan.segmented and plan.num_new_tokens == 1 and plan.key_chunk == 64
  assert plan.num_cached_tokens == (0 if fresh else None)
  assert not plan.bounds_num_cached  # rows' lengths are positions: no bound to check
  # A batched plan of the same fresh prefill does take the masked window (the contrast).
  if fresh and cls is m.MLAAttention and backend_cls is XlaBackend and TOPK < fresh:
    assert route_for_layers([layer], backend, num_new_tokens=fresh,
                            num_cached_tokens=0) is PrefillRoute.MASKED_MHA


@pytest.mark.parametrize("fields, match", [
    (dict(route=PrefillRoute.MASKED_MHA, num_cached_tokens=0), "no MASKED_MHA route"),
    (dict(route=PrefillRoute.DENSE_MHA, num_cached_tokens=5), "every sequence fresh"),
    (dict(route=PrefillRoute.SPARSE_MQA, num_new_tokens=2), "one token per row"),
    (dict(route=PrefillRoute.SPARSE_MQA, key_chunk=0), "key_chunk"),
    (dict(route=PrefillRoute.SPARSE_MQA, segmented=False, key_chunk=64), "segmented"),
])
def test_segmented_plans_that_cannot_be_built(fields, match):
  plan = dict(route=PrefillRoute.SPARSE_MQA, num_new_tokens=1, num_cached_tokens=None, kv_rows=256,
              layer_classes=(m.MLAAttention,), backend_class=XlaBackend, segmented=True)
  with pytest.raises(ValueError, match=match):
    StepPlan(**{**plan, **fields})


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_each_rows_own_blocks_give_the_one_shot_topk(chunk):
  """Ties (repeated values), NaN and -inf logits, rows with fewer finite scores than k, rows
  of different reaches (0 among them) and spare blocks: the per-row top-k over each row's own
  key blocks is ``topk_indices`` over its keys, the same indices in the same order."""
  rng = np.random.default_rng(chunk)
  reach = np.array([50, 3, 0, 17, TOPK, 2 * TOPK + 1])
  logits = rng.integers(-3, 4, size=(len(reach), 50)).astype(np.float32)  # many ties
  logits[0, 7] = np.nan
  logits[3, :] = -np.inf
  logits[3, 3:5] = 1.0  # two finite scores only
  logits[np.arange(50)[None, :] >= reach[:, None]] = -np.inf  # past each row's reach
  want = topk_indices(jnp.asarray(logits)[:, None], TOPK)[:, 0]
  spare = 3
  blocks = KeyBlocks.for_reaches(reach, chunk, blocks_needed(reach, chunk) + spare)
  cols = np.asarray(blocks.start_N)[:, None] + np.arange(chunk)
  row = np.minimum(np.asarray(blocks.row_N), len(reach) - 1)
  block_logits = np.where(cols < reach[row][:, None],
                          logits[row[:, None], np.minimum(cols, 49)], -np.inf)
  _, got = segmented_topk(jnp.asarray(block_logits), blocks, TOPK)
  np.testing.assert_array_equal(got, want)


def _pool(config, rows, seed):
  latent, keys = empty_pools(config, 1, rows, jnp.float32, index_keys=True)
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=latent.shape), jnp.float32),
          jnp.asarray(rng.normal(size=keys.shape), jnp.float32))


def test_a_flat_step_equals_each_sequence_alone():
  """Three sequences (a decode after 30 cached rows, a continuing chunk of 6 after 20, a fresh
  prompt of 5) laid end to end, one token per row, through one sparse layer: the outputs, the
  rows written and the indexer's key blocks equal each sequence run alone on its own pages
  through the batched path (which test_attention.py checks against the float64 reference)."""
  config = m.tiny()
  layer = m.DeepseekV32Attention(config, rngs=nnx.Rngs(0), backend="xla")
  mt.randomize_params(layer, 2)
  page, pages = 8, 24
  latent, keys = _pool(config, page * pages, 3)
  tables = np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 0, 0, 0]], np.int32)
  starts, counts = (30, 20, 0), (1, 6, 5)
  rng = np.random.default_rng(4)
  x = [jnp.asarray(rng.normal(size=(1, n, config.hidden_size)), jnp.float32) for n in counts]
  seq = np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(counts)] + [[0, 0]])
  pos = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, counts)] + [[0, 0]])
  real = np.concatenate([np.ones(sum(counts), np.int32), [0, 0]])  # two padding rows
  kv_rows = page * tables.shape[1]
  plan = plan_flat_step([layer], layer.backend, fresh_tokens=None, kv_rows=kv_rows,
                        key_chunk=16)
  blocks = KeyBlocks.for_reaches((pos + 1) * real, 16, 32)
  flat = PagedLayerCache(latent, keys, jnp.asarray(tables[seq]), jnp.asarray(pos)[None], page,
                         jnp.asarray(seq), blocks)
  x_T1D = jnp.concatenate([*x, jnp.zeros((1, 2, config.hidden_size))], axis=1)[0][:, None]
  got = layer.attend(x_T1D, flat.layer_view(0), plan, new_lens_B=jnp.asarray(real))
  for s, (start, n) in enumerate(zip(starts, counts)):
    alone = PagedLayerCache(latent, keys, jnp.asarray(tables[s:s + 1]),
                            jnp.full((1, 1), start, jnp.int32), page)
    want = layer(x[s], alone.layer_view(0), num_cached_tokens=start, kv_rows=kv_rows)
    rows = slice(sum(counts[:s]), sum(counts[:s]) + n)
    np.testing.assert_allclose(got.out_BTD[rows, 0], want.out_BTD[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.topk_BTK[rows, 0], want.topk_BTK[0])
    for new, old in zip(jax.tree.leaves(got.cache.buffers.pools),
                        jax.tree.leaves(want.cache.buffers.pools)):
      rows_s = (tables[s][:, None] * page + np.arange(page)).reshape(-1)[:start + n]
      np.testing.assert_allclose(np.asarray(new)[rows_s], np.asarray(old)[rows_s],
                                 rtol=1e-6, atol=1e-6)
