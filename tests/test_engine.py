"""The engine: greedy tokens equal ``generate`` per request under chunked prefill, preemption,
prefix hits and aborts; no page leaks; bad requests refused without disturbing others; and every
step program it compiled keeps the routing contract (walked on the traced programs)."""

import numpy as np
import pytest
from flax import nnx

from mla_jax import testing as mt
from mla_jax.backends import XlaBackend
from mla_jax.decoding.programs import ProgramCache
from mla_jax.generation.loop import generate
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.serving.engine import Engine
from mla_jax.serving.sequence import SamplingParams


PAGE = 8
NEW = 6
SETTINGS = dict(page_size=PAGE, max_num_seqs=4, max_step_tokens=32, log_interval=None)
PROMPT_LENS = (5, 40, 17, 70, 3)
ROUTES = {"mla_dense_mha", "mla_masked_mha", "mla_sparse_mqa", "mla_dense_mqa"}


def _model(attention, backend="xla"):
  model = CausalLM(tiny_lm(attention), rngs=nnx.Rngs(0), backend=backend)
  mt.randomize_params(model, 1)
  return model


@pytest.fixture(scope="module")
def model():
  return _model("mqa-only")


@pytest.fixture(scope="module")
def prompts(model):
  rng = np.random.default_rng(0)
  return [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in PROMPT_LENS]


def _reference(model, prompts, new=NEW, **kwargs):
  """Greedy ``generate`` tokens per prompt (a ragged batch equals each prompt alone:
  test_generation.py::test_ragged_batch_matches_each_prompt_alone)."""
  return generate(model, prompts, new, **kwargs).tokens


@pytest.fixture(scope="module")
def reference(model, prompts):
  return _reference(model, prompts)


def _engine(model, **overrides):
  return Engine(model, **{**SETTINGS, "num_pages": 12, **overrides})


def test_seeded_sampling_draws_generates_tokens(model, prompts):
  """At temperature 1, an engine request of seed s + b draws what ``generate(seed=s)`` draws
  for its row b (``sampling.sample``: the same per-row keys), under chunked prefill,
  preemption and multi-step decode."""
  want = generate(model, prompts, NEW, temperature=1.0, top_p=0.9, seed=7).tokens
  params = [SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.9, seed=7 + b)
            for b in range(len(prompts))]
  engine = _engine(model, decode_steps=4)
  assert [list(o.tokens) for o in engine.generate(prompts, params)] == want
  assert engine.stats.decode_dispatches > 0
  assert want != _reference(model, prompts)  # the draws are not the greedy tokens


def _run_all(engine, request_ids):
  while engine.has_unfinished():
    engine.step()
  return {i: list(engine.release(i).tokens) for i in request_ids}


def _no_leaks(engine):
  """Every page free, refcounts at 0, and (MQA-only) the contract in every compiled program."""
  engine.pages.check()
  assert engine.pages.num_free == engine.num_pages
  assert all(engine.pages.refcount(p) == 0 for p in range(engine.num_pages))
  if engine.model.config.attention == "mqa-only":
    _mqa_only_contract(engine.programs)


def _mqa_only_contract(programs):
  assert programs
  for c in programs:
    assert not {"mla_dense_mha", "mla_masked_mha"} & c.summary.scopes, c.shape
    assert "indexer_score" in c.summary.scopes, c.shape
    assert c.plan.route.name == "SPARSE_MQA"


def _recorded_steps(engine) -> list[dict]:
  """What each step the engine schedules holds (decodes, fresh and continuing chunks)."""
  steps, schedule = [], engine.scheduler.schedule

  def recording():
    batch = schedule()
    steps.append(dict(decodes=len(batch.decodes),
                      fresh=sum(c.num_cached == 0 for c in batch.prefills),
                      continuing=sum(c.num_cached > 0 for c in batch.prefills)))
    return batch

  engine.scheduler.schedule = recording
  return steps


