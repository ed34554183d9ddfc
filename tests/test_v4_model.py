"""DeepSeek-V4 against its float64 NumPy reference (tests/v4_reference.py): the compressor,
mHC, the MoE and whole models; the cached step against the whole-sequence forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import partial_softmax
from mla_jax.config import RopeConfig, YarnConfig
from mla_jax.generation import generate
from mla_jax.v4 import hyper
from mla_jax.v4.cache import V4Cache
from mla_jax.v4.compressor import Compressor
from mla_jax.v4.config import CSA, HCA, HASH_MOE, MOE, SLIDING, tiny_v4_config
from mla_jax.v4.model import V4CausalLM
from mla_jax.v4.moe import V4Router
from tests import v4_reference as ref


def randomize(model, seed: int, scale: float = 0.5):
  """Every float parameter random (sinks, pooling biases, mHC biases and scales included,
  which a fresh model holds at 0 or 1), so no term of the formulas is left out of a test."""
  rng = np.random.default_rng(seed)
  graphdef, state = nnx.split(model)
  filled = []
  for path, var in state.flat_state():
    value = np.asarray(var[...])
    if jnp.issubdtype(value.dtype, jnp.floating):
      std = float(np.std(value.astype(np.float32)))
      spread = std if value.size > 1 and std > 0 else scale
      value = (rng.standard_normal(value.shape) * spread).astype(value.dtype)
    filled.append((path, var.replace(jnp.asarray(value))))
  return nnx.merge(graphdef, nnx.State.from_flat_path(filled))


def build(seed: int = 0, dtype=jnp.float32, backend="xla", **overrides):
  config = tiny_v4_config(**overrides)
  model = V4CausalLM(config, rngs=nnx.Rngs(seed), backend=backend, param_dtype=dtype)
  return randomize(model, seed + 1)


@nnx.jit(static_argnames="plan")
def _step(model, ids_BT, caches, new_lens_B=None, plan=None):
  return model(ids_BT, caches, new_lens_B=new_lens_B, plan=plan)


def run(model, ids_BT, capacity: int = 64, chunks=None, kv_rows=None):
  """Logits of ``ids_BT`` from 0, in one step or in steps of ``chunks`` tokens (reading the
  entries of positions below ``kv_rows``: all by default)."""
  b, t = ids_BT.shape
  caches = model.init_cache(b, capacity)
  chunks = chunks or [t]
  out, start = [], 0
  for size in chunks:
    plan = model.step_plan(size, None, capacity=capacity, kv_rows=kv_rows)
    logits, caches = _step(model, ids_BT[:, start:start + size], caches, plan=plan)
    out.append(logits)
    start += size
  return np.asarray(jnp.concatenate(out, axis=1))


def rel_err(got, want):
  return np.max(np.abs(got - want)) / np.max(np.abs(want))


@pytest.mark.parametrize("length", [5, 8, 37])
def test_model_matches_float64_reference(length):
  """Every layer type and both MoE kinds; prompts shorter and longer than the window (8),
  and past the top-k (4) of compressed entries."""
  model = build(seed=length)
  ids = np.random.default_rng(length).integers(0, model.config.vocab_size, (2, length))
  got = run(model, jnp.asarray(ids, jnp.int32))
  params = ref.params_of(model)
  for row in range(2):
    want = ref.forward(params, model.config, ids[row])
    assert rel_err(got[row], want) < 1e-5


def test_pallas_kernels_match_float64_reference():
  """The Pallas-Triton sparse MQA (rows 32 wide, rope inside: L = d_v) and indexer kernels,
  in interpret mode, on every layer type."""
  model = build(seed=11, backend="pallas")
  assert model.backend.name == "pallas_triton"
  ids = np.random.default_rng(11).integers(0, model.config.vocab_size, (1, 21))
  got = run(model, jnp.asarray(ids, jnp.int32))
  want = ref.forward(ref.params_of(model), model.config, ids[0])
  assert rel_err(got[0], want) < 1e-5


def test_bfloat16_model_matches_float64_reference():
  model = build(seed=3, dtype=jnp.bfloat16)
  ids = np.random.default_rng(3).integers(0, model.config.vocab_size, (1, 21))
  got = run(model, jnp.asarray(ids, jnp.int32))
  want = ref.forward(ref.params_of(model), model.config, ids[0])
  assert rel_err(got[0], want) < 2e-2


def test_yarn_and_other_scoring_match_reference():
  """The compress RoPE with YaRN, sigmoid scoring, tied embeddings, HCA and CSA only."""
  model = build(seed=5, layer_types=(HCA, CSA), mlp_layer_types=(MOE, HASH_MOE),
                scoring_func="sigmoid", tie_word_embeddings=True,
                compress_rope=RopeConfig(theta=160000.0, yarn=YarnConfig(
                    factor=16.0, original_max_position_embeddings=64)))
  ids = np.random.default_rng(5).integers(0, model.config.vocab_size, (1, 30))
  got = run(model, jnp.asarray(ids, jnp.int32))
  want = ref.forward(ref.params_of(model), model.config, ids[0])
  assert rel_err(got[0], want) < 1e-5


def test_rows_ignore_later_tokens_where_index_scores_tie():
  """A row's logits depend neither on the tokens after it nor on how many compressed entries
  the cache holds, even where index scores tie at the k-th place (HF 5.25's do: docs/models.md,
  "Where HF differs"). One index head, so ReLU zeroes about half of the scores and exact ties
  are common; they go to the lower index, as in the float64 reference."""
  model = build(seed=3, index_n_heads=1)
  ids = np.random.default_rng(3).integers(0, model.config.vocab_size, (1, 64))
  full = run(model, jnp.asarray(ids, jnp.int32))  # 16 CSA entries per row of scores
  # 49 tokens reading 12 entries, the width of HF's rows for a 49-token input.
  prefix = run(model, jnp.asarray(ids[:, :49], jnp.int32), capacity=49, kv_rows=49)
  assert rel_err(prefix, full[:, :49]) < 1e-5
  assert rel_err(full[0], ref.forward(ref.params_of(model), model.config, ids[0])) < 1e-5


@pytest.mark.parametrize("chunks", [[1] * 29, [3, 5, 1, 9, 11], [13, 16]])
def test_cached_steps_equal_one_step(chunks):
  """Prefill in pieces that cut windows and entries anywhere, then decode: the same logits
  as one step over the whole sequence (the compressor's state carries the cut windows)."""
  model = build(seed=7)
  ids = jnp.asarray(np.random.default_rng(7).integers(0, 256, (2, 29)), jnp.int32)
  assert rel_err(run(model, ids, chunks=chunks), run(model, ids)) < 1e-5


def test_compressor_matches_reference_and_streams():
  """Entries of one pass over 24 tokens equal the reference's; fed 5 + 1 + 18 tokens, the
  same entries come out, each window once, complete ones only."""
  d, width, m = 16, 8, 4
  for overlap in (False, True):
    comp = Compressor(d, width, m, overlap=overlap, rope_dim=4, rope=RopeConfig(), norm_eps=1e-6,
                      max_position=1024, rngs=nnx.Rngs(0))
    comp.position_bias.value = jax.random.normal(jax.random.key(1), comp.position_bias.shape)
    x = jax.random.normal(jax.random.key(2), (1, 24, d))
    params = {f"c.{k}": v for k, v in ref.params_of(comp).items()}
    want = ref.compress(np.asarray(x[0], np.float64), params, "c", width=width, m=m,
                        overlap=overlap, rope=RopeConfig(), r=4, eps=1e-6)
    kv, gate = comp.init_state(1, jnp.float32)
    got = np.zeros_like(want)
    start = 0
    for size in (5, 1, 18):
      # One sequence in slot 0 (its pages are not needed here), ``size`` rows from ``start``.
      geo = V4Cache((), jnp.array([start], jnp.int32), jnp.zeros((1, 1), jnp.int32),
                    jnp.zeros((1,), jnp.int32), 64).geometry(size, jnp.array([size]))
      entries, window, _, kv, gate = comp(x[0, start:start + size], kv, gate, geo)
      for j, w in enumerate(np.asarray(window)):
        if w >= 0:
          got[w] = np.asarray(entries[j])
      start += size
    assert rel_err(got, want) < 1e-5


def test_hyper_connection_matches_reference():
  hc = hyper.HyperConnection(16, 3, sinkhorn_iters=7, hc_eps=1e-6, norm_eps=1e-6,
                             rngs=nnx.Rngs(0))
  hc.base.value = jax.random.normal(jax.random.key(1), hc.base.shape)
  hc.scale.value = jax.random.normal(jax.random.key(2), hc.scale.shape)
  streams = jax.random.normal(jax.random.key(3), (1, 5, 3, 16))
  post, comb, collapsed = hc(streams)
  params = {f"h.{k}": v for k, v in ref.params_of(hc).items()}
  config = tiny_v4_config(hc_mult=3, hc_sinkhorn_iters=7)
  want = ref.hyper(np.asarray(streams[0], np.float64), params, "h", config)
  for got, expected in zip((post[0], comb[0], collapsed[0]), want):
    assert rel_err(np.asarray(got), expected) < 1e-5
  # Sinkhorn: close to doubly stochastic after a few rounds.
  np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(comb).sum(-1), 1.0, atol=1e-2)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax", "sigmoid"])
