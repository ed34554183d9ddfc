"""Decode against full forwards, greedy agreement of the two attention classes, generation."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mla_jax as m
from mla_jax import checks, generation
from mla_jax.generation import programs
from mla_jax import testing as mt
from mla_jax.indexer import Indexer
from mla_jax.models.config import tiny_lm
from mla_jax.routing import PrefillRoute

TOPK = tiny_lm().mla.indexer.topk
VOCAB = tiny_lm().vocab_size


@functools.lru_cache(maxsize=None)
def _models():
  """Both attention classes with identical random weights (built once per test session)."""
  mqa = m.CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0), backend="xla")
  mt.randomize_params(mqa, 7)
  dense = m.CausalLM(tiny_lm("dense-capable"), rngs=nnx.Rngs(0), backend="xla")
  nnx.update(dense, nnx.state(mqa, nnx.Param))
  return {"mqa-only": mqa, "dense-capable": dense}


@functools.partial(nnx.jit, static_argnames=("num_cached_tokens",))
def _forward(model, ids, caches, num_cached_tokens):
  return model(ids, caches, num_cached_tokens=num_cached_tokens)


@nnx.jit
def _step(model, ids, caches):
  return model(ids, caches)  # traced lengths: the decode (MQA) route


def _ids(seed, length):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=(1, length)), jnp.int32)


@pytest.mark.parametrize("attention", ["mqa-only", "dense-capable"])
@pytest.mark.parametrize("prompt_len", [1, TOPK - 1, TOPK, TOPK + 1, 3 * TOPK])
def test_decode_logits_equal_full_forward(attention, prompt_len):
  model, steps = _models()[attention], 4
  ids = _ids(prompt_len, prompt_len + steps)
  full, _ = _forward(model, ids, model.init_cache(1, 64), 0)
  logits, caches = _forward(model, ids[:, :prompt_len], model.init_cache(1, 64), 0)
  expect_dense = attention == "dense-capable" and prompt_len <= TOPK
  assert (model.prefill_routes(prompt_len)[0] is PrefillRoute.DENSE_MHA) == expect_dense
  assert mt.relative_error(logits, full[:, :prompt_len]) < 1e-5
  for i in range(steps):
    step_logits, caches = _step(model, ids[:, prompt_len + i:prompt_len + i + 1], caches)
    assert mt.relative_error(step_logits[:, 0], full[:, prompt_len + i]) < 1e-5, i
  np.testing.assert_array_equal(caches.num_cached_B, [prompt_len + steps])


def test_multi_token_decode_step_equals_full_forward():
  """An MTP / speculative step verifies 3 tokens at once on the MQA route."""
  model = _models()["dense-capable"]
  ids = _ids(3, 2 * TOPK + 3)
  full, _ = _forward(model, ids, model.init_cache(1, 64), 0)
  _, caches = _forward(model, ids[:, :2 * TOPK], model.init_cache(1, 64), 0)
  logits, _ = _step(model, ids[:, 2 * TOPK:], caches)
  assert mt.relative_error(logits, full[:, 2 * TOPK:]) < 1e-5


@pytest.mark.parametrize("prompt_len", [TOPK // 2, TOPK, 2 * TOPK])
def test_greedy_generations_of_both_classes_are_identical(prompt_len):
  prompt = np.random.default_rng(prompt_len).integers(0, 256, size=prompt_len).tolist()
  outs = {name: m.generate(model, [prompt], 12).tokens for name, model in _models().items()}
  assert outs["mqa-only"] == outs["dense-capable"]
  assert len(outs["mqa-only"][0]) == 12


def test_ragged_batch_matches_each_prompt_alone():
  rng = np.random.default_rng(11)
  prompts = [rng.integers(0, 256, size=n).tolist() for n in (3, TOPK + 5, 2 * TOPK)]
  model = _models()["mqa-only"]
  batch = m.generate(model, prompts, 10).tokens
  for prompt, tokens in zip(prompts, batch):
    assert m.generate(model, [prompt], 10).tokens[0] == tokens


@pytest.fixture
def fresh_programs():
  """Empty compile cache and trace counters for one test, whatever ran before it in this
  process; the programs it compiles are dropped afterwards."""
  programs.cache.clear()
  programs.trace_counts.clear()
  yield programs.trace_counts
  programs.cache.clear()


def test_decode_is_traced_once_for_a_long_generation(fresh_programs):
  """One prefill and one decode program for 64 tokens (one cache bucket), and none more for
  a second generation of the same shapes."""
  model = _models()["mqa-only"]
  result = m.generate(model, [[5, 6, 7]], 64, cache_capacity=97)
  assert fresh_programs == {"prefill": 1, "decode": 1}
  assert len(result.tokens[0]) == 64 and result.decode_tokens == 63
  again = m.generate(model, [[1, 2, 3]], 64, cache_capacity=97)
  assert fresh_programs == {"prefill": 1, "decode": 1} and len(again.tokens[0]) == 64


def test_program_cache_keeps_the_most_recently_used():
  """The cache is bounded: past ``max_size`` the least recently used program is dropped (and
  compiled again when asked for); a hit costs no compile time."""
  graphdef, state = nnx.split(_models()["mqa-only"])
  leaves, state_def = jax.tree.flatten(state)
  args = (_models()["mqa-only"].init_cache(1, 4), jnp.ones((1, 2), jnp.int32),
          jnp.array([2], jnp.int32), jnp.uint32(0))
  cache = programs.ProgramCache(max_size=1)
  plan = _models()["mqa-only"].step_plan(2, 0, capacity=4)
  greedy = programs.PrefillSettings(plan)
  sampled = programs.PrefillSettings(plan, generation.SamplingConfig(temperature=1.0))
  get = lambda settings: cache.get(graphdef, state_def, leaves, *args, settings=settings)[1]
  assert get(greedy) > 0 and get(greedy) == 0.0 and len(cache) == 1
  assert get(sampled) > 0 and len(cache) == 1
  assert get(greedy) > 0  # dropped when ``sampled`` came in
  with pytest.raises(ValueError, match="max_size must be an int >= 1"):
    programs.ProgramCache(max_size=0)


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_checked_generate_raises_where_unchecked_is_silent(fresh_programs, monkeypatch):
  """``checks=True`` gives the same tokens when nothing is wrong; with scoring broken (every
  top-k slot -1, the vLLM #52512 symptom) it raises, where the unchecked run goes on."""
  model, prompt = _models()["mqa-only"], [[5, 6, 7]]
  assert m.generate(model, prompt, 4, checks=True).tokens == m.generate(model, prompt, 4).tokens
  monkeypatch.setattr(Indexer, "select",
                      lambda self, x_BTD, *args, **kwargs: jnp.full(x_BTD.shape[:2] + (TOPK,),
                                                                    -1, jnp.int32))
  programs.cache.clear()
  with pytest.raises(checks.CheckError, match="query row 0 of sequence 0 has no valid top-k"):
    m.generate(model, prompt, 4, checks=True)
  assert len(m.generate(model, prompt, 4).tokens[0]) == 4


def test_numpy_integers_are_ints():
  """NumPy integer scalars (as from an array or a tokenizer) work wherever Python ints do."""
  model, prompt = _models()["mqa-only"], [[5, 6, 7]]
  ints = dict(seed=3, cache_capacity=16, steps_per_dispatch=1, eos_id=[9, 11])
  given = m.generate(model, np.array(prompt, np.int64), np.int64(4),
                     **{k: np.asarray(v, np.int64)[()] if k != "eos_id" else
                        [np.int32(i) for i in v] for k, v in ints.items()})
  assert given.tokens == m.generate(model, prompt, 4, **ints).tokens


def test_eos_stops_one_sequence_while_the_other_continues():
  model = _models()["mqa-only"]
  prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5]]
  free = m.generate(model, prompts, 10).tokens
  eos = free[0][3]
  if eos in free[1][:4]:
    pytest.skip("both sequences emit the chosen token early with this seed")
  stopped = m.generate(model, prompts, 10, eos_id=eos).tokens
  assert stopped[0] == free[0][:free[0].index(eos) + 1]
  assert stopped[1][:len(stopped[1])] == free[1][:len(stopped[1])]
  assert len(stopped[1]) > len(stopped[0])


