"""Scoring: prompt log-probabilities from the engine's step programs equal a float64
log-softmax of one contiguous forward, under chunked prefill, prefix hits and preemption;
``max_tokens`` 0 scores without generating; an engine that does not score refuses by name."""

import numpy as np
import pytest
from flax import nnx

from mla_jax import testing as mt
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.serving.engine import Engine
from mla_jax.serving.sequence import MAX_LOGPROBS, SamplingParams

PAGE = 8


@pytest.fixture(scope="module")
def model():
  model = CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0), backend="xla")
  mt.randomize_params(model, 1)
  return model


def _reference(model, tokens):
  """[len(tokens) - 1, V]: float64 log-softmax of the logits that predict tokens 1, 2, ...
  (one contiguous forward)."""
  ids = np.asarray(tokens[:-1])[None]
  logits = np.asarray(model(ids, model.init_cache(1, len(tokens)))[0][0], np.float64)
  logits -= logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _check(model, out, top: int):
  prompt = list(out.prompt_tokens)
  ref = _reference(model, prompt)
  entries = out.prompt_logprobs
  assert len(entries) == len(prompt) and entries[0] is None
  for p, (entry, row) in enumerate(zip(entries[1:], ref), 1):
    assert entry.token == prompt[p]
    np.testing.assert_allclose(entry.logprob, row[prompt[p]], rtol=1e-5, atol=1e-6)
    assert entry.rank == 1 + int((row > row[prompt[p]]).sum())
    best = np.argsort(-row, kind="stable")[:top]
    assert [t for t, _ in entry.top] == best.tolist()
    np.testing.assert_allclose([v for _, v in entry.top], row[best], rtol=1e-5, atol=1e-6)


def test_prompt_logprobs_equal_a_contiguous_forward_under_chunks_and_prefix_hits(model):
  rng = np.random.default_rng(3)
  vocab = model.config.vocab_size
  shared = rng.integers(0, vocab, 37).tolist()
  prompts = [shared + rng.integers(0, vocab, n).tolist() for n in (9, 30)]
  prompts.append(rng.integers(0, vocab, 5).tolist())
  engine = Engine(model, num_pages=24, page_size=PAGE, max_num_seqs=4, max_step_tokens=16,
                  log_interval=None, prompt_logprobs=True)
  # The first warms the prefix cache; the scoring ones must still compute the shared pages.
  engine.generate([shared + [1]], max_tokens=1)
  hits_before = engine.pages.num_cached
  outs = engine.generate(prompts, [SamplingParams(max_tokens=3, prompt_logprobs=4),
                                   SamplingParams(max_tokens=0, prompt_logprobs=0,
                                                  logprobs=2),
                                   SamplingParams(max_tokens=0, prompt_logprobs=MAX_LOGPROBS)])
  assert hits_before > 0
  assert all(out.num_cached_prompt_tokens == 0 for out in outs)
  for out, top in zip(outs, (4, 0, MAX_LOGPROBS)):
    _check(model, out, top)
  assert len(outs[0].tokens) == 3 and outs[0].finish_reason == "length"
  assert outs[1].tokens == () and outs[1].finish_reason == "length"
  assert outs[1].logprobs == ()  # asked, none generated
  scoring = [c for c in engine.programs if c.shape.scores]
  assert scoring and ({engine.buckets.covering(c.shape) for c in engine.programs}
                      <= set(engine.buckets.all_shapes()))
  for c in engine.programs:  # the MQA-only contract holds in the scoring programs too
    assert not {"mla_dense_mha", "mla_masked_mha"} & c.summary.scopes, c.shape
    assert "indexer_score" in c.summary.scopes and c.plan.route.name == "SPARSE_MQA", c.shape
  # Without prompt_logprobs the same request reuses the prefix again.
  plain = engine.generate([prompts[0]], max_tokens=1)[0]
  assert plain.num_cached_prompt_tokens > 0 and plain.prompt_logprobs is None
  engine.pages.check()
  assert engine.pages.num_in_use == 0


def test_preempted_scoring_requests_keep_every_entry(model):
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (30, 28, 25)]
  engine = Engine(model, num_pages=9, page_size=PAGE, max_num_seqs=3, max_step_tokens=16,
                  log_interval=None, prompt_logprobs=True)
  outs = engine.generate(prompts, max_tokens=12, prompt_logprobs=1)
  assert engine.scheduler.num_preemptions > 0
  for out in outs:
    _check(model, out, 1)


def test_an_engine_that_does_not_score_refuses_by_name(model):
  engine = Engine(model, num_pages=8, page_size=PAGE, log_interval=None)
  with pytest.raises(ValueError, match="prompt_logprobs: this engine does not score prompts"):
    engine.add_request([1, 2, 3], SamplingParams(prompt_logprobs=1))
  assert not any(shape.scores for shape in engine.buckets.all_shapes())
  with pytest.raises(TypeError, match="prompt_logprobs must be a bool"):
    Engine(model, num_pages=8, prompt_logprobs=1)
  with pytest.raises(ValueError, match="prompt_logprobs"):
    SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)


def test_scoring_programs_cover_every_other_token_bucket_down_from_the_largest(model):
  engine = Engine(model, num_pages=8, page_size=PAGE, max_step_tokens=512, log_interval=None,
                  prompt_logprobs=True)
  shapes = engine.buckets.all_shapes()
  assert sorted(s.tokens for s in shapes if s.scores) == [8, 32, 128, 512]
  assert not any(s.scores and (s.fresh or s.decode_steps > 1) for s in shapes)
