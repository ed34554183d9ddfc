"""Training losses against float64 NumPy references, and the indexer's gradient isolation."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import testing as mt
from mla_jax.attention import DeepseekV32Attention, MLAAttention
from mla_jax.backends import XlaBackend
from mla_jax.cache import init_layer_cache
from mla_jax.config import tiny
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax import losses


def _kl_reference(q_BTHL, latent_BSL, index_BTS, keys_BTS, scale):
  """Float64: per query, KL(head-summed L1-normalised attention || softmax(index scores))
  over the query's key set; 0 for a query without keys."""
  q, lat, idx = (np.asarray(a, np.float64) for a in (q_BTHL, latent_BSL, index_BTS))
  b, t, h, _ = q.shape
  out = np.zeros((b, t))
  for bi in range(b):
    for ti in range(t):
      keys = np.flatnonzero(keys_BTS[bi, ti])
      if keys.size == 0:
        continue
      p = np.zeros(keys.size)
      for hi in range(h):
        logits = scale * lat[bi, keys] @ q[bi, ti, hi]
        e = np.exp(logits - logits.max())
        p += e / e.sum()
      p /= p.sum()
      s = idx[bi, ti, keys]
      log_q = s - s.max() - np.log(np.exp(s - s.max()).sum())
      out[bi, ti] = np.sum(p * (np.log(p) - log_q))
  return out


def _random_inputs(seed, b=2, t=9, h=3, length=7):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, h, length))
  latent = jax.random.normal(ks[1], (b, t, length))
  index = 3.0 * jax.random.normal(ks[2], (b, t, t))
  return q, latent, index


def test_dense_indexer_kl_matches_float64_reference():
  q, latent, index = _random_inputs(0)
  positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  kv_len = jnp.array([9, 5], jnp.int32)  # sequence 1 is padded past 5 tokens
  keys = losses.causal_key_mask(positions, kv_len, 9)
  expected = np.tril(np.ones((9, 9), bool))[None] & (np.arange(9) < np.array([9, 5])[:, None,
                                                                                      None])
  np.testing.assert_array_equal(keys, expected)
  p = losses.head_summed_attention(q, latent, keys, 0.4)
  kl = losses.indexer_kl(p, index, keys)
  ref = _kl_reference(q, latent, index, expected, 0.4)
  np.testing.assert_allclose(kl, ref, rtol=1e-5, atol=1e-6)
  assert (ref[:, 1:] > 0).all()  # query 0 has one key: KL 0


def test_sparse_indexer_kl_matches_float64_reference():
  q, latent, index = _random_inputs(1)
  rng = np.random.default_rng(1)
  topk = np.full((2, 9, 4), -1, np.int32)
  for b in range(2):
    for t in range(9):
      chosen = rng.choice(t + 1, size=min(t + 1, int(rng.integers(1, 5))), replace=False)
      topk[b, t, :chosen.size] = chosen
  keys = losses.selected_key_mask(jnp.asarray(topk), 9)
  expected = np.zeros((2, 9, 9), bool)
  for b, t, k in zip(*np.nonzero(topk >= 0)):
    expected[b, t, topk[b, t, k]] = True
  np.testing.assert_array_equal(keys, expected)  # -1 selects nothing (no wrap-around)
  p = losses.head_summed_attention(q, latent, keys, 0.4)
  chex.assert_trees_all_close(p.sum(-1), jnp.ones((2, 9)), rtol=1e-6)
  kl = losses.indexer_kl(p, index, keys)
  np.testing.assert_allclose(kl, _kl_reference(q, latent, index, expected, 0.4), rtol=1e-5,
                             atol=1e-6)


def test_indexer_kl_of_rows_without_keys_is_zero_with_finite_gradient():
  q, latent, index = _random_inputs(2)
  keys = jnp.zeros((2, 9, 9), bool).at[0, 3, :2].set(True)
  grad = jax.grad(lambda i: losses.indexer_kl(
      losses.head_summed_attention(q, latent, keys, 0.4), i, keys).sum())(index)
  chex.assert_tree_all_finite(grad)
  assert float(jnp.abs(grad).sum()) > 0
  kl = losses.indexer_kl(losses.head_summed_attention(q, latent, keys, 0.4), index, keys)
  assert float(jnp.abs(kl).sum() - jnp.abs(kl[0, 3])) == 0.0


def test_next_token_loss_matches_float64_reference():
  ks = jax.random.split(jax.random.key(3), 2)
  logits = 2.0 * jax.random.normal(ks[0], (2, 6, 11))
  ids = jax.random.randint(ks[1], (2, 6), 0, 11)
  lens = jnp.array([6, 4], jnp.int32)
  mask = jnp.array([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]], jnp.float32)
  loss, count = losses.next_token_loss(logits, ids, lens, mask)
  lg, idn = np.asarray(logits, np.float64), np.asarray(ids)
  terms = []
  for b, t in [(0, 1), (0, 3), (0, 4), (0, 5), (1, 1), (1, 2), (1, 3)]:  # t=0 and padding skip
    row = lg[b, t - 1]
    terms.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[idn[b, t]])
  assert int(count) == len(terms)
  np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-6)