def test_routers_match_reference(scoring):
  config = tiny_v4_config(scoring_func=scoring)
  x = jax.random.normal(jax.random.key(0), (6, config.hidden_size))
  ids = jnp.arange(6, dtype=jnp.int32) * 7
  for hashed in (False, True):
    router = V4Router(config, hashed=hashed, rngs=nnx.Rngs(1))
    if not hashed:
      router.e_score_correction_bias.value = jax.random.normal(jax.random.key(2), (8,)) * 0.3
    idx, weights = router(x, ids)
    logits = np.asarray(x, np.float64) @ np.asarray(router.weight[...], np.float64).T
    scores = {"sqrtsoftplus": np.sqrt(np.logaddexp(0, logits)),
              "sigmoid": 1 / (1 + np.exp(-logits)), "softmax": ref.softmax(logits, -1)}[scoring]
    if hashed:
      want_idx = np.asarray(router.tid2eid[...])[np.asarray(ids)]
    else:
      biased = scores + np.asarray(router.e_score_correction_bias[...])
      want_idx = np.argsort(-biased, -1, kind="stable")[:, :config.num_experts_per_tok]
    np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(want_idx, -1))
    want = np.take_along_axis(scores, np.asarray(idx), -1)
    want = want / want.sum(-1, keepdims=True) * config.routed_scaling_factor
    assert rel_err(np.asarray(weights), want) < 1e-5