def test_eos_list_stops_each_sequence_at_its_first_eos():
  """Several EOS ids (GLM-5 ends on any of three): a row is done at the first one it emits."""
  model = _models()["mqa-only"]
  prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5], [3, 3, 3]]
  free = m.generate(model, prompts, 10).tokens
  eos = [free[0][2], free[1][5]]
  stopped = m.generate(model, prompts, 10, eos_id=eos).tokens
  for row, tokens in zip(free, stopped):
    ends = [i for i, t in enumerate(row) if t in eos]
    assert tokens == (row[:ends[0] + 1] if ends else row)
  assert len(stopped[0]) <= 3 and len(stopped[1]) <= 6
  assert (m.generate(model, prompts, 10, eos_id=(eos[0],)).tokens
          == m.generate(model, prompts, 10, eos_id=eos[0]).tokens)
  for bad in ([], [1, -2], [True], "1"):
    with pytest.raises(ValueError, match="eos_id must be"):
      m.generate(model, prompts, 2, eos_id=bad)


def test_sampling_is_seeded_and_tiny_top_p_is_greedy():
  model = _models()["mqa-only"]
  a = m.generate(model, [[1, 2, 3]], 8, temperature=1.0, seed=3).tokens
  b = m.generate(model, [[1, 2, 3]], 8, temperature=1.0, seed=3).tokens
  c = m.generate(model, [[1, 2, 3]], 8, temperature=1.0, seed=4).tokens
  greedy = m.generate(model, [[1, 2, 3]], 8).tokens
  nucleus = m.generate(model, [[1, 2, 3]], 8, temperature=0.7, top_p=1e-6, seed=5).tokens
  assert a == b and a != c
  assert nucleus == greedy


def test_nucleus_keeps_the_smallest_prefix_reaching_top_p():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  cfg = generation.SamplingConfig(temperature=1.0, top_p=0.7)
  draws = {int(generation.sample(logits, i, 0, cfg)[0]) for i in range(200)}
  assert draws == {0, 1}


