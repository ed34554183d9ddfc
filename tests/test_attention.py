"""MLA modules against the float64 reference; route equivalence; cache contract; bad input."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

import mla_jax as m
from mla_jax import checks
from mla_jax import testing as mt
from mla_jax.routing import PrefillRoute
from tests.conftest import module_backends
from tests.helpers import XlaNoDenseBackend, call, fresh_cache, make_pair, tiny_no_indexer

TOPK = m.tiny().indexer.topk


def _yarn(mscale: float, mscale_all_dim: float) -> m.MLAConfig:
  """tiny() with YaRN: the softmax scale is no longer qk_head_dim**-0.5, and when the two
  mscales differ RoPE's cos/sin carry a magnitude != 1 as well."""
  yarn = m.YarnConfig(factor=4.0, original_max_position_embeddings=32, mscale=mscale,
                      mscale_all_dim=mscale_all_dim)
  return dataclasses.replace(m.tiny(), rope=m.RopeConfig(theta=10000.0, yarn=yarn))


CONFIGS = {"tiny": m.tiny(), "yarn_equal_mscales": _yarn(1.0, 1.0),
           "yarn_mscales_differ": _yarn(1.0, 0.5)}


def _run(layer, x, **kwargs):
  return call(layer, x, fresh_cache(layer.config, x.shape[0]), **kwargs)


def test_yarn_configs_separate_the_softmax_scale_from_the_default():
  """What the YaRN cases are for: a module using qk_head_dim**-0.5 would fail them."""
  for name in ("yarn_equal_mscales", "yarn_mscales_differ"):
    cfg = CONFIGS[name]
    assert abs(cfg.softmax_scale / cfg.qk_head_dim**-0.5 - 1) > 0.1, name


@pytest.mark.parametrize("backend", module_backends())
@pytest.mark.parametrize("config_name, length", [
    *(("tiny", n) for n in (1, TOPK - 1, TOPK, TOPK + 1, 4 * TOPK)),
    *((name, n) for name in ("yarn_equal_mscales", "yarn_mscales_differ")
      for n in (TOPK, 4 * TOPK))])
def test_both_classes_match_float64_reference(backend, config_name, length):
  """At length <= TOPK the dense-capable class takes dense MHA and the other sparse MQA."""
  dense, mqa = make_pair(CONFIGS[config_name], backend=backend)
  x = mt.random_hidden(length, (1, length, dense.config.hidden_size))
  ref = mt.mla_attention_reference(mt.numpy_params(dense), dense.config, np.asarray(x[0]))
  for layer in (dense, mqa):
    out = _run(layer, x).out_BTD
    chex.assert_shape(out, x.shape)
    chex.assert_tree_all_finite(out)
    assert mt.relative_error(out[0], ref) < 1e-5, type(layer).__name__


@pytest.mark.parametrize("interleave", [False, True])
def test_indexer_pairing_follows_config_and_a_swap_is_detected(interleave):
  cfg = dataclasses.replace(m.tiny(), indexer=dataclasses.replace(m.tiny().indexer,
                                                                  rope_interleave=interleave))
  _, mqa = make_pair(cfg)
  x = mt.random_hidden(7, (1, 6 * TOPK, cfg.hidden_size))
  out = _run(mqa, x).out_BTD[0]
  params = mt.numpy_params(mqa)
  right = mt.mla_attention_reference(params, cfg, np.asarray(x[0]))
  swapped_cfg = dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer,
                                                                     rope_interleave=not interleave))
  wrong = mt.mla_attention_reference(params, swapped_cfg, np.asarray(x[0]))
  assert mt.relative_error(out, right) < 1e-5
  assert mt.relative_error(out, wrong) > 1e-3


def test_mha_form_equals_mqa_form():
  dense, _ = make_pair()
  x = mt.random_hidden(11, (2, TOPK, dense.config.hidden_size))
  mha = _run(dense, x)
  mqa = _run(dense, x, force_mqa=True)
  assert dense.prefill_route(TOPK) is PrefillRoute.DENSE_MHA
  assert mt.relative_error(mha.out_BTD, mqa.out_BTD) < 1e-5
  assert mha.topk_BTK is None and mqa.topk_BTK is not None