def test_tokens_equal_generate_with_chunks_and_random_arrivals(model, prompts, reference):
  engine = _engine(model)
  steps = _recorded_steps(engine)
  rng = np.random.default_rng(1)
  order = rng.permutation(len(prompts))
  ids = {}
  for i in order:  # arrivals between steps, in a random order
    ids[i] = engine.add_request(prompts[i], SamplingParams(max_tokens=NEW))
    for _ in range(rng.integers(0, 3)):
      engine.step()
  got = _run_all(engine, ids.values())
  assert [got[ids[i]] for i in range(len(prompts))] == reference
  # A step mixed a fresh chunk with a continuing one, and decodes ran several steps a dispatch.
  assert any(step["fresh"] and step["continuing"] for step in steps)
  assert engine.stats.decode_dispatches > 0
  assert any(c.shape.decode_steps > 1 for c in engine.programs)
  _no_leaks(engine)


def test_preempted_requests_are_recomputed_to_the_same_tokens(model):
  """Each request grows to five pages and three are admitted into the 12-page pool: a decode
  that needs a page preempts the newest sequence, which later recomputes its prompt and output
  so far."""
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, model.config.vocab_size, size=3 * PAGE).tolist() for _ in range(4)]
  engine = _engine(model)
  outputs = engine.generate(prompts, max_tokens=2 * NEW)
  assert [list(o.tokens) for o in outputs] == _reference(model, prompts, 2 * NEW)
  assert engine.scheduler.num_preemptions > 0
  assert any(o.num_preemptions for o in outputs)
  _no_leaks(engine)


@pytest.mark.slow
def test_offline_generate_reports_in_prompt_order(model, prompts, reference):
  engine = _engine(model, num_pages=32, max_step_tokens=512, prefix_caching=False)
  outputs = engine.generate(prompts, max_tokens=NEW)
  assert [list(o.tokens) for o in outputs] == reference
  assert all(o.finished and o.finish_reason == "length" and o.ttft > 0 for o in outputs)
  assert [list(o.prompt_tokens) for o in outputs] == prompts
  again = len(engine.programs)
  engine.generate(prompts, max_tokens=NEW)
  assert len(engine.programs) == again  # one program per shape bucket, compiled once
  _no_leaks(engine)


@pytest.mark.slow
def test_prefix_hits_change_no_token(model, prompts):
  shared = prompts[3][:3 * PAGE]  # three full pages
  family = [shared + p[:n] for p, n in zip(prompts, (4, 9, 1, 12, 2))]
  expected = _reference(model, family)
  engine = _engine(model, num_pages=32)
  first = engine.generate(family[:1], max_tokens=NEW)
  rest = engine.generate(family[1:], max_tokens=NEW)
  assert [list(o.tokens) for o in first + rest] == expected
  assert all(o.num_cached_prompt_tokens == 3 * PAGE for o in rest)
  uncached = _engine(model, num_pages=32, prefix_caching=False).generate(family,
                                                                        max_tokens=NEW)
  assert [list(o.tokens) for o in uncached] == expected
  assert all(o.num_cached_prompt_tokens == 0 for o in uncached)
  _no_leaks(engine)


def test_aborts_in_flight_free_their_pages_and_spare_the_others(model, prompts, reference):
  engine = _engine(model)
  ids = [engine.add_request(p, SamplingParams(max_tokens=NEW)) for p in prompts]
  engine.step()
  engine.step()
  running = [s.request_id for s in engine.scheduler.running]
  waiting = [s.request_id for s in engine.scheduler.waiting]
  aborted = {running[0], waiting[-1]}
  # The running one has a step in flight (dispatched, not read): the abort lands on it.
  assert running[0] in {c.seq.request_id for c in engine._pipeline.in_flight.batch.chunks}
  for request_id in aborted:
    engine.abort(request_id)
  out = engine.output(running[0])
  assert out.finish_reason == "abort"
  assert list(out.tokens) == reference[ids.index(running[0])][:len(out.tokens)]
  with pytest.raises(KeyError, match="no request with id 'nope'"):
    engine.abort("nope")
  got = _run_all(engine, [i for i in ids if i not in aborted])
  for i, request_id in enumerate(ids):
    if request_id not in aborted:
      assert got[request_id] == reference[i]
  _no_leaks(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(model, prompts):
  params = SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.8, seed=7)
  engine = _engine(model)
  alone = engine.generate([prompts[1]], [params])[0].tokens
  mixed = engine.generate(prompts[:3], [SamplingParams(max_tokens=NEW, seed=1,
                                                       temperature=1.0), params,
                                        SamplingParams(max_tokens=NEW)])
  assert mixed[1].tokens == alone
  assert mixed[0].tokens != alone