def _cut_reference(logits, temperature, top_p, top_k, min_p):
  """float64: the distribution a row samples from after temperature, top_k, min_p and top_p."""
  scaled = np.asarray(logits, np.float64) / temperature
  keep = np.ones_like(scaled, bool)
  if top_k:
    keep &= scaled >= np.sort(scaled)[::-1][top_k - 1]
  probs = np.exp(scaled - scaled.max())
  if min_p:
    keep &= probs >= min_p * probs.max()
  probs = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
  order = np.argsort(-probs)
  before = np.cumsum(probs[order]) - probs[order]
  nucleus = np.zeros_like(keep)
  nucleus[order[before < top_p]] = True
  probs = np.where(nucleus, probs, 0)
  return probs / probs.sum()


def test_top_k_and_min_p_cut_each_row_as_a_float64_reference():
  """vLLM's top_k and min_p, per row beside temperature and top_p (0: off); the draws follow
  the cut distribution (chi-square)."""
  from scipy import stats

  from mla_jax.decoding.sampling import row_logits, sample_rows

  rng = np.random.default_rng(3)
  logits = rng.normal(size=(5, 16)) * 2
  settings = dict(temperature=[1.0, 0.7, 1.3, 1.0, 0.9], top_p=[1.0, 1.0, 0.9, 1.0, 0.8],
                  top_k=[3, 0, 5, 1, 0], min_p=[0.0, 0.2, 0.05, 0.0, 0.0])
  args = [jnp.asarray(settings[n], dtype) for n, dtype in (
      ("temperature", jnp.float32), ("top_p", jnp.float32), ("top_k", jnp.int32),
      ("min_p", jnp.float32))]
  got = np.asarray(jax.nn.softmax(row_logits(jnp.asarray(logits, jnp.float32), *args)))
  want = np.stack([_cut_reference(logits[b], *(settings[n][b] for n in settings))
                   for b in range(5)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert (want[0] > 0).sum() == 3 and (want[3] > 0).sum() == 1  # the cuts did cut
  n = 4000
  rows = jnp.zeros((n,), jnp.int32) + 2
  draws = sample_rows(jnp.asarray(logits, jnp.float32)[rows],
                      jax.vmap(jax.random.key)(jnp.arange(n)), jnp.zeros((n,), jnp.int32),
                      *(a[rows] for a in args))
  counts = np.bincount(np.asarray(draws), minlength=16)
  assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(want[2]))
  kept = want[2] > 0
  assert stats.chisquare(counts[kept], n * want[2][kept]).pvalue > 1e-3


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_ids=[[]], max_new_tokens=4), "empty"),
    (dict(prompt_ids=[], max_new_tokens=4), "no prompt"),
    (dict(prompt_ids=[[1, VOCAB]], max_new_tokens=4), "outside"),
    (dict(prompt_ids=[[1, -3]], max_new_tokens=4), "outside"),
    (dict(prompt_ids=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[[1, 2]], max_new_tokens=8, cache_capacity=5), "cache_capacity"),
    (dict(prompt_ids=[[1, 2]], max_new_tokens=5000), "max_position_embeddings"),
    (dict(prompt_ids=[[1, 2]], max_new_tokens=4, temperature=-1.0), "temperature"),
    (dict(prompt_ids=[[1, 2]], max_new_tokens=4, top_p=0.0), "top_p"),
])
def test_bad_generation_requests_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    m.generate(_models()["mqa-only"], **kwargs)


def test_full_cache_refuses_a_step_and_keeps_the_cache():
  model = _models()["mqa-only"]
  _, caches = _forward(model, _ids(1, 6), model.init_cache(1, 6), 0)
  with pytest.raises(ValueError, match="capacity 6"):
    model(_ids(2, 1), caches)
  chex.assert_trees_all_equal(caches, _forward(model, _ids(1, 6), model.init_cache(1, 6), 0)[1])
  with pytest.raises(ValueError, match="token ids"):
    model(jnp.array([[1, 999]]), model.init_cache(1, 6))
  with pytest.raises(ValueError, match="token ids"):
    model(jnp.array([1.0, 2.0]), model.init_cache(1, 6))


def test_generation_is_deterministic():
  model = _models()["mqa-only"]
  a = m.generate(model, [[3, 1, 4, 1, 5]], 10, return_logits=True)
  b = m.generate(model, [[3, 1, 4, 1, 5]], 10, return_logits=True)
  assert a.tokens == b.tokens
  np.testing.assert_array_equal(a.step_logits, b.step_logits)


@pytest.mark.slow
def test_pallas_backend_generates_the_same_tokens():
  pallas = m.CausalLM(tiny_lm("dense-capable"), rngs=nnx.Rngs(0),
                      backend=m.backends.get_backend("pallas"))
  nnx.update(pallas, nnx.state(_models()["dense-capable"], nnx.Param))
  for prompt in ([1, 2, 3], list(range(40, 40 + TOPK + 4))):
    assert (m.generate(pallas, [prompt], 6).tokens
            == m.generate(_models()["dense-capable"], [prompt], 6).tokens)