def test_mha_form_equals_dense_mqa_without_indexer():
  cfg = tiny_no_indexer()
  dense, _ = make_pair(cfg)
  no_dense = m.MLAAttention(cfg, rngs=nnx.Rngs(0), backend=XlaNoDenseBackend())
  nnx.update(no_dense, nnx.state(dense, nnx.Param))
  x = mt.random_hidden(12, (1, 3 * TOPK, cfg.hidden_size))
  a, b = _run(dense, x), _run(no_dense, x)
  ref = mt.mla_attention_reference(mt.numpy_params(dense), cfg, np.asarray(x[0]))
  assert mt.relative_error(a.out_BTD[0], ref) < 1e-5
  assert mt.relative_error(b.out_BTD[0], ref) < 1e-5


@pytest.mark.parametrize("length", [TOPK, 3 * TOPK])
def test_dense_capable_and_mqa_only_agree_with_same_weights(length):
  dense, mqa = make_pair(seed=4)
  x = mt.random_hidden(13, (2, length, dense.config.hidden_size))
  a, b = _run(dense, x), _run(mqa, x)
  assert mt.relative_error(a.out_BTD, b.out_BTD) < 1e-5
  chex.assert_trees_all_close(a.cache, b.cache, rtol=1e-6, atol=1e-6)


def test_mqa_only_short_prefill_reaches_scoring_with_valid_rows():
  """The vLLM #52512 regression: the metadata says short, the layer can only do MQA."""
  _, mqa = make_pair()
  length = TOPK // 2
  out = _run(mqa, mt.random_hidden(14, (2, length, mqa.config.hidden_size)))
  assert out.topk_BTK is not None
  valid = np.asarray((out.topk_BTK >= 0).sum(-1))
  np.testing.assert_array_equal(valid, np.broadcast_to(np.arange(1, length + 1), (2, length)))
  assert float(jnp.abs(out.out_BTD).min(axis=-1).max()) > 0


def _hadamard(n):
  """Orthonormal Walsh-Hadamard matrix by Kronecker products (built apart from the module's)."""
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
  return h / np.sqrt(n)


def _expected_keys(layer, x_BTD, num_cached_B, new_lens_B):
  """Per sequence, the float64 keys of its real new rows at their positions (rotated by the
  Hadamard matrix when configured), from ``testing.indexer_keys_reference``."""
  params, cfg = mt.numpy_params(layer), layer.config
  rotate = _hadamard(cfg.indexer.head_dim) if cfg.indexer.use_hadamard else 1.0
  out = []
  for b, (start, n) in enumerate(zip(num_cached_B, new_lens_B)):
    keys = mt.indexer_keys_reference(params, cfg, np.asarray(x_BTD[b, :n]), start + np.arange(n))
    out.append(keys @ rotate)
  return out


@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleaved"])
def test_index_key_cache_matches_float64_on_every_route(interleave):
  """Keys written by a fresh ragged prefill (dense route on the dense-capable class, sparse on
  the MQA-only one) and by a cached-prefix dense step, against an independent float64
  computation; padding rows and rows past each sequence stay unwritten."""
  cfg = dataclasses.replace(m.tiny(), indexer=dataclasses.replace(m.tiny().indexer,
                                                                  rope_interleave=interleave))
  dense, mqa = make_pair(cfg)
  x = mt.random_hidden(15, (2, 10, cfg.hidden_size))
  more = mt.random_hidden(35, (2, 4, cfg.hidden_size))
  first_lens, more_lens = np.array([10, 6]), np.array([4, 2])
  assert dense.prefill_route(10, 0) is PrefillRoute.DENSE_MHA
  assert dense.prefill_route(4, 10) is PrefillRoute.DENSE_MHA  # 14 <= top-k: dense again
  for layer in (dense, mqa):
    first = call(layer, x, fresh_cache(cfg, 2, capacity=32), new_lens=first_lens)
    second = call(layer, more, first.cache, new_lens=more_lens)
    assert (first.topk_BTK is None) == (second.topk_BTK is None) == (layer is dense)
    got_first = np.asarray(first.cache.index_keys_BSI)
    got = np.asarray(second.cache.index_keys_BSI)
    expect_first = _expected_keys(layer, x, [0, 0], first_lens)
    expect_more = _expected_keys(layer, more, first_lens, more_lens)
    for b in range(2):
      n0, n1 = first_lens[b], more_lens[b]
      np.testing.assert_allclose(got_first[b, :n0], expect_first[b], rtol=1e-5, atol=1e-5)
      np.testing.assert_array_equal(got_first[b, n0:], 0.0)  # padding rows not written
      np.testing.assert_array_equal(got[b, :n0], got_first[b, :n0])  # the prefix is kept
      np.testing.assert_allclose(got[b, n0:n0 + n1], expect_more[b], rtol=1e-5, atol=1e-5)
      np.testing.assert_array_equal(got[b, n0 + n1:], 0.0)
    np.testing.assert_array_equal(second.cache.num_cached_B, first_lens + more_lens)


