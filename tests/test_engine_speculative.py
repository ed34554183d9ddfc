"""The engine's speculative decoding (``SamplingParams.speculative_tokens``): greedy tokens equal
plain ``generate`` per request whatever k each request asks for, under chunked prefill,
preemption and prefix hits; an always-accepting head stops mid-step at max_tokens and stop
ids; sampled tokens keep the plain distribution; log-probabilities are the model's; pages do
not leak; bad settings are refused; and every compiled program keeps the routing contract."""

import numpy as np
import pytest
from flax import nnx
from scipy import stats

from mla_jax.generation.loop import generate
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.decoding import speculative
from mla_jax.decoding.programs import ProgramCache
from mla_jax.serving import runner as engine_module
from mla_jax.serving.engine import Engine
from mla_jax.serving.sequence import SamplingParams
from tests.test_engine import _logprobs_reference, _mqa_only_contract
from tests.test_speculative import _copying, _glm, _random


PAGE = 8
SETTINGS = dict(page_size=PAGE, max_num_seqs=4, max_step_tokens=32, log_interval=None,
                max_speculative_tokens=3)
SHARED = list(range(60, 76))  # two pages: later prompts hit the prefix cache
PROMPTS = [[5, 6, 7], list(range(40, 81)), SHARED + [9, 3, 1], [2] * 9, SHARED + [4, 4]]


def _engine(model, **overrides):
  return Engine(model, **{**SETTINGS, "num_pages": 40, **overrides})


def _no_leaks(engine):
  engine.pages.check()
  assert engine.pages.num_free == engine.num_pages
  if engine.model.config.attention == "mqa-only":
    _mqa_only_contract(engine.programs)


def _run(engine, prompts, ks, new, **params):
  """Each prompt with its own k, arriving one step apart."""
  ids = []
  for prompt, k in zip(prompts, ks):
    ids.append(engine.add_request(prompt, SamplingParams(max_tokens=new, speculative_tokens=k,
                                                         **params)))
    engine.step()
  while engine.has_unfinished():
    engine.step()
  return [engine.release(i) for i in ids]


@pytest.mark.parametrize("ks", [pytest.param((1, 1, 1, 1, 1), marks=pytest.mark.slow),
                                (0, 3, 2, 1, 3)])
def test_greedy_tokens_equal_plain_decoding_for_any_mix_of_k(ks):
  """A random head (drafts almost always rejected: every step rolls back), k per request,
  a 41-token prompt prefilled over two steps and two prompts sharing two cached pages."""
  model = _random()
  engine = _engine(model)
  outputs = _run(engine, PROMPTS, ks, 10)
  assert [list(o.tokens) for o in outputs] == generate(model, PROMPTS, 10).tokens
  assert [o.num_draft_tokens > 0 for o in outputs] == [k > 0 for k in ks]
  assert outputs[4].num_cached_prompt_tokens == 2 * PAGE
  _no_leaks(engine)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense-capable", "fp8", "glm"])
def test_greedy_tokens_equal_plain_decoding_on_other_models(name):
  """A dense-capable model (its prefills dense, masked or sparse, the MTP layer on the same
  plan), fp8 pages (MTP pools too) and a GLM-5-shaped model (IndexShare main layers, the MTP
  layer indexing on its own)."""
  model = _glm() if name == "glm" else _random("dense-capable" if name == "dense-capable"
                                                else "mqa-only")
  cache = dict(cache_dtype="fp8") if name == "fp8" else {}
  prompts = [[t % model.config.vocab_size for t in p] for p in PROMPTS]
  engine = _engine(model, **cache)
  outputs = _run(engine, prompts, (0, 3, 2, 1, 3), 8)
  assert [list(o.tokens) for o in outputs] == generate(model, prompts, 8, **cache).tokens
  assert engine.stats.draft_tokens > 0
  _no_leaks(engine)


def test_always_accepted_drafts_stop_mid_step():
  """The copying head's drafts are always accepted: k + 1 tokens a step; a row drafts no
  more than its tokens left, and the tokens past a stop id inside a step are dropped."""
  model = _copying()
  plain = generate(model, PROMPTS[:3], 8).tokens
  engine = _engine(model)
  outputs = engine.generate(PROMPTS[:3], max_tokens=8, speculative_tokens=3)
  assert [list(o.tokens) for o in outputs] == plain
  assert all(o.acceptance_rate == 1.0 for o in outputs)
  # 1 token from the prefill (which drafts 3), 4 from those 3 drafts, then 3 from 2 drafts
  # (the 8th token is the last: no third draft).
  assert [o.num_draft_tokens for o in outputs] == [3 + 2] * 3
  stop = plain[0][3]
  stopped = engine.generate([PROMPTS[0]], [SamplingParams(max_tokens=9, speculative_tokens=3,
                                                          stop_token_ids=(stop,))])[0]
  assert list(stopped.tokens) == plain[0][:plain[0].index(stop) + 1]
  assert stopped.finish_reason == "stop"
  assert engine.stats.accepted_tokens == engine.stats.draft_tokens > 0
  _no_leaks(engine)


