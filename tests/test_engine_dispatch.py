"""The engine's dispatches: multi-step decode stops where single steps stop, the warm-up
compiles every program a run needs (and few), and the route walk catches a misrouted class."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from mla_jax.misrouted import MisroutedV32Attention
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from mla_jax.serving.engine import Engine, engine_pools
from mla_jax.serving.sequence import SamplingParams
from mla_jax.serving.step_inputs import Sampler, StepShape
from mla_jax.tokenizer import ByteTokenizer
from mla_jax.traces import summarize_jaxpr
from tests.test_engine import _model, _mqa_only_contract, _no_leaks, _reference


NEW = 12
SETTINGS = dict(page_size=8, num_pages=24, max_num_seqs=4, max_step_tokens=32,
                log_interval=None)


class Letters:
  """A tokenizer whose every token is one letter, so a stop string can end on any token."""

  def encode(self, text):
    return [ord(c) - 65 for c in text]

  def decode(self, ids):
    return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model():
  return _model("mqa-only")


@pytest.fixture(scope="module")
def prompts(model):
  rng = np.random.default_rng(7)
  return [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in (9, 21, 4)]


def _first_stop(tokens, stop: str) -> int:
  """How many tokens a request keeps when ``stop`` ends it (the token completing it kept)."""
  text = Letters().decode
  return next(j + 1 for j in range(len(tokens)) if stop in text(tokens[:j + 1]))


def test_stops_inside_a_dispatch_match_single_steps(model, prompts):
  """A stop id, a stop string, an eos id and max_tokens that fall inside an 8-step dispatch
  give the tokens and finish reasons of single steps, for requests of one dispatch; and the
  device computes nothing past a stop id, an eos id or the last allowed token (a stop string
  is matched after the dispatch: the tokens past it are dropped)."""
  reference = _reference(model, prompts, NEW)
  stop_string = Letters().decode(reference[1][4:6])
  eos = reference[2][5]
  params = [SamplingParams(max_tokens=NEW, stop_token_ids=(reference[0][3],)),
            SamplingParams(max_tokens=NEW, stop=(stop_string,)),
            SamplingParams(max_tokens=NEW),
            SamplingParams(max_tokens=5)]
  runs, computed = {}, {}
  for steps in (1, 8):
    engine = Engine(model, tokenizer=Letters(), decode_steps=steps, **SETTINGS)
    outputs = engine.generate([prompts[0], prompts[1], prompts[2], prompts[0]], params)
    assert (engine.stats.decode_dispatches > 0) == (steps > 1)
    _no_leaks(engine)
    device_stops = Engine(model, eos_token_ids=(eos,), decode_steps=steps, **SETTINGS)
    ended = device_stops.generate([prompts[2], prompts[0], prompts[0]], [
        SamplingParams(max_tokens=NEW), SamplingParams(max_tokens=5),
        SamplingParams(max_tokens=NEW, stop_token_ids=(reference[0][3],))])
    runs[steps] = [(list(o.tokens), o.finish_reason, o.text) for o in outputs + ended]
    computed[steps] = device_stops.stats.computed_tokens
    # Steps run ahead of their outputs: a request that stops may waste its row of the step
    # after (a stop id, an eos id; never max_tokens, which the host foresees).
    assert device_stops.stats.wasted_tokens <= 2 * steps
  assert runs[8] == runs[1]
  assert computed[8] == computed[1]
  tokens = [t for t, _, _ in runs[8]]
  assert tokens[0] == tokens[6] == reference[0][:reference[0].index(reference[0][3]) + 1]
  assert tokens[1] == reference[1][:_first_stop(reference[1], stop_string)]
  assert tokens[2] == reference[2]
  assert tokens[3] == tokens[5] == reference[0][:5]
  assert tokens[4] == reference[2][:reference[2].index(eos) + 1]
  assert [r for _, r, _ in runs[8]] == ["stop", "stop", "length", "length", "stop", "length",
                                        "stop"]
  assert runs[8][1][2] == Letters().decode(tokens[1])  # the output's text, grown incrementally


def test_warmup_compiles_every_program_and_serving_compiles_none(model, prompts):
  engine = Engine(model, **{**SETTINGS, "max_step_tokens": 16, "max_num_seqs": 2})
  count, _ = engine.warmup()
  shapes = engine.buckets.all_shapes()
  assert count == len(shapes) and {c.shape for c in engine.programs} == set(shapes)
  compiled = engine.stats.compile_s
  outputs = engine.generate(prompts, max_tokens=NEW)
  assert [list(o.tokens) for o in outputs] == _reference(model, prompts, NEW)
  # No step waited for a compile: smaller key-block buckets compiled in the background (or
  # came from the process-wide cache).
  engine.runner.wait_for_compiles()
  assert engine.stats.compile_s == compiled
  assert {engine.buckets.covering(c.shape) for c in engine.programs} == set(shapes)
  assert [list(o.tokens) for o in engine.generate(prompts, max_tokens=NEW)] == _reference(
      model, prompts, NEW)  # and on their own programs


def test_default_settings_need_few_programs():
  """``mla-jax serve``'s defaults (512 tokens a step, 32 seats, 8 decode steps) on the tiny
  model, counted without compiling any: steps of 8..512 token rows (7), their greedy variants
  up to the seats' 32 rows (3) and their ``FULL`` variants at every other size (4), decode
  dispatches of 1..32 rows, greedy or sampled (12): 26 programs to warm up. A dense-capable
  model adds its fresh steps' (7 more)."""
  def shapes(attention):
    model = nnx.eval_shape(lambda: CausalLM(tiny_lm(attention), rngs=nnx.Rngs(0),
                                            backend="xla"))
    return Engine(model, num_pages=512).buckets.all_shapes()

  default = shapes("mqa-only")
  assert len(default) == len(set(default)) == 26
  assert not any(s.fresh for s in default)
  dense = shapes("dense-capable")
  assert set(dense) - set(default) == {s for s in dense if s.fresh} and len(dense) == 33


