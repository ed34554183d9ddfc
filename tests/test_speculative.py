"""Speculative decoding with MTP drafts: greedy tokens equal plain decoding's, sampled tokens
have its distribution, eos and max_new_tokens cut iterations short, the acceptance rate, the
errors, and the routing contract on the traced programs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

import mla_jax as m
from mla_jax import testing as mt
from mla_jax.decoding import sampling, speculative as decoding_speculative
from mla_jax.decoding.steps import Progress, emit
from mla_jax.decoding.stops import stop_ids_of
from mla_jax.generation import programs, speculative as generation_speculative
from mla_jax.models.config import tiny_lm
from mla_jax.routing import PrefillRoute
from mla_jax.traces import summarize_jaxpr

ROUTES = {route.scope for route in PrefillRoute}


def _config(attention="mqa-only", *, moe=False, vocab_size=None):
  """tiny_lm with one MTP layer; without MoE one main layer (a third of the compile time)."""
  config = tiny_lm(attention, moe=moe)
  config = dataclasses.replace(config, num_mtp_layers=1, num_layers=2 if moe else 1)
  return dataclasses.replace(config, vocab_size=vocab_size or config.vocab_size)


@functools.lru_cache(maxsize=None)
def _random(attention="mqa-only", moe=False, vocab_size=None):
  """Random weights: the MTP head's drafts are almost never accepted (rollback each time)."""
  model = m.CausalLM(_config(attention, moe=moe, vocab_size=vocab_size), rngs=nnx.Rngs(0),
                     backend="xla")
  mt.randomize_params(model, 7)
  return model


def _zero(module):
  nnx.update(module, jax.tree.map(jnp.zeros_like, nnx.state(module, nnx.Param)))


@functools.lru_cache(maxsize=None)
def _copying(vocab_size=None):
  """A bigram model whose MTP head predicts what the main model will: the main layers and
  the MTP block add nothing, so the main model's logits are lm_head(norm(embed(x))), and
  eh_proj passes the next token's normed embedding on to the same head (norm weights
  copied), so every greedy draft is accepted."""
  model = _random(vocab_size=vocab_size)
  model = nnx.merge(*nnx.split(model))  # a copy: _random()'s model stays random
  _zero(model.model.groups)
  (layer,) = model.mtp
  _zero(layer.block)
  d = model.config.mla.hidden_size
  layer.eh_proj.weight.value = jnp.eye(d, 2 * d, dtype=jnp.float32)  # [I | 0]: the embedding
  layer.enorm.weight.value = jnp.ones((d,), jnp.float32)
  layer.shared_head.norm.weight.value = model.model.norm.weight.value
  return model


@functools.lru_cache(maxsize=None)
def _glm():
  """A GLM-5-shaped model: IndexShare main layers (top-k carried), its MTP layer indexing on
  its own."""
  from tests.checkpoint_models import random_model, small_config

  return random_model(dataclasses.replace(small_config("glm", "mqa-only"), num_mtp_layers=1))


# Models to check greedy decoding on (the lead adds the recall model with its trained head).
MODELS = {"random": _random, "random-moe": functools.partial(_random, moe=True),
          "random-dense-capable": functools.partial(_random, "dense-capable"), "glm": _glm}
MODEL_MARKS = {name: pytest.mark.slow for name in ("random-moe", "random-dense-capable", "glm")}
PROMPTS = [[5, 6, 7], list(range(40, 57)), [9, 3, 1, 4, 1, 5, 9, 2, 6]]  # one past the top-k