@pytest.mark.slow
def test_fp8_pages_match_the_fp8_contiguous_cache(model, prompts):
  subset = prompts[:3]
  expected = _reference(model, subset, cache_dtype="fp8")
  engine = _engine(model, cache_dtype="fp8", num_pages=32)
  assert [list(o.tokens) for o in engine.generate(subset, max_tokens=NEW)] == expected
  _no_leaks(engine)


def test_stream_of_one_request_yields_its_tokens_as_they_come(model, prompts, reference):
  engine = _engine(model)
  other = engine.add_request(prompts[0], SamplingParams(max_tokens=NEW))
  mine = engine.add_request(prompts[2], SamplingParams(max_tokens=NEW))
  updates = list(engine.stream(mine))
  assert [t for u in updates for t in u.new_tokens] == reference[2]
  assert {u.request_id for u in updates} == {mine} and updates[-1].finished
  assert list(engine.output(other).tokens) == reference[0][:len(engine.output(other).tokens)]
  with pytest.raises(KeyError, match="no request with id 'nope'"):
    next(engine.stream("nope"))


def test_stop_tokens_and_eos_finish_a_request(model, prompts, reference):
  engine = _engine(model)
  stop = reference[1][2]
  out = engine.generate([prompts[1]], [SamplingParams(max_tokens=NEW,
                                                      stop_token_ids=(stop,))])[0]
  assert list(out.tokens) == reference[1][:reference[1].index(stop) + 1]
  assert out.finish_reason == "stop"
  eos_engine = _engine(model, eos_token_ids=[stop])
  assert eos_engine.generate([prompts[1]], max_tokens=NEW)[0].finish_reason == "stop"
  # The stop token as the last token allowed: still "stop", not "length".
  last = engine.generate([prompts[1]], [SamplingParams(max_tokens=reference[1].index(stop) + 1,
                                                       stop_token_ids=(stop,))])[0]
  assert list(last.tokens) == list(out.tokens) and last.finish_reason == "stop"
  # ignore_eos (vLLM's): the engine's eos ids no longer stop it, a request's own ids still do;
  # in single steps and in multi-step dispatches alike.
  for decode_steps in (1, 8):
    eos_engine = _engine(model, eos_token_ids=[stop], decode_steps=decode_steps)
    free = eos_engine.generate([prompts[1]], max_tokens=NEW, ignore_eos=True)[0]
    assert list(free.tokens) == reference[1] and free.finish_reason == "length"
    own = eos_engine.generate([prompts[1]], [SamplingParams(
        max_tokens=NEW, ignore_eos=True, stop_token_ids=(stop,))])[0]
    assert list(own.tokens) == list(out.tokens) and own.finish_reason == "stop"
  with pytest.raises(ValueError, match="stop_token_ids entry 999 is outside the vocabulary"):
    engine.check_request(prompts[1], SamplingParams(stop_token_ids=(999,)))


def test_min_tokens_holds_back_stop_ids_and_top_k_1_is_greedy(model, prompts, reference):
  """vLLM's min_tokens, top_k and min_p inside the step programs, in single steps and in
  multi-step dispatches."""
  second = reference[1][1]  # drawn by a decode step: a dispatch's when decode_steps is 8
  assert reference[1][0] != second
  for decode_steps in (1, 8):
    engine = _engine(model, eos_token_ids=[second], decode_steps=decode_steps)
    assert list(engine.generate([prompts[1]], max_tokens=NEW)[0].tokens) == reference[1][:2]
    held = engine.generate([prompts[1]], max_tokens=NEW, min_tokens=4)[0]
    assert len(held.tokens) >= 4 and second not in held.tokens[:4]
    # The boundary, as vLLM's: a stop id may come once min_tokens tokens came before it.
    assert list(engine.generate([prompts[1]], max_tokens=NEW, min_tokens=1)[0].tokens) == \
        reference[1][:2]
    assert engine.generate([prompts[1]], max_tokens=NEW, min_tokens=2)[0].tokens[1] != second
    # Either cut leaves only the most likely token: sampling at temperature 1 is greedy.
    plain = _engine(model, decode_steps=decode_steps)
    for cut in (dict(top_k=1), dict(min_p=1.0)):
      out = plain.generate([prompts[1]], max_tokens=NEW, temperature=1.0, seed=3, **cut)[0]
      assert list(out.tokens) == reference[1], cut
    drawn = plain.generate([prompts[1]], max_tokens=NEW, temperature=1.0, seed=3)[0]
    assert list(drawn.tokens) != reference[1]  # without a cut it draws
  with pytest.raises(ValueError, match="min_tokens holds back at most 8 stop ids"):
    engine.check_request(prompts[1], SamplingParams(min_tokens=1, stop_token_ids=range(8)))
  # Ignored eos ids and repeated ids are not counted.
  engine.check_request(prompts[1], SamplingParams(min_tokens=1, stop_token_ids=(*range(8), 7),
                                                  ignore_eos=True))