def test_prefill_then_continuation_matches_one_long_prefill():
  dense, mqa = make_pair()
  x = mt.random_hidden(16, (1, 3 * TOPK, dense.config.hidden_size))
  for layer in (dense, mqa):
    whole = _run(layer, x)
    first = _run(layer, x[:, :TOPK - 4])
    rest = call(layer, x[:, TOPK - 4:], first.cache)
    joined = jnp.concatenate([first.out_BTD, rest.out_BTD], axis=1)
    assert mt.relative_error(joined, whole.out_BTD) < 1e-5
    chex.assert_trees_all_close(rest.cache, whole.cache, rtol=1e-6, atol=1e-6)


def test_cached_prefix_counts_toward_the_dense_bound():
  dense, _ = make_pair()
  x = mt.random_hidden(17, (1, TOPK, dense.config.hidden_size))
  first = _run(dense, x[:, :6])
  short = call(dense, x[:, 6:10], first.cache)  # 10 <= topk: dense with 6 cached rows
  long = call(dense, x[:, 6:], first.cache)     # 16 <= topk: still dense
  assert short.topk_BTK is None and long.topk_BTK is None
  ref = mt.mla_attention_reference(mt.numpy_params(dense), dense.config, np.asarray(x[0]))
  assert mt.relative_error(long.out_BTD[0], ref[6:]) < 1e-5
  past = call(dense, mt.random_hidden(18, (1, 11, dense.config.hidden_size)), first.cache)
  assert past.topk_BTK is not None  # 6 + 11 > topk: sparse


def test_ragged_batch_equals_each_sequence_alone():
  _, mqa = make_pair()
  x = mt.random_hidden(19, (2, 2 * TOPK, mqa.config.hidden_size))
  lens = jnp.array([2 * TOPK, TOPK + 3], jnp.int32)
  both = call(mqa, x, fresh_cache(mqa.config, 2), new_lens=lens)
  alone = _run(mqa, x[1:, :TOPK + 3])
  assert mt.relative_error(both.out_BTD[1, :TOPK + 3], alone.out_BTD[0]) < 1e-5
  np.testing.assert_array_equal(both.cache.num_cached_B, lens)
  np.testing.assert_array_equal(both.cache.latent_BSL[1, TOPK + 3:], 0.0)  # padding not written


def _cache_with_stale_rows(config, lengths, stale, capacity=16):
  """A cache holding random live rows and ``stale`` in every row at or past a sequence's length,
  as a reused or donated buffer would."""
  num_cached_B = jnp.asarray(lengths, jnp.int32)
  live_BS1 = (jnp.arange(capacity)[None, :] < num_cached_B[:, None])[..., None]
  cache = fresh_cache(config, len(lengths), capacity)
  rows = lambda seed, x: jnp.where(live_BS1, mt.random_hidden(seed, x.shape), stale)
  return m.LayerCache(latent_BSL=rows(32, cache.latent_BSL),
                      index_keys_BSI=rows(33, cache.index_keys_BSI), num_cached_B=num_cached_B)


@pytest.mark.parametrize("backend", module_backends())
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
def test_poisoned_stale_cache_rows_never_reach_real_rows(backend, poison):
  """Both routes read past the live length (dense: every row up to the static bound)."""
  dense, mqa = make_pair(backend=backend)
  x = mt.random_hidden(30, (2, 6, dense.config.hidden_size))
  new_lens = jnp.array([6, 3], jnp.int32)  # sequence 1 keeps stale rows 8-10 among its keys
  real_BT = np.arange(6)[None, :] < np.asarray(new_lens)[:, None]
  assert dense.prefill_route(6, 5) is PrefillRoute.DENSE_MHA
  assert mqa.prefill_route(6, 5) is PrefillRoute.SPARSE_MQA
  outs = []
  for layer in (dense, mqa):
    clean = call(layer, x, _cache_with_stale_rows(layer.config, [5, 5], 0.5), new_lens=new_lens)
    got = call(layer, x, _cache_with_stale_rows(layer.config, [5, 5], poison), new_lens=new_lens)
    got, clean = np.asarray(got.out_BTD)[real_BT], np.asarray(clean.out_BTD)[real_BT]
    np.testing.assert_array_equal(got, clean)
    chex.assert_tree_all_finite(got)
    outs.append(got)
  assert mt.relative_error(outs[0], outs[1]) < 1e-5