@pytest.mark.parametrize("name", [pytest.param(n, marks=MODEL_MARKS.get(n, ())) for n in MODELS])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("batch", ["ragged", pytest.param("one", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_plain_decoding(name, k, batch):
  """Each case compiles its own programs (~10 s): batch 1 runs with the slow cases."""
  model = MODELS[name]()
  prompts = PROMPTS if batch == "ragged" else PROMPTS[1:2]
  plain = m.generate(model, prompts, 9)
  spec = m.generate(model, prompts, 9, speculative_tokens=k, steps_per_dispatch=2)
  assert spec.tokens == plain.tokens
  assert spec.decode_tokens == plain.decode_tokens == 8 * len(prompts)
  assert 0 <= spec.acceptance_rate <= 1 and spec.drafted > 0
  # A sequence with e tokens drafts min(k, 9 - e - 1) (none for its last token); accepted
  # drafts skip iterations, so that is the most it can draft.
  assert spec.drafted <= len(prompts) * sum(min(k, 9 - e - 1) for e in range(1, 9))


def test_copying_head_is_always_accepted_and_stops_mid_iteration():
  """Every draft accepted: 3 tokens per iteration (k = 2), so 8 new tokens end one token
  into an iteration, and an eos inside an iteration drops the tokens after it."""
  model = _copying()
  plain = m.generate(model, PROMPTS, 8)
  spec = m.generate(model, PROMPTS, 8, speculative_tokens=2)
  assert spec.tokens == plain.tokens and spec.acceptance_rate == 1.0
  # 7 tokens after the prefill's: 3 iterations for each row, drafting 2, 2 and none (a
  # sequence never drafts past its last token).
  assert spec.drafted == (2 + 2) * len(PROMPTS)
  eos = plain.tokens[0][2]  # the second token of the first iteration of row 0
  stopped = m.generate(model, PROMPTS, 8, speculative_tokens=2, eos_id=eos)
  for free, tokens in zip(plain.tokens, stopped.tokens):
    assert tokens == (free[:free.index(eos) + 1] if eos in free else free)
  assert len(stopped.tokens[0]) == 3 and stopped.acceptance_rate == 1.0


def _counts(tokens, vocab_size):
  """[positions, vocab] counts of each generated position over the rows."""
  tokens = np.asarray(tokens)
  return np.stack([np.bincount(tokens[:, i], minlength=vocab_size)
                   for i in range(tokens.shape[1])])


def _sampled(model, speculative_tokens, seed, **sampling):
  """Counts of 1024 independent rows' 4 tokens (one prompt, so the rows are i.i.d.)."""
  tokens = m.generate(model, [[1, 2, 3]] * 1024, 4, seed=seed,
                      speculative_tokens=speculative_tokens, **sampling).tokens
  return _counts(tokens, model.config.vocab_size)


def _p_values(plain, spec):
  """Chi-square test of homogeneity per position, over the tokens either drew."""
  seen = (plain + spec) > 0
  return [stats.chi2_contingency(np.stack([p[s], q[s]]))[1]
          for p, q, s in zip(plain, spec, seen)]


@pytest.mark.parametrize("sampling", [
    dict(temperature=1.0),
    pytest.param(dict(temperature=0.8, top_p=0.9), marks=pytest.mark.slow)])
def test_sampling_keeps_the_plain_distribution(sampling, monkeypatch):
  """Positions 1 and 2 are the drafts' (k = 2), position 3 a bonus or a later iteration's;
  1024 rows of a vocabulary of 8, fixed seeds. The copying head drafts the main model's most
  likely token (greedy drafts: q one-hot), so drafts are often kept and often rejected;
  replacing a rejected draft by a draw from p (a wrong rule) is detected."""
  model = _copying(vocab_size=8)
  plain = _sampled(model, 0, 100, **sampling)
  spec = _sampled(model, 2, 0, **sampling)
  assert min(_p_values(plain, spec)[1:]) > 1e-3
  monkeypatch.setattr(decoding_speculative, "residual", lambda p_BV, q_BV: p_BV)
  programs.cache.clear()
  wrong = _sampled(model, 2, 0, **sampling)
  programs.cache.clear()
  assert min(_p_values(plain, wrong)[1:]) < 1e-3


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculative_tokens=-1), r"speculative_tokens must be an int in \[0, 8\]"),
    (dict(speculative_tokens=9), r"speculative_tokens must be an int in \[0, 8\]"),
    (dict(speculative_tokens=1.0), r"speculative_tokens must be an int"),
    (dict(speculative_tokens=2, return_logits=True), "return_logits"),
    (dict(speculative_tokens=4, cache_capacity=12), "4 draft rows needs 13 cache rows"),
])
def test_bad_speculative_requests_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    m.generate(_random(), [[1, 2, 3]], 6, **kwargs)


def test_a_model_without_mtp_layers_refuses_speculation():
  plain = m.CausalLM(tiny_lm(), rngs=nnx.Rngs(0), backend="xla")
  with pytest.raises(ValueError, match=r"speculative_tokens=1 .*MTP layers.*num_mtp_layers is "
                                       r"0.*mtp=True"):
    m.generate(plain, [[1, 2, 3]], 4, speculative_tokens=1)