def test_a_request_exactly_filling_the_context_is_accepted(model):
  """prompt + max_tokens == max_model_len fits; one token more is refused by name."""
  from mla_jax.decoding.prompt_checks import ContextLengthError

  engine = _engine(model, max_model_len=64)
  assert len(engine.check_request(list(range(58)), SamplingParams(max_tokens=6))) == 58
  with pytest.raises(ContextLengthError, match="58 tokens \\+ max_tokens 7 = 65 exceeds the "
                                                "model's context of 64 tokens"):
    engine.check_request(list(range(58)), SamplingParams(max_tokens=7))


def _logprobs_reference(model, tokens, num_prompt):
  """float64 log-softmax of the model's logits at each position that predicts an output token
  (one contiguous forward over prompt + output)."""
  ids = np.asarray(tokens[:-1])[None]
  logits = model(ids, model.init_cache(1, len(tokens)))[0]
  shifted = np.asarray(logits[0, num_prompt - 1:], np.float64)
  shifted -= shifted.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_logprobs_are_the_model_distribution_of_each_output_token(model, prompts):
  engine = _engine(model)
  greedy, sampled = engine.generate(
      prompts[1:3], [SamplingParams(max_tokens=NEW, logprobs=3),
                     SamplingParams(max_tokens=NEW, logprobs=0, temperature=1.5, seed=3)])
  for out in (greedy, sampled):
    ref = _logprobs_reference(model, [*out.prompt_tokens, *out.tokens], len(out.prompt_tokens))
    assert [lp.token for lp in out.logprobs] == list(out.tokens)
    for row, lp in zip(ref, out.logprobs):
      np.testing.assert_allclose(lp.logprob, row[lp.token], rtol=1e-4, atol=1e-4)
      top = np.argsort(-row)[:len(lp.top)]
      assert [t for t, _ in lp.top] == top.tolist()
      np.testing.assert_allclose([v for _, v in lp.top], row[top], rtol=1e-4, atol=1e-4)
  assert all(len(lp.top) == 3 and lp.top[0][0] == lp.token for lp in greedy.logprobs)
  assert all(lp.top == () for lp in sampled.logprobs)
  assert engine.generate(prompts[:1], max_tokens=2)[0].logprobs is None  # not asked


def test_logit_bias_shifts_what_each_row_samples_from(model, prompts):
  """Greedy: each token is the argmax of the reference logits plus the bias (teacher-forced
  along the output), in multi-step dispatches and one-step programs alike; sampled: +100 on
  three tokens draws only those; the reported log-probabilities stay the model's."""
  engine = _engine(model)
  vocab = model.config.vocab_size
  bias = {3: 6.0, 7: -100.0, 11: 5.0, 40: 4.5}
  bias_V = np.zeros(vocab)
  bias_V[list(bias)] = list(bias.values())
  allowed = (5, 9, 200)
  greedy, scored, sampled = engine.generate(prompts[1:4], [
      SamplingParams(max_tokens=NEW, logit_bias=bias),
      SamplingParams(max_tokens=NEW, logit_bias=bias, logprobs=0),  # one step per dispatch
      SamplingParams(max_tokens=3 * NEW, temperature=1.0, seed=5,
                     logit_bias={t: 100.0 for t in allowed})])
  changed = 0
  for out in (greedy, scored):
    ref = _logprobs_reference(model, [*out.prompt_tokens, *out.tokens], len(out.prompt_tokens))
    assert list(out.tokens) == [int(np.argmax(row + bias_V)) for row in ref[:len(out.tokens)]]
    changed += sum(int(np.argmax(row)) != int(np.argmax(row + bias_V)) for row in ref)
  assert changed > 0  # the bias decided some tokens
  for lp, row in zip(scored.logprobs, ref):
    np.testing.assert_allclose(lp.logprob, row[lp.token], rtol=1e-4, atol=1e-4)
  assert set(sampled.tokens) <= set(allowed) and len(set(sampled.tokens)) > 1
  _no_leaks(engine)