@pytest.mark.parametrize("backend", module_backends())
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
def test_poisoned_future_token_never_reaches_earlier_rows(backend, poison):
  """A poisoned token 5 of 12: rows 0-4 are unchanged on both routes. The dense route attends
  to it, so every row that sees it is non-finite (it shows rather than hides). On the sparse
  route its indexer score is NaN, which counts as -inf: no row selects it, and the later rows
  stay finite (row 5's own scores are all NaN, so it has no index at all)."""
  dense, mqa = make_pair(backend=backend)
  x = mt.random_hidden(31, (1, 12, dense.config.hidden_size))
  bad_x = x.at[:, 5].set(poison)
  assert dense.prefill_route(12) is PrefillRoute.DENSE_MHA
  assert mqa.prefill_route(12) is PrefillRoute.SPARSE_MQA
  outs = []
  for layer in (dense, mqa):
    clean, got = _run(layer, x), _run(layer, bad_x)
    out = np.asarray(got.out_BTD[0])
    np.testing.assert_array_equal(out[:5], clean.out_BTD[0][:5])
    chex.assert_tree_all_finite(out[:5])
    outs.append((out, got.topk_BTK))
  assert not np.isfinite(outs[0][0][5:]).all(axis=-1).any()  # dense: rows 5-11 see token 5
  sparse_out, topk = outs[1][0], np.asarray(outs[1][1][0])
  assert not (topk == 5).any() and (topk[5] == -1).all()
  chex.assert_tree_all_finite(sparse_out[6:])
  np.testing.assert_array_equal((topk[6:] >= 0).sum(-1), np.arange(6, 12))  # all but token 5
  assert mt.relative_error(outs[0][0][:5], sparse_out[:5]) < 1e-5


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
def test_poisoned_key_never_displaces_real_keys_past_top_k(poison):
  """Past top-k the indexer chooses: a poisoned token's NaN score never enters any row's
  selection, and every later row still selects top-k real keys, among them every key it
  selected without the poison (the poisoned key's slot goes to the next-best real key)."""
  _, mqa = make_pair()
  length = 3 * TOPK
  x = mt.random_hidden(34, (1, length, mqa.config.hidden_size))
  clean = _run(mqa, x)
  got = _run(mqa, x.at[:, 5].set(poison))
  clean_topk, topk = np.asarray(clean.topk_BTK[0]), np.asarray(got.topk_BTK[0])
  np.testing.assert_array_equal(topk[:5], clean_topk[:5])
  assert not (topk == 5).any()
  for t in range(6, length):
    kept = set(clean_topk[t][clean_topk[t] >= 0]) - {5}
    assert kept <= set(topk[t]), t
    assert (topk[t] >= 0).sum() == min(t, TOPK), t
  out = np.asarray(got.out_BTD[0])
  np.testing.assert_array_equal(out[:5], np.asarray(clean.out_BTD[0])[:5])
  chex.assert_tree_all_finite(out[6:])


def test_topk_never_selects_a_nan_score():
  """NaN (of either sign) counts as -inf: never selected, never ahead of a finite score;
  -1 marks slots without a finite score; ties go to the lower index."""
  from mla_jax.indexer import topk_indices

  nan, inf = np.nan, np.inf
  logits = jnp.array([[[1.0, nan, 3.0, -inf, 3.0, -nan, 0.0],
                       [-inf, nan, -inf, 0.5, -nan, 0.5, -inf],
                       [nan, -nan, -inf, -inf, -inf, -inf, -inf]]], jnp.float32)
  got = np.asarray(topk_indices(logits, 4))[0]
  np.testing.assert_array_equal(got[0], [2, 4, 0, 6])
  np.testing.assert_array_equal(got[1], [3, 5, -1, -1])
  np.testing.assert_array_equal(got[2], [-1, -1, -1, -1])
  wide = np.asarray(topk_indices(logits, 9))[0]  # k > S: padded with -1
  np.testing.assert_array_equal(wide[0], [2, 4, 0, 6, -1, -1, -1, -1, -1])


