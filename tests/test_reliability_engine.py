"""The engine's sampling and stopping rules at their boundaries, through the public API only
(``Engine``, ``SamplingParams``, ``generate``, ``step``, ``stream``, ``RequestOutput``, the page
counters): each output is compared with ``generate``, a float64 NumPy rule on the model's own
logits, or the same request run one step per dispatch. A bug that stalls a request raises
``EngineStalled`` naming it, rather than hanging the test."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.serving.engine import Engine
from mla_jax.serving.pages import pages_for
from mla_jax.serving.scheduler import StepBatch
from mla_jax.serving.sequence import SamplingParams
from mla_jax.serving.stalls import MAX_STEPS_WITHOUT_PROGRESS, EngineStalled
from tests.test_engine import SETTINGS, _model, _no_leaks, _penalized_reference, _reference

STEPS = 8  # decode steps a dispatch runs (the default)


@pytest.fixture(scope="module")
def model():
  return _model("mqa-only")


@pytest.fixture(scope="module")
def prompts(model):
  rng = np.random.default_rng(52)
  return [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in (6, 9, 17, 1)]


def _engine(model, **overrides):
  return Engine(model, **{**SETTINGS, "num_pages": 24, **overrides})


def _contiguous_logits(model, prompt, tokens):
  """float64 logits predicting each output token (one contiguous forward, teacher-forced)."""
  ids = np.asarray(prompt + tokens[:-1])[None]
  logits = model(ids, model.init_cache(1, ids.shape[1]))[0][0]
  return np.asarray(logits, np.float64)[len(prompt) - 1:]


# ---- stops ----------------------------------------------------------------------------------


def test_min_tokens_is_exact_wherever_it_falls_in_a_dispatch(model, prompts):
  """A stop id the bias makes the argmax comes exactly after ``min_tokens`` tokens: at the
  first token of a dispatch (1), inside one (5), at its last (8) and at the next one's first
  (9); the tokens before it are the argmax without it; single steps give the same."""
  stop, prompt = 7, prompts[0]
  mins = (1, 5, 8, 9)
  params = [SamplingParams(max_tokens=12, min_tokens=m, stop_token_ids=(stop,),
                           logit_bias={stop: 100.0}) for m in mins]
  runs = {}
  for steps in (1, STEPS):
    engine = _engine(model, decode_steps=steps)
    runs[steps] = [(list(o.tokens), o.finish_reason)
                   for o in engine.generate([prompt] * len(mins), params)]
    _no_leaks(engine)
  assert runs[STEPS] == runs[1]
  for m, (tokens, reason) in zip(mins, runs[STEPS]):
    assert len(tokens) == m + 1 and tokens[m] == stop and reason == "stop", (m, tokens)
    held = _contiguous_logits(model, prompt, tokens)[:m]
    held[:, stop] = -np.inf
    assert tokens[:m] == held.argmax(-1).tolist(), m


def _relabelled(model, a: int, b: int):
  """A copy of ``model`` in which token ids ``a`` and ``b`` trade places (their embedding and
  output rows): the same model up to its labels, so its tokens are the original's with the
  two ids swapped, and it shares the original's compiled programs."""
  copy = nnx.clone(model)
  rows = jnp.array([a, b])
  for param in (copy.lm_head.weight, copy.model.embed_tokens.weight):
    param[...] = param[...].at[rows].set(param[...][rows[::-1]])
  return copy


def test_token_id_0_drawn_inside_a_dispatch_is_a_token(model, prompts):
  """Id 0 (what a dispatch's unused rows hold for "no token") drawn inside multi-step
  dispatches, greedily and on the sampling path (min_p 1 leaves only the argmax), by plain
  requests: the model relabelled so that the token its greedy run draws third is id 0. The
  tokens equal generate's, and the requests finish."""
  new = 2 * STEPS + 1
  third = _reference(model, prompts[:1], new)[0][2]
  zero = _relabelled(model, 0, third)
  want = _reference(zero, prompts[:1], new)[0]
  assert want[2] == 0  # drawn by the first dispatch
  engine = _engine(zero)
  outs = engine.generate(prompts[:1] * 2, [
      SamplingParams(max_tokens=new),
      SamplingParams(max_tokens=new, temperature=1.0, min_p=1.0, seed=5)])
  assert engine.stats.decode_dispatches > 0
  assert [list(o.tokens) for o in outs] == [want, want]
  assert all(o.finish_reason == "length" for o in outs)
  _no_leaks(engine)


# ---- pages ----------------------------------------------------------------------------------