def test_merge_with_sink_is_one_softmax():
  """Two parts' partial softmaxes and the sink merge into one softmax over all their rows
  (``partial_softmax.merge``, V4's and context parallelism's); a part without rows (LSE
  +inf) adds nothing."""
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((3, 2, 7))
  values = rng.standard_normal((7, 5))
  sink = rng.standard_normal(2)

  def part(cols):
    lse = np.log(np.exp(logits[..., cols]).sum(-1))
    out = np.einsum("thk,kv->thv", np.exp(logits[..., cols] - lse[..., None]), values[cols])
    return jnp.asarray(out, jnp.float32), jnp.asarray(lse, jnp.float32)

  empty = (jnp.zeros((3, 2, 5)), jnp.full((3, 2), jnp.inf))
  got, _ = partial_softmax.merge([part([0, 1, 2]), part([3, 4, 5, 6]), empty],
                                 sink=jnp.asarray(sink))
  full = np.concatenate([logits, np.broadcast_to(sink[None, :, None], (3, 2, 1))], -1)
  want = np.einsum("thk,kv->thv", ref.softmax(full, -1)[..., :-1], values)
  assert rel_err(np.asarray(got), want) < 1e-5


def test_window_rows():
  """Query at p sees positions p-W+1..p: the ring (row p % R of the slot its state is read
  from) for those before the step, this step's rows for the rest; none before position 0.
  Two sequences of 3 rows each, at 6 (state read from slot 2) and at 0."""
  w = 4
  geo = V4Cache((), jnp.array([6, 0], jnp.int32), jnp.zeros((2, 1), jnp.int32),
                jnp.array([0, 1], jnp.int32), 64,
                state_src_S=jnp.array([2, 1], jnp.int32)).geometry(3, jnp.array([3, 3]))
  step, ring = (np.asarray(a) for a in geo.window(w, w))
  assert step[0].tolist() == [0, -1, -1, -1] and ring[0].tolist() == [-1, 2 * w + 1, 2 * w, 2 * w + 3]
  assert step[2].tolist() == [2, 1, 0, -1] and ring[2].tolist() == [-1, -1, -1, 2 * w + 1]
  assert step[4].tolist() == [4, 3, -1, -1] and (ring[4] == -1).all()  # position 1