def test_chunked_scoring_selects_the_same_indices():
  _, mqa = make_pair()
  chunked = m.DeepseekV32Attention(mqa.config, rngs=nnx.Rngs(0), backend="xla",
                                   index_chunk_size=7)
  nnx.update(chunked, nnx.state(mqa, nnx.Param))
  x = mt.random_hidden(20, (2, 3 * TOPK + 1, mqa.config.hidden_size))
  a, b = _run(mqa, x), _run(chunked, x)
  chex.assert_trees_all_equal(a.topk_BTK, b.topk_BTK)
  chex.assert_trees_all_close(a.out_BTD, b.out_BTD, rtol=1e-6, atol=1e-6)


def test_hadamard_rotation_leaves_fp32_selection_unchanged():
  cfg = m.tiny()
  plain = dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer, use_hadamard=False))
  _, with_h = make_pair(cfg)
  without_h = m.DeepseekV32Attention(plain, rngs=nnx.Rngs(0), backend="xla")
  nnx.update(without_h, nnx.state(with_h, nnx.Param))
  x = mt.random_hidden(21, (1, 4 * TOPK, cfg.hidden_size))
  a, b = _run(with_h, x), _run(without_h, x)
  assert (np.asarray(a.topk_BTK) == np.asarray(b.topk_BTK)).mean() > 0.99
  assert mt.relative_error(a.out_BTD, b.out_BTD) < 1e-3


def test_two_runs_are_bitwise_equal():
  _, mqa = make_pair()
  x = mt.random_hidden(22, (2, 3 * TOPK, mqa.config.hidden_size))
  a, b = _run(mqa, x), _run(mqa, x)
  chex.assert_trees_all_equal(a, b)


class JitVariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("short", "tiny", TOPK), ("long", "tiny", 2 * TOPK + 3),
                                  ("yarn_equal_mscales", "yarn_equal_mscales", TOPK),
                                  ("yarn_mscales_differ", "yarn_mscales_differ", TOPK))
  def test_variants_agree_with_reference(self, config_name, length):
    dense, mqa = make_pair(CONFIGS[config_name])
    x = mt.random_hidden(23, (1, length, dense.config.hidden_size))
    ref = mt.mla_attention_reference(mt.numpy_params(dense), dense.config, np.asarray(x[0]))
    for layer in (dense, mqa):
      graphdef, state = nnx.split(layer)

      def fwd(state, x, cache):
        return nnx.merge(graphdef, state)(x, cache, num_cached_tokens=0).out_BTD

      out = self.variant(fwd)(state, x, fresh_cache(layer.config))
      self.assertLess(mt.relative_error(out[0], ref), 1e-5)


@pytest.mark.parametrize("make_args, error, match", [
    (lambda c, x: (x[0], c), ValueError, "batch, tokens"),
    (lambda c, x: (x[..., :-1], c), ValueError, "batch, tokens"),
    (lambda c, x: (x[:, :0], c), ValueError, "at least one token"),
    (lambda c, x: (x.astype(jnp.int32), c), TypeError, "floating"),
    (lambda c, x: (x, "cache"), TypeError, "LayerCache"),
    (lambda c, x: (jnp.concatenate([x, x]), c), ValueError, "does not fit"),
])
def test_bad_inputs_raise_clearly(make_args, error, match):
  _, mqa = make_pair()
  x = mt.random_hidden(24, (1, 5, mqa.config.hidden_size))
  with pytest.raises(error, match=match):
    mqa(*make_args(fresh_cache(mqa.config), x))


def test_bad_lengths_and_overflow_raise_before_writing():
  _, mqa = make_pair()
  cache = fresh_cache(mqa.config, 1, capacity=8)
  x = mt.random_hidden(25, (1, 5, mqa.config.hidden_size))
  with pytest.raises(ValueError, match="new_lens"):
    mqa(x, cache, new_lens_B=jnp.array([6]))
  with pytest.raises(ValueError, match="new_lens"):
    mqa(x, cache, new_lens_B=jnp.array([[5]]))
  first = mqa(x, cache).cache
  with pytest.raises(ValueError, match="capacity 8"):
    mqa(x, first)
  np.testing.assert_array_equal(first.num_cached_B, [5])  # the refused step changed nothing
  with pytest.raises(ValueError, match="num_cached_tokens=2"):
    mqa(x[:, :1], first, num_cached_tokens=2)