def test_preempted_speculative_requests_recompute_to_the_same_tokens():
  """Four requests growing to four pages each in a 12-page pool: decodes that need pages
  preempt the newest, whose drafts are dropped and whose MTP rows are recomputed."""
  model = _copying()
  prompts = [list(range(10 * i, 10 * i + 2 * PAGE)) for i in range(4)]
  engine = _engine(model, num_pages=12)
  outputs = engine.generate(prompts, max_tokens=2 * PAGE, speculative_tokens=3)
  assert [list(o.tokens) for o in outputs] == generate(model, prompts, 2 * PAGE).tokens
  assert engine.scheduler.num_preemptions > 0
  _no_leaks(engine)


def test_logprobs_of_accepted_drafts_are_the_model_distribution():
  model = _copying()
  engine = _engine(model)
  out = engine.generate([PROMPTS[1]], [SamplingParams(max_tokens=8, logprobs=3,
                                                      speculative_tokens=3)])[0]
  assert out.num_accepted_tokens > 0 and len(out.logprobs) == 8
  expected = _logprobs_reference(model, list(out.prompt_tokens + out.tokens),
                                 len(out.prompt_tokens))
  for i, (token, entry) in enumerate(zip(out.tokens, out.logprobs)):
    assert entry.token == token
    np.testing.assert_allclose(entry.logprob, expected[i, token], rtol=1e-5, atol=1e-5)
    top = np.argsort(-expected[i])[:3]
    assert [t for t, _ in entry.top] == top.tolist()


def _counts(engine, speculative_tokens, seed, rows=512, **sampling):
  """[4 positions, vocab] token counts of ``rows`` requests of one prompt, seeds from
  ``seed`` (so the rows are i.i.d.)."""
  params = [SamplingParams(max_tokens=4, seed=seed + i, speculative_tokens=speculative_tokens,
                           **sampling) for i in range(rows)]
  tokens = np.array([o.tokens for o in engine.generate([[1, 2, 3]] * rows, params)])
  vocab = engine.model.config.vocab_size
  return np.stack([np.bincount(tokens[:, i], minlength=vocab) for i in range(4)])


def _min_p_value(plain, spec):
  """The smallest chi-square homogeneity p-value over positions 1..3 (the drafted ones)."""
  seen = (plain + spec) > 0
  return min(stats.chi2_contingency(np.stack([p[s], q[s]]))[1]
             for p, q, s in list(zip(plain, spec, seen))[1:])


WIDE = dict(max_num_seqs=256, max_step_tokens=1024, num_pages=256, prefix_caching=False)


def test_rejection_sampling_keeps_the_plain_distribution(monkeypatch):
  """Vocabulary 8, 512 requests per method, fixed seeds (the wrong rule's p-value, measured:
  6e-12 at 1024 requests, 6e-7 at 512; the bound is 1e-3). The copying head drafts the main
  model's most likely token, so drafts are often accepted and often rejected; replacing a
  rejected draft by a draw from p (the wrong rule) is detected."""
  model = _copying(vocab_size=8)
  engine = _engine(model, **WIDE)
  plain = _counts(engine, 0, 10_000, temperature=1.0)
  spec = _counts(engine, 2, 0, temperature=1.0)
  print(f"acceptance {engine.stats.accepted_tokens}/{engine.stats.draft_tokens}, "
        f"p-value {_min_p_value(plain, spec):.3g}")
  assert _min_p_value(plain, spec) > 1e-3
  monkeypatch.setattr(speculative, "residual", lambda p_BV, q_BV: p_BV)
  # Recompile the programs with the wrong rule in a cache of their own, so no other test meets
  # them.
  monkeypatch.setattr(engine_module, "_COMPILED", ProgramCache())
  wrong = _counts(_engine(model, **WIDE), 2, 0, temperature=1.0)
  print(f"wrong rule: p-value {_min_p_value(plain, wrong):.3g}")
  assert _min_p_value(plain, wrong) < 1e-3


def test_bad_speculative_settings_are_refused():
  with pytest.raises(ValueError, match=r"speculative_tokens must be an int in \[0, 8\]"):
    SamplingParams(speculative_tokens=9)
  with pytest.raises(ValueError, match=r"speculative_tokens must be an int in \[0, 8\]"):
    SamplingParams(speculative_tokens=-1)
  with pytest.raises(ValueError, match="max_speculative_tokens must be an int in"):
    _engine(_random(), max_speculative_tokens=9)
  plain_engine = _engine(_random(), max_speculative_tokens=0)
  with pytest.raises(ValueError, match="exceeds the engine's max_speculative_tokens 0"):
    plain_engine.add_request([1, 2], SamplingParams(speculative_tokens=1))
  with pytest.raises(ValueError, match="exceeds the engine's max_speculative_tokens 3"):
    _engine(_random()).add_request([1, 2], SamplingParams(speculative_tokens=4))
  assert not plain_engine.has_unfinished()
  no_mtp = CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0), backend="xla")
  with pytest.raises(ValueError, match="needs a model with MTP layers"):
    _engine(no_mtp)