def _speculative_programs(model, k=2, prompt_len=3, capacity=16):
  """The traced prefill and speculative decode of ``generate`` (nothing compiles)."""
  graphdef, state = nnx.split(model)
  caches, mtp_caches = model.init_cache(1, capacity), model.init_mtp_cache(1, capacity)
  ids, lens = jnp.ones((1, prompt_len), jnp.int32), jnp.array([prompt_len], jnp.int32)
  seed, d = jnp.uint32(0), model.config.mla.hidden_size
  plan = lambda width: model.step_plan(width, None, capacity=capacity)
  prefill = programs.trace(graphdef, state, caches, mtp_caches, ids, lens, seed,
                           settings=programs.SpeculativePrefillSettings(
                               model.step_plan(prompt_len, 0, capacity=capacity)))
  draft_state = generation_speculative.DraftState(
      tokens_B=lens, draft_BV=jnp.zeros((1, model.config.vocab_size)),
      hidden_BD=jnp.zeros((1, d)), accepted_B=lens, drafted_B=lens)
  decode = programs.trace(graphdef, state, caches, mtp_caches, draft_state,
                          Progress.start(jnp.ones((1,), bool), lens), seed, jnp.int32(1),
                          jnp.int32(8), settings=programs.SpeculativeSettings(
                              plan(k + 1), plan(1), m.generation.SamplingConfig(1.0), steps=2))
  # Unchecked, they carry no effects (which would send every call through Python dispatch).
  assert not prefill.jaxpr.effects and not decode.jaxpr.effects
  return summarize_jaxpr(prefill.jaxpr), summarize_jaxpr(decode.jaxpr)


def test_mqa_only_speculative_programs_never_contain_a_dense_branch():
  prefill, decode = _speculative_programs(_random("mqa-only"), k=3)
  for summary in (prefill, decode):
    assert summary.scopes & ROUTES == {"mla_sparse_mqa"}
    assert summary.primitives["cond"] == 0 and summary.primitives["switch"] == 0
  # The same prefill on a dense-capable model takes the dense route (the test can fail).
  dense_prefill, dense_decode = _speculative_programs(_random("dense-capable"))
  assert dense_prefill.scopes & ROUTES == {"mla_dense_mha"}
  assert dense_decode.scopes & ROUTES == {"mla_sparse_mqa"}


def test_speculative_settings_are_checked():
  model = _random()
  plan = lambda width, rows=16: model.step_plan(width, None, capacity=16, kv_rows=rows)
  with pytest.raises(ValueError, match=r"k in \[1, 8\]"):
    programs.SpeculativeSettings(plan(1), plan(1))
  with pytest.raises(ValueError, match="one-token step reading verify_plan's kv_rows"):
    programs.SpeculativeSettings(plan(3), plan(1, rows=8))


_CLI_ARGV = ["generate", "--prompt-len", "5", "--max-new-tokens", "4", "--quiet", "--backend",
             "xla", "--dtype", "float32", "--speculative-tokens", "2"]