def test_cache_mismatch_and_capacity_limits():
  dense, _ = make_pair()
  with pytest.raises(ValueError, match="index_keys"):
    dense(mt.random_hidden(26, (1, 3, 128)), fresh_cache(tiny_no_indexer()))
  with pytest.raises(ValueError, match="max_position_embeddings"):
    m.init_layer_cache(m.tiny(), 1, m.tiny().max_position_embeddings + 1)
  with pytest.raises(ValueError, match="capacity"):
    m.init_layer_cache(m.tiny(), 1, 0)


def test_config_type_checked():
  with pytest.raises(TypeError, match="MLAConfig"):
    m.MLAAttention({"hidden_size": 3}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("length", [TOPK, 3 * TOPK])
def test_bfloat16_layers_match_float64_reference(length):
  """bf16 within 2e-2 of float64; past top-k, on the rows whose bf16 selection is exact.

  bf16 indexer scores can flip near-ties at the k-th boundary (docs/design.md §5), which changes
  the attended set; those rows are a different (valid) selection, not an error.
  """
  cfg = m.tiny()
  dense = m.MLAAttention(cfg, rngs=nnx.Rngs(0), backend="xla", param_dtype=jnp.bfloat16)
  mt.randomize_params(dense, 9)
  mqa = m.DeepseekV32Attention(cfg, rngs=nnx.Rngs(0), backend="xla", param_dtype=jnp.bfloat16)
  nnx.update(mqa, nnx.state(dense, nnx.Param))
  exact = m.DeepseekV32Attention(cfg, rngs=nnx.Rngs(0), backend="xla")
  nnx.update(exact, jax.tree.map(lambda p: p.astype(jnp.float32), nnx.state(dense, nnx.Param)))
  x = mt.random_hidden(27, (1, length, cfg.hidden_size), jnp.bfloat16)
  ref = mt.mla_attention_reference(mt.numpy_params(dense), cfg, np.asarray(x[0], np.float64))
  ref_topk = np.sort(np.asarray(call(exact, x.astype(jnp.float32), fresh_cache(cfg)).topk_BTK[0]))
  for layer in (dense, mqa):
    res = call(layer, x, m.init_layer_cache(cfg, 1, 96, jnp.bfloat16))
    assert res.out_BTD.dtype == jnp.bfloat16
    rows = np.ones(length, bool)
    if res.topk_BTK is not None:
      rows = (np.sort(np.asarray(res.topk_BTK[0])) == ref_topk).all(-1)
      assert rows.mean() > 0.75
    assert mt.relative_error(res.out_BTD[0][rows], ref[rows]) < 2e-2, type(layer).__name__


def test_an_all_minus_one_buffer_raises_eagerly_and_when_checked():
  """The #52512 symptom made loud: a shared layer handed an unfilled buffer raises, at once
  in an eager call and through ``checks.checked`` under jit; padding rows may be empty."""
  cfg = m.tiny()
  layer = m.DeepseekV32Attention(cfg, rngs=nnx.Rngs(0), backend="xla", shares_topk=True)
  x = mt.random_hidden(28, (1, 5, cfg.hidden_size))
  cache = m.init_layer_cache(cfg, 1, 16, index_keys=False)
  unfilled = jnp.full((1, 5, TOPK), -1, jnp.int32)
  jitted = nnx.jit(lambda layer, x, c, k, n: layer(x, c, new_lens_B=n, shared_topk_BTK=k).out_BTD)
  with pytest.raises(checks.CheckError, match="query row 0 of sequence 0 has no valid top-k"):
    layer(x, cache, shared_topk_BTK=unfilled)
  with pytest.raises(checks.CheckError, match="query row 3 of sequence 0 has no valid top-k"):
    checks.checked(jitted)(layer, x, cache, unfilled.at[:, :3, 0].set(0), jnp.array([5]))
  filled = jnp.where(jnp.arange(TOPK) <= jnp.arange(5)[:, None], jnp.arange(TOPK), -1)[None]
  filled = filled.astype(jnp.int32).at[:, 4].set(-1)  # row 4 is padding: allowed to be empty
  out = checks.checked(jitted)(layer, x, cache, filled, jnp.array([4]))
  chex.assert_tree_all_finite(out)
  with pytest.raises(ValueError, match="no top-k"):
    layer(x, cache)