def test_sliding_only_layer_reads_window_alone():
  """A sliding layer's logits at a position do not depend on tokens past its window."""
  model = build(seed=9, layer_types=(SLIDING,), mlp_layer_types=(MOE,))
  ids = np.random.default_rng(9).integers(0, 256, (1, 20))
  changed = ids.copy()
  changed[0, :5] = (changed[0, :5] + 1) % 256  # outside the window of positions >= 13
  a, b = (run(model, jnp.asarray(x, jnp.int32)) for x in (ids, changed))
  np.testing.assert_array_equal(a[0, 13:], b[0, 13:])
  assert not np.allclose(a[0, 5:12], b[0, 5:12])


@pytest.mark.parametrize("num_new", [1, 7])
def test_steps_update_every_cache_in_place(num_new):
  """The compiled step (decode and prefill) aliases every cache buffer to an output."""
  model = build(seed=2)
  graphdef, state = nnx.split(model)
  caches = model.init_cache(2, 64)
  step = jax.jit(lambda state, ids, caches: nnx.merge(graphdef, state)(ids, caches)[1],
                 donate_argnums=2)
  compiled = step.lower(state, jnp.zeros((2, num_new), jnp.int32), caches).compile()
  assert compiled.memory_analysis().alias_size_in_bytes == sum(
      x.nbytes for x in jax.tree.leaves(caches))


def test_generate_takes_ragged_prompts_and_stops_at_eos():
  """``mla_jax.generate`` runs V4 (the decode protocol): prompts of different lengths in one
  batch give each prompt's tokens alone; an eos id stops its row."""
  model = build(seed=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, [[1, 2, 3]], 0)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    generate(model, [[1, 999]], 2)
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
  free = generate(model, prompts, 6).tokens
  assert free == [generate(model, [p], 6).tokens[0] for p in prompts]
  eos = free[0][2]
  stopped = generate(model, prompts, 6, eos_id=eos).tokens
  assert stopped[0] == free[0][:free[0].index(eos) + 1]
  assert stopped[1] == (free[1][:free[1].index(eos) + 1] if eos in free[1] else free[1])


def test_rows_at_different_positions_equal_each_row_alone():
  """A batch whose rows sit at different positions (ragged: one step of 13 prefills 10 and
  13 tokens; a capacity of 45, no multiple of m = 4 or 8) gives each row the logits it gets
  alone."""
  model = build(seed=6)
  rng = np.random.default_rng(6)
  ids = jnp.asarray(rng.integers(0, 256, (2, 30)), jnp.int32)
  starts = (10, 13)
  alone = []
  for row, start in enumerate(starts):
    c = model.init_cache(1, 45)
    _, c = _step(model, ids[row:row + 1, :start], c)
    logits, _ = _step(model, ids[row:row + 1, start:start + 5], c)
    alone.append(np.asarray(logits[0]))
  _, caches = _step(model, ids[:, :13], model.init_cache(2, 45), jnp.asarray(starts))
  step_ids = jnp.stack([ids[r, s:s + 5] for r, s in enumerate(starts)])
  together, _ = _step(model, step_ids, caches)
  for row in range(2):
    assert rel_err(np.asarray(together[row]), alone[row]) < 1e-5


def test_a_position_past_the_caches_is_refused():
  """init_cache(1, 14) holds 16 positions (a multiple of every ratio); a step past them
  would drop entries, and is refused."""
  from mla_jax.checks import CheckError

  model = build(seed=8)
  caches = model.init_cache(1, 14)
  assert caches.capacity == 16
  ids = jnp.zeros((1, 17), jnp.int32)
  with pytest.raises(CheckError, match="more than the cache capacity 16"):
    model(ids, caches)
  model(ids[:, :16], caches)  # every entry fits


def test_cache_dtype_is_kept_by_a_step():
  """A bf16 cache under a float32 model stays bf16, so a compiled step runs again."""
  model = build(seed=9)
  caches = model.init_cache(1, 32, jnp.bfloat16)
  _, after = _step(model, jnp.zeros((1, 5), jnp.int32), caches)
  assert jax.tree.map(lambda a: a.dtype, after) == jax.tree.map(lambda a: a.dtype, caches)