@functools.partial(nnx.jit, static_argnames="kind")
def _call(layer, x, cache, lens, kind):
  return layer(x, cache, new_lens_B=lens, num_cached_tokens=0, indexer_loss=kind)


@pytest.mark.parametrize("cls", [MLAAttention, DeepseekV32Attention])
@pytest.mark.parametrize("kind,length", [("dense", 24), ("sparse", 24), ("sparse", 12)])
def test_layer_indexer_loss_matches_float64_layer_reference(cls, kind, length):
  """The layer's loss against an independent float64 layer (MHA form, no Hadamard)."""
  config = tiny()  # top-k 16: length 24 is sparse for both classes, 12 dense-capable dense
  layer = cls(config, rngs=nnx.Rngs(0), backend=XlaBackend())
  mt.randomize_params(layer, 5)
  x = mt.random_hidden(6, (1, length, config.hidden_size))
  out = _call(layer, x, init_layer_cache(config, 1, length), None, kind)
  selected = None
  if kind == "sparse" and out.topk_BTK is not None:
    topk = np.asarray(out.topk_BTK[0])
    selected = np.zeros((length, length), bool)
    for t, row in enumerate(topk):
      selected[t, row[row >= 0]] = True
  ref, scores = mt.indexer_kl_reference(mt.numpy_params(layer), config, x[0], selected)
  if selected is not None:  # a valid top-k: the chosen scores are the k largest (ties aside)
    for t in range(length):
      chosen = np.sort(scores[t, selected[t]])[::-1]
      best = np.sort(scores[t, :t + 1])[::-1][:chosen.size]
      np.testing.assert_allclose(chosen, best, rtol=1e-4, atol=1e-6)
  assert ref > 0
  np.testing.assert_allclose(float(out.indexer_loss), ref, rtol=2e-4)


def test_layer_indexer_loss_averages_real_tokens_only():
  config = tiny()
  layer = MLAAttention(config, rngs=nnx.Rngs(0), backend=XlaBackend())
  mt.randomize_params(layer, 7)
  x = mt.random_hidden(8, (2, 20, config.hidden_size))
  lens = jnp.array([20, 11], jnp.int32)
  out = _call(layer, x, init_layer_cache(config, 2, 20), lens, "dense")
  params = mt.numpy_params(layer)
  per_seq = [mt.indexer_kl_reference(params, config, x[b, :n])[0] for b, n in ((0, 20), (1, 11))]
  np.testing.assert_allclose(float(out.indexer_loss), (20 * per_seq[0] + 11 * per_seq[1]) / 31,
                             rtol=2e-4)


def test_no_indexer_loss_without_request_or_indexer():
  config = tiny()
  layer = MLAAttention(config, rngs=nnx.Rngs(0), backend=XlaBackend())
  x = mt.random_hidden(9, (1, 8, config.hidden_size))
  assert _call(layer, x, init_layer_cache(config, 1, 8), None, None).indexer_loss is None
  with pytest.raises(ValueError, match="indexer_loss must be one of"):
    layer(x, init_layer_cache(config, 1, 8), num_cached_tokens=0, indexer_loss="kl")


def _split_grads(grads):
  flat = {"/".join(map(str, path)): np.asarray(v) for path, v in
          jax.tree_util.tree_flatten_with_path(grads)[0]}
  indexer = {k: v for k, v in flat.items() if "indexer" in k}
  rest = {k: v for k, v in flat.items() if "indexer" not in k}
  return indexer, rest


@pytest.mark.parametrize("attention", ["mqa-only", "dense-capable"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_indexer_is_detached_from_the_main_graph(attention, kind):
  """The LM loss gives every indexer parameter zero gradient; the indexer loss gives every
  other parameter zero gradient (and each gives its own side a non-zero one)."""
  model = CausalLM(tiny_lm(attention, moe=False), rngs=nnx.Rngs(0), backend="xla")
  mt.randomize_params(model, 11)
  graphdef, state = nnx.split(model)
  ids = jax.random.randint(jax.random.key(12), (2, 24), 0, 256)  # 24 > top-k 16: sparse
  lens = jnp.array([24, 19], jnp.int32)

  def loss(state, which):
    logits, kl = nnx.merge(graphdef, state).forward_train(ids, lens, indexer_loss=kind)
    lm, _ = losses.next_token_loss(logits, ids, lens, jnp.ones(ids.shape))
    return lm if which == "lm" else kl

  grads = jax.jit(lambda state: (jax.grad(loss)(state, "lm"), jax.grad(loss)(state, "kl")))
  lm_grads, kl_grads = grads(state)
  lm_indexer, lm_rest = _split_grads(lm_grads)
  kl_indexer, kl_rest = _split_grads(kl_grads)
  assert lm_indexer and all((g == 0).all() for g in lm_indexer.values())
  assert all((g == 0).all() for g in kl_rest.values())
  assert all(np.abs(g).sum() > 0 for g in kl_indexer.values())
  assert sum(np.abs(g).sum() > 0 for g in lm_rest.values()) == len(lm_rest)