def _penalized_reference(logits_V, context, num_prompt, repetition=1.0, frequency=0.0,
                         presence=0.0):
  """vLLM's penalties in NumPy: a token seen in the context has a positive logit divided by
  ``repetition`` and a negative one multiplied; an output token loses ``frequency`` per
  occurrence and ``presence`` once."""
  out = np.array(logits_V, np.float64)
  seen = sorted(set(context))
  out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
  tokens, counts = np.unique(np.asarray(context[num_prompt:], int), return_counts=True)
  out[tokens] -= frequency * counts + presence * (counts > 0)
  return out


@pytest.mark.parametrize("penalty", [
    dict(repetition_penalty=1.8), dict(frequency_penalty=1.5, presence_penalty=0.7),
    dict(repetition_penalty=0.6, presence_penalty=-1.0)])
def test_penalties_follow_vllms_rules(model, prompts, penalty):
  """Each token is the argmax of the reference logits with the penalties of its context
  (teacher-forced): greedy, with logprobs asked, on the sampling path (top_k 1) and again
  over prefix hits; penalized requests never run multi-step decode dispatches."""
  engine = _engine(model, num_pages=24)
  new = 12
  params = [SamplingParams(max_tokens=new, **penalty),
            SamplingParams(max_tokens=new, logprobs=0, **penalty),
            SamplingParams(max_tokens=new, temperature=1.0, top_k=1, seed=2, **penalty)]
  outs = engine.generate(prompts[1:4], params)
  assert engine.stats.decode_dispatches == 0
  again = engine.generate(prompts[1:2], params[:1])[0]
  assert again.num_cached_prompt_tokens > 0 and again.tokens == outs[0].tokens
  changed = 0
  for out in outs:
    prompt, tokens = list(out.prompt_tokens), list(out.tokens)
    ids = np.asarray(prompt + tokens[:-1])[None]
    logits = np.asarray(model(ids, model.init_cache(1, ids.shape[1]))[0][0], np.float64)
    for j, token in enumerate(tokens):
      row = logits[len(prompt) - 1 + j]
      expected = _penalized_reference(row, prompt + tokens[:j], len(prompt), *(
          penalty.get(k, d) for k, d in (("repetition_penalty", 1.0),
                                         ("frequency_penalty", 0.0),
                                         ("presence_penalty", 0.0))))
      assert token == int(np.argmax(expected)), (out.request_id, j)
      changed += int(np.argmax(row)) != token
  assert changed > 0  # the penalties decided some tokens
  _no_leaks(engine)


@pytest.mark.parametrize("prompt, params, error, match", [
    ([1] * 200, SamplingParams(max_tokens=8), ValueError, "exceeds the model's context of 128"),
    ([1] * 100, SamplingParams(max_tokens=8), ValueError, "pages of 8 tokens, the whole pool"),
    ([], SamplingParams(), ValueError, "prompt is empty"),
    ([1, 999], SamplingParams(), ValueError, "token id 999 is outside the vocabulary"),
    ("text", SamplingParams(), TypeError, "needs the engine's tokenizer"),
    ([1, 2], "greedy", TypeError, "params must be a SamplingParams"),
    ([1, 2], SamplingParams(stop=("x",)), ValueError, "stop strings need"),
])
def test_bad_requests_are_refused_and_leave_the_others_untouched(model, prompts, reference,
                                                                 prompt, params, error, match):
  engine = _engine(model, max_model_len=128)
  good = engine.add_request(prompts[0], SamplingParams(max_tokens=NEW))
  engine.step()
  with pytest.raises(error, match=match):
    engine.add_request(prompt, params)
  with pytest.raises(ValueError, match="already in use"):
    engine.add_request(prompts[0], request_id=good)
  assert _run_all(engine, [good])[good] == reference[0]
  _no_leaks(engine)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=-1), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(seed=-3), "seed"), (dict(stop=("",)), "stop"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(logit_bias={1: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={t: 1.0 for t in range(129)}), "logit_bias holds 129 tokens"),
    (dict(logit_bias=[(1, 1.0), (1, 2.0)]), "twice"), (dict(logit_bias=5), "logit_bias"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(presence_penalty="1"), "presence_penalty"),
])
def test_bad_sampling_settings_name_the_field(kwargs, match):
  with pytest.raises((TypeError, ValueError), match=match):
    SamplingParams(**kwargs)