def test_a_warmup_at_every_reach_holds_every_step_shape(monkeypatch):
  """Every shape a step can take (random chunks: decodes, prompt chunks at any offset, multi-
  step dispatches) is one of ``all_shapes(every_reach=True)``, and ``Engine.warmup`` compiles
  those with ``every_reach`` (counted without compiling): nothing is left to compile while
  serving. Without it only the covering shapes are warmed."""
  from mla_jax.serving.sequence import Sequence
  from mla_jax.serving.scheduler import Chunk

  model = nnx.eval_shape(lambda: CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0),
                                          backend="xla"))
  engine = Engine(model, num_pages=64, page_size=16, max_num_seqs=8, max_step_tokens=64,
                  decode_steps=4, log_interval=None)
  buckets, rng = engine.buckets, np.random.default_rng(3)
  every, covering = set(buckets.all_shapes(every_reach=True)), set(buckets.all_shapes())
  assert covering < every
  reaches = set()
  for _ in range(300):
    chunks = []
    for _ in range(rng.integers(1, 9)):
      cached = int(rng.integers(0, engine.max_model_len - 64))
      rows = 1 if rng.random() < 0.6 else int(rng.integers(1, 64 // 8))
      temperature = float(rng.choice([0.0, 1.0]))
      seq = Sequence("r", [1] * (cached + rows), cached + rows,
                     SamplingParams(temperature=temperature), 0, num_cached=cached)
      chunks.append(Chunk.of(seq, rows))
    multi = all(c.num_tokens == 1 for c in chunks) and rng.random() < 0.5
    shape = buckets.shape(chunks, engine.decode_steps if multi else 1)
    assert shape in every, shape
    reaches.add(shape.key_blocks // shape.tokens)
  assert len(reaches) >= 4  # the draws reach several key-block buckets

  warmed = []
  monkeypatch.setattr(engine.runner, "program_shape", warmed.append)
  assert engine.warmup(every_reach=True)[0] == len(every) and set(warmed) == every
  warmed.clear()
  assert engine.warmup()[0] == len(covering) and set(warmed) == covering


def test_the_route_walk_catches_a_misrouted_class(monkeypatch, prompts):
  """Positive control: engine buckets that take every fresh step for a dense one, over the
  deliberately misrouted MQA-only layer (it skips scoring where the plan says the step is
  fresh), give programs without indexer scoring, and the walk that every engine test runs
  refuses them; the tokens are wrong too."""
  monkeypatch.setattr(Engine, "_dense_bound", lambda self: self.model.config.mla.indexer.topk)
  honest = _model("mqa-only")
  bad = CausalLM(tiny_lm("mqa-only"), rngs=nnx.Rngs(0), backend="xla",
                 attention_class=MisroutedV32Attention)
  nnx.update(bad, nnx.state(honest, nnx.Param))
  short = [p[:6] for p in prompts]
  engine = Engine(bad, **SETTINGS)
  outputs = engine.generate(short, max_tokens=4)
  assert any(c.shape.fresh for c in engine.programs)
  with pytest.raises(AssertionError):
    _mqa_only_contract(engine.programs)
  assert [list(o.tokens) for o in outputs] != _reference(honest, short, 4)


@pytest.mark.parametrize("shape, cache_dtype", [
    (StepShape(1, 1, 4, 4, decode_steps=8, sampler=Sampler.GREEDY), "fp32"),
    (StepShape(8, 8, 4, 8), "fp32"),
    (StepShape(1, 1, 4, 4, decode_steps=8, sampler=Sampler.GREEDY), "fp8")],
    ids=["decode-dispatch", "flat-step", "decode-dispatch-fp8"])
def test_step_programs_update_the_pools_in_place(model, monkeypatch, shape, cache_dtype):
  """The compiled program copies no pool: a copy of one costs in proportion to the pool, not
  the step (a reshape between the key write and the chunked indexer's read of it made XLA copy
  each key pool 8 times per decode step, seen with one row, whose scatter XLA makes an update
  slice; a multi-step dispatch's scan carries the pools)."""
  texts = []
  compile_ = jax.stages.Lowered.compile
  monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: texts.append(
      compile_(self, *a, **k)) or texts[-1])
  num_pages = 40  # pools of their own: no program compiled by another test is reused
  engine = Engine(model, **{**SETTINGS, "num_pages": num_pages, "cache_dtype": cache_dtype})
  engine.runner.program_shape(shape)
  pools = jax.eval_shape(lambda: engine_pools(model, num_pages * SETTINGS["page_size"],
                                              engine.cache_dtype, mtp=False))
  pool_shapes = {f"[{','.join(map(str, a.shape))}]" for a in jax.tree.leaves(pools)}
  (text,) = [compiled.as_text() for compiled in texts]
  copies = re.findall(r"= \w+(\[[\d,]+\])\S* copy\(", text)
  assert not pool_shapes & set(copies), copies


# ---- no host round trips ----------------------------------------------------------------

# A loop or branch whose predicate lives on the device: XLA:GPU copies the predicate to the
# host and blocks on it (every iteration of a ``while``), and splits its CUDA graphs there.
DEVICE_PREDICATED = frozenset({"while", "cond"})


def device_predicated(engine) -> dict:
  """Every warm-up program's device-predicated loops and branches outside kernels (traced,
  not compiled): ``{shape: {primitive: count}}`` of those that hold any."""
  found = {}
  for shape in engine.buckets.all_shapes():
    _, traced = engine.trace_step(shape)
    primitives = summarize_jaxpr(traced.jaxpr).primitives
    held = {p: n for p, n in primitives.items() if p in DEVICE_PREDICATED}
    if held:
      found[shape] = held
  return found


@pytest.mark.parametrize("attention, extra", [
    ("mqa-only", {}), ("dense-capable", {}), ("mqa-only", {"prompt_logprobs": True}),
    ("mqa-only", {"cache_dtype": "fp8", "decode_steps": 1}),
    ("mqa-only", {"structured_outputs": True, "tokenizer": ByteTokenizer()})])
def test_no_step_program_waits_on_the_device(attention, extra):
  """Every program an engine warms up (one step, FULL, scoring, masked, multi-step
  dispatches, fresh steps, fp8 pools) holds no ``while`` or ``cond`` outside kernels: multi-step decode is a
  fixed-length scan, the indexer scores each row's own key blocks in one call, penalties are
  a compile-time variant. (A ``cond`` back in the penalties, or the key-chunk loop on a traced
  bound, fails this.)"""
  model = nnx.eval_shape(lambda: CausalLM(tiny_lm(attention), rngs=nnx.Rngs(0), backend="xla"))
  engine = Engine(model, **{**SETTINGS, "max_step_tokens": 16, "max_num_seqs": 2, **extra})
  assert device_predicated(engine) == {}


def test_the_next_step_is_dispatched_before_the_last_one_is_read(model, prompts):
  """A recording stand-in around the runner: step N + 1 goes to the device before any output
  of step N is read on the host (multi-step dispatches and single steps alike), and the
  tokens are ``generate``'s."""
  events = []
  for steps in (1, 8):
    engine = Engine(model, decode_steps=steps, **SETTINGS)
    dispatch = engine.runner.dispatch

    def recorded(shape, inputs, dispatch=dispatch):
      flight = dispatch(shape, inputs)
      n = sum(kind == "dispatch" for kind, _ in events)
      events.append(("dispatch", n))
      read = flight.read
      flight.read = lambda: events.append(("read", n)) or read()
      return flight

    engine.runner.dispatch = recorded
    events.clear()
    outputs = engine.generate(prompts, max_tokens=NEW)
    assert [list(o.tokens) for o in outputs] == _reference(model, prompts, NEW)
    order = {event: i for i, event in enumerate(events)}
    dispatches = sum(kind == "dispatch" for kind, _ in events)
    assert dispatches > 3 and len(events) == 2 * dispatches
    for n in range(dispatches - 1):
      assert order["dispatch", n + 1] < order["read", n], (steps, events)


def test_a_one_token_budget_prefills_without_multi_step_dispatches(model, prompts):
  """With a step budget of one token a prompt is prefilled a token a step: those one-token
  chunks are no decodes and never run as a multi-step dispatch (which would sample after a
  prompt token that is not the last, and compute no row)."""
  engine = Engine(model, **{**SETTINGS, "max_step_tokens": 1})
  outputs = engine.generate(prompts[:2], max_tokens=4)
  assert [list(o.tokens) for o in outputs] == _reference(model, prompts[:2], 4)
  assert engine.stats.decode_dispatches > 0  # the decodes, once every prompt is computed