@pytest.mark.slow  # a checkpoint written, loaded with its MTP layer and compiled: ~30 s
def test_cli_decodes_speculatively(tmp_path, capsys):
  from mla_jax import cli
  from mla_jax.checkpoints import save_pretrained

  save_pretrained(_random(), tmp_path)
  assert cli.main([*_CLI_ARGV, "--checkpoint", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "decode: 3 tokens" in out and "speculative: 2 draft tokens per step" in out


def test_cli_refuses_speculation_without_mtp_layers(tmp_path, capsys):
  from mla_jax import cli
  from mla_jax.checkpoints import save_pretrained

  config = dataclasses.replace(_config(), num_mtp_layers=0)
  save_pretrained(m.CausalLM(config, rngs=nnx.Rngs(0), backend="xla"), tmp_path)
  assert cli.main([*_CLI_ARGV, "--checkpoint", str(tmp_path)]) == 2
  assert "MTP layers" in capsys.readouterr().err


@pytest.mark.slow  # three MTP layers: one more compile of each program
def test_drafts_past_the_layers_repeat_the_last_one():
  """k = 4 on three MTP layers: drafts 2 and 3 run layers 1 and 2, draft 4 layer 2 again."""
  config = dataclasses.replace(_config(), num_mtp_layers=3)
  model = m.CausalLM(config, rngs=nnx.Rngs(1), backend="xla")
  mt.randomize_params(model, 3)
  plain = m.generate(model, PROMPTS, 7)
  spec = m.generate(model, PROMPTS, 7, speculative_tokens=4)
  assert spec.tokens == plain.tokens and spec.drafted > 0


def _accept(verify_BJV, ids_BJ, temperature: float, top_p: float = 1.0, seed: int = 0):
  """``decoding.speculative.accept`` with every draft offered and one setting for all rows,
  row b keyed by ``key(seed + b)``."""
  b = verify_BJV.shape[0]
  return decoding_speculative.accept(
      verify_BJV, ids_BJ, jnp.full((b,), ids_BJ.shape[1], jnp.int32),
      sampling.seed_keys(seed + jnp.arange(b, dtype=jnp.uint32)), jnp.zeros((b,), jnp.int32),
      jnp.full((b,), temperature, jnp.float32), jnp.full((b,), top_p, jnp.float32))


def test_greedy_acceptance_is_ragged():
  """Row 0 agrees on both drafts (bonus from the last position), row 1 on the first only,
  row 2 on none: each row its own accepted count and next token, after its kept drafts."""
  best = np.array([[3, 5, 7], [3, 6, 1], [2, 5, 4]])
  verify = jax.nn.one_hot(best, 8) * 4.0
  ids = jnp.array([[0, 3, 5], [0, 3, 5], [0, 3, 5]], jnp.int32)
  accepted, tokens = _accept(verify, ids, 0.0)
  np.testing.assert_array_equal(accepted, [2, 1, 0])
  np.testing.assert_array_equal(tokens, [[3, 5, 7], [3, 6, 6], [2, 2, 2]])


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_sampling_draws_from_the_main_distribution(top_p):
  """A greedy draft d (q one-hot on it, as the MTP drafts are), accepted or redrawn: the
  first token is distributed as p (the exact distribution, 200000 rows each keyed by its own
  seed), d is kept at the rate p(d), and the bonus after a kept draft follows p's next row.
  With the residual replaced by p the first token is off."""
  transformed = lambda logits: sampling.row_logits(logits, jnp.ones(logits.shape[:1]),
                                                   jnp.full(logits.shape[:1], top_p))
  rng, n = np.random.default_rng(0), 200_000
  main_KV = jnp.asarray(rng.normal(size=(2, 8)) * 1.5, jnp.float32)
  p = np.asarray(jax.nn.softmax(transformed(main_KV), axis=-1), np.float64)
  d = int(np.argsort(-p[0])[1])  # the second most likely token: often kept, often not
  ids = jnp.broadcast_to(jnp.array([0, d], jnp.int32), (n, 2))

  def run():
    return _accept(jnp.broadcast_to(main_KV, (n, 2, 8)), ids, 1.0, top_p)

  accepted, tokens = run()
  freq = np.bincount(np.asarray(tokens[:, 0]), minlength=8) / n
  assert np.abs(freq - p[0]).max() < 4e-3
  assert abs(np.mean(accepted) - p[0][d]) < 4e-3  # the acceptance rate: sum(min(p, q))
  bonus = np.bincount(np.asarray(tokens[:, 1])[np.asarray(accepted) == 1], minlength=8)
  assert np.abs(bonus / bonus.sum() - p[1]).max() < 6e-3
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(decoding_speculative, "residual", lambda p_BV, q_BV: p_BV)
    wrong = np.bincount(np.asarray(run()[1][:, 0]), minlength=8) / n
  assert np.abs(wrong - p[0]).max() > 0.03


def test_dispatches_move_to_the_next_cache_bucket():
  """A context crossing 256 rows: the first dispatches read 256 rows, the later ones the
  whole capacity (248 prompt + 20 new + k = 3 rows: 271); the tokens equal plain decoding's."""
  model, prompt = _copying(), [list(np.random.default_rng(0).integers(0, 256, 248))]
  plain = m.generate(model, prompt, 20)
  spec = m.generate(model, prompt, 20, speculative_tokens=3, steps_per_dispatch=1)
  assert spec.tokens == plain.tokens and spec.decode_buckets == (256, 271)


@pytest.mark.slow  # compiled for 8 devices on the 2 cores: ~16 s, with the other sharded cases
def test_sharded_speculative_decoding_gives_the_same_tokens():
  from mla_jax import sharding

  source = _random()
  mesh = sharding.make_mesh("data=2,tensor=4")
  model = m.CausalLM(source.config, rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
  placed = jax.tree.map(lambda a: a.sharding, nnx.state(model, nnx.Param))
  nnx.update(model, jax.device_put(nnx.state(source, nnx.Param), placed))
  prompts = PROMPTS[:2]
  spec = m.generate(model, prompts, 7, speculative_tokens=2)
  assert spec.tokens == m.generate(source, prompts, 7).tokens


@pytest.mark.slow  # Pallas kernels in interpret mode
def test_pallas_backend_verifies_the_same_tokens():
  """The verify step's k + 1 queries per sequence through the Pallas kernels (indexer and
  sparse MQA), a prompt past the top-k included."""
  pallas = m.CausalLM(_config(), rngs=nnx.Rngs(0), backend=m.backends.get_backend("pallas"))
  nnx.update(pallas, nnx.state(_random(), nnx.Param))
  prompts = PROMPTS[:2]
  assert (m.generate(pallas, prompts, 4, speculative_tokens=2).tokens
          == m.generate(_random(), prompts, 4).tokens)


@pytest.mark.slow
def test_fp8_caches_give_the_plain_tokens():
  """fp8 main and MTP caches (rows quantized on write, k + 1 at a time in the verify)."""
  model = _random()
  spec = m.generate(model, PROMPTS, 6, cache_dtype="fp8", speculative_tokens=2)
  assert spec.tokens == m.generate(model, PROMPTS, 6, cache_dtype="fp8").tokens


def test_rejected_drafts_leave_the_caches_of_a_prefill_of_the_emitted_tokens():
  """Survivor 9: after each iteration, the main and MTP caches hold what one prefill of the
  emitted sequence writes: the rejected drafts' MTP rows are rolled back, not attended to
  (which only lowers acceptance, so the token tests cannot see it)."""
  model, k, capacity = _random(), 3, 32
  sequence = [9, 3, 1, 4, 1, 5, 9, 2, 6]
  greedy = sampling.SamplingConfig()
  key = jax.random.key(0)

  def prefill(ids):
    return generation_speculative.prefill(
        model, model.init_cache(1, capacity), model.init_mtp_cache(1, capacity),
        jnp.array([ids], jnp.int32), jnp.array([len(ids)], jnp.int32), jnp.uint32(0),
        plan=model.step_plan(len(ids), 0, capacity=capacity), sampling=greedy)

  tokens_B, caches, mtp_caches, draft_BV, hidden_BD = prefill(sequence)
  sequence.append(int(tokens_B[0]))
  one = jnp.ones((1,), jnp.int32)
  state = generation_speculative.DraftState(tokens_B, draft_BV, hidden_BD, 0 * one, 0 * one)
  progress = Progress.start(one > 0, one)
  rejected = 0
  for _ in range(3):
    accepted_before = int(state.accepted_B[0])
    caches, mtp_caches, state, tokens_BK, valid_B = generation_speculative.iteration(
        model, caches, mtp_caches, state, progress, key, 20,
        verify_plan=model.step_plan(k + 1, None, capacity=capacity),
        draft_plan=model.step_plan(1, None, capacity=capacity), sampling=greedy)
    progress, emitted_BK = emit(progress, tokens_BK, valid_B, stop_ids_of(None), 20)
    rejected += int(state.accepted_B[0]) - accepted_before < k
    sequence += [int(t) for t in emitted_BK[0] if t >= 0]
    # The last emitted token is not in the caches yet: the prefill of the rest samples it.
    ref_tokens_B, ref_caches, ref_mtp, ref_draft_BV, ref_hidden_BD = prefill(sequence[:-1])
    assert int(ref_tokens_B[0]) == int(state.tokens_B[0]) == sequence[-1]
    n = len(sequence) - 1
    for got, want in [(caches.groups[0][0], ref_caches.groups[0][0]),
                      (mtp_caches[0], ref_mtp[0])]:
      assert int(got.num_cached_B.reshape(-1)[0]) == int(want.num_cached_B.reshape(-1)[0]) == n
      for got_rows, want_rows in zip(got.pools, want.pools):  # [..., rows, width]
        np.testing.assert_allclose(got_rows[..., :n, :], want_rows[..., :n, :], rtol=1e-5,
                                   atol=1e-5)
    np.testing.assert_allclose(state.draft_BV, ref_draft_BV, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.hidden_BD, ref_hidden_BD, rtol=1e-5, atol=1e-5)
  assert rejected > 0  # the case the test is for