def test_every_row_a_dispatch_writes_has_its_page(model, prompts):
  """Prompts of 1, 9 and 17 tokens start their dispatches one row past a page boundary, so the
  last row of each dispatch is the first of a new page (pages of 8, dispatches of 8): after
  every step the pages in use hold every row computed, and the tokens equal generate's."""
  chosen = [prompts[3], prompts[1], prompts[2]]  # 1, 9 and 17 tokens
  new = 2 * STEPS + 1
  engine = _engine(model, prefix_caching=False)
  ids = [engine.add_request(p, SamplingParams(max_tokens=new)) for p in chosen]
  while engine.has_unfinished():
    engine.step()
    outs = [engine.output(i) for i in ids]
    # A running request has computed its prompt and every output token but the last.
    rows = [len(o.prompt_tokens) + len(o.tokens) - 1 for o in outs if o.tokens and not o.finished]
    assert engine.pages.num_in_use >= sum(pages_for(r, engine.page_size) for r in rows)
  assert engine.stats.decode_dispatches > 0
  assert [list(engine.release(i).tokens) for i in ids] == _reference(model, chosen, new)
  _no_leaks(engine)


# ---- penalties and bias ---------------------------------------------------------------------

PENALTY_FIELDS = (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                  ("presence_penalty", 0.0))


def _check_penalized(model, out, penalty: dict, bias_V) -> int:
  """Each token of ``out`` is the argmax of the float64 rule (bias first, then the penalties of
  its context); returns how many differ from the argmax without the penalties."""
  prompt, tokens = list(out.prompt_tokens), list(out.tokens)
  settings = [penalty.get(k, d) for k, d in PENALTY_FIELDS]
  changed = 0
  for j, row in enumerate(_contiguous_logits(model, prompt, tokens)):
    expected = _penalized_reference(row + bias_V, prompt + tokens[:j], len(prompt), *settings)
    assert tokens[j] == int(np.argmax(expected)), (penalty, j)
    changed += int(np.argmax(row + bias_V)) != tokens[j]
  return changed


@pytest.mark.parametrize("penalty", [dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
                                     dict(repetition_penalty=3.0)],
                         ids=["presence-only", "frequency-only", "repetition-only"])
def test_each_penalty_alone_follows_vllms_rule(model, prompts, penalty):
  """One penalty and nothing else asked, in an engine that runs multi-step dispatches (greedy,
  and the sampling path with top_k 1): each token is the float64 rule's argmax, and the
  penalty decided some."""
  engine = _engine(model)
  outs = engine.generate(prompts[1:3], [
      SamplingParams(max_tokens=12, **penalty),
      SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=2, **penalty)])
  zero = np.zeros(model.config.vocab_size)
  assert sum(_check_penalized(model, out, penalty, zero) for out in outs) > 0
  _no_leaks(engine)


def test_logit_bias_comes_before_the_penalties(model, prompts):
  """A prompt token biased so that the order decides its first token: (logit + bias) / 1.8
  loses to the best other token while logit / 1.8 + bias would win. Every token follows
  bias-then-penalty (float64), and the wrong order would have chosen otherwise."""
  prompt, repetition = prompts[2], 1.8
  row = _contiguous_logits(model, prompt, [0])[0]
  penalized = _penalized_reference(row, prompt, len(prompt), repetition)
  # The prompt token with the largest logit > 0 that is not the argmax, against the best.
  token = max((t for t in set(prompt) if row[t] > 0 and t != penalized.argmax()),
              key=lambda t: row[t])
  best = np.delete(penalized, token).max()
  bias = float(np.mean([best - row[token] / repetition, repetition * best - row[token]]))
  assert 0 < bias <= 100
  bias_V = np.zeros(model.config.vocab_size)
  bias_V[token] = bias
  wrong = penalized + bias_V
  right = _penalized_reference(row + bias_V, prompt, len(prompt), repetition)
  assert wrong.argmax() == token != right.argmax()
  engine = _engine(model)
  out = engine.generate([prompt], [SamplingParams(max_tokens=6, logit_bias={token: bias},
                                                  repetition_penalty=repetition)])[0]
  _check_penalized(model, out, dict(repetition_penalty=repetition), bias_V)
  assert out.tokens[0] != token


# ---- a stall is an error with a name --------------------------------------------------------


def test_steps_without_progress_raise_naming_the_request(model, prompts):
  """A scheduler that schedules nothing stands in for an engine bug that loses a request's
  token: generate and stream raise ``EngineStalled`` naming the request after a bounded number
  of steps, instead of stepping forever."""
  engine = _engine(model)
  engine.scheduler.schedule = StepBatch
  calls = []
  step = engine.step
  engine.step = lambda: calls.append(1) or step()
  with pytest.raises(EngineStalled, match=rf"{MAX_STEPS_WITHOUT_PROGRESS} steps without "
                                          r"progress.*'req-0' \(waiting, 0 of 6 tokens computed, "
                                          r"0 of max_tokens 3 generated\)"):
    engine.generate([prompts[0]], max_tokens=3)
  assert MAX_STEPS_WITHOUT_PROGRESS <= len(calls) <= MAX_STEPS_WITHOUT_PROGRESS + 1
  with pytest.raises(EngineStalled, match="'req-0'"):
    list(engine.stream())