def _expected_route(shape) -> str:
  """The route of a step program from its static shape alone (mla_jax.routing): dense only
  when every sequence of the step starts empty within the top-k, else sparse."""
  return "DENSE_MHA" if shape.fresh else "SPARSE_MQA"


def _dense_capable_routes_hold(engine) -> None:
  for c in engine.programs:
    expected = _expected_route(c.shape)
    assert c.plan.route.name == expected, c.shape
    assert c.summary.scopes & ROUTES == {"mla_" + expected.lower()}, c.shape
    assert ("indexer_score" in c.summary.scopes) == (expected != "DENSE_MHA")


def test_dense_capable_engine_routes_each_program_by_its_bucket():
  """A step whose sequences all start empty within the top-k goes dense (segmented over the
  step's rows); every other step (a decode, a cached prefix, a chunk past the top-k) sparse.
  Tokens equal ``generate``."""
  model = _model("dense-capable")
  rng = np.random.default_rng(2)
  topk = model.config.mla.indexer.topk
  engine = _engine(model, num_pages=32)
  steps = _recorded_steps(engine)
  # Three prompts whose first chunks share one fresh step within the top-k (the third cut),
  # then one alone whose first chunk is fresh and past the top-k.
  for lengths in ((topk - 4, topk, 3 * topk), (2 * topk + 8,)):
    prompts = [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in lengths]
    outputs = engine.generate(prompts, max_tokens=NEW)
    assert [list(o.tokens) for o in outputs] == _reference(model, prompts)
  _dense_capable_routes_hold(engine)
  assert {c.plan.route.name for c in engine.programs} == {"DENSE_MHA", "SPARSE_MQA"}
  assert steps[0] == dict(decodes=0, fresh=3, continuing=0)


def test_a_masked_window_gives_no_step_program_the_masked_route():
  """A flat step has no masked route, whatever the backend's masked window: every shape the
  engine can compile plans dense (all fresh within the top-k) or sparse."""
  engine = _engine(_model("dense-capable", XlaBackend(masked_mha_max_tokens=40)), num_pages=32)
  shapes = engine.buckets.all_shapes()
  routes = {s: engine.step_plan(s).route.name for s in shapes}
  assert set(routes.values()) == {"DENSE_MHA", "SPARSE_MQA"}
  assert all(r == _expected_route(s) for s, r in routes.items())


def test_dense_capable_steps_mixing_fresh_and_continuing_chunks_stay_sparse(monkeypatch):
  """A short fresh prompt beside a continuing chunk (and beside decodes): the step is mixed,
  so never dense; its tokens equal ``generate``. The bug this guards against is the seed
  bug's shape: a mixed step's metadata taken as fresh (``any`` chunk instead of ``every``)
  would attend the continuing chunk over its new tokens only."""
  model = _model("dense-capable")
  rng = np.random.default_rng(5)
  engine = _engine(model, num_pages=32, max_step_tokens=24)
  steps = _recorded_steps(engine)
  long, short = (rng.integers(0, model.config.vocab_size, size=n).tolist() for n in (40, 6))
  first = engine.add_request(long, SamplingParams(max_tokens=NEW))
  engine.step()  # the first 24 tokens of the long prompt
  second = engine.add_request(short, SamplingParams(max_tokens=NEW))
  got = _run_all(engine, [first, second])
  assert steps[1] == dict(decodes=0, fresh=1, continuing=1)
  assert [got[first], got[second]] == _reference(model, [long, short])
  _dense_capable_routes_hold(engine)


def test_shared_programs_keep_only_the_most_recently_used(model, prompts, reference, monkeypatch):
  from mla_jax.serving import runner as engine_module

  monkeypatch.setattr(engine_module, "_COMPILED", ProgramCache(max_size=1))
  engine = _engine(model)
  assert [list(o.tokens) for o in engine.generate(prompts[:1], max_tokens=NEW)] == \
      reference[:1]
  assert len(engine.programs) == 2  # its prefill step and decode dispatch, held while it lives
  assert len(engine_module._COMPILED) == 1  # the process-wide cache kept the newest
