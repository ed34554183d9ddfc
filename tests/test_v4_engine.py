"""DeepSeek-V4 in the engine: greedy tokens equal ``mla_jax.generate``'s (which equal HF's,
tests/test_hf_parity_v4.py) under ragged prompts, chunked prefill, prefix hits that end inside
a window and inside a compression window (state restored from snapshots), preemption and
aborts, seeded sampling; no page leaks; every step program it compiled or would warm up keeps
the selection contract (the walk catches a mis-declared class) and holds no while or cond.
With fp8 caches, the tokens equal ``mla_jax.generate``'s fp8 ones."""

import functools

import numpy as np
import pytest
from flax import nnx

from mla_jax.fp8_cache import Fp8Keys
from mla_jax.generation import generate
from mla_jax.serving.engine import Engine
from mla_jax.serving.sequence import SamplingParams
from mla_jax.traces import summarize_jaxpr
from mla_jax.v4.config import tiny_v4_config
from mla_jax.v4.model import V4CausalLM
from mla_jax.v4.step_plan import selection_violations
from pallas_kernels.fp8_rows import Fp8LatentRows
from tests.test_engine_dispatch import DEVICE_PREDICATED
from tests.test_v4_model import build
from tests.test_v4_routes import MisdeclaredCSA

NEW = 5
# Every layer type (sliding, CSA m = 4, HCA m = 8, CSA), window 8, top-k 4; 256 positions:
# 64 CSA entries a sequence, so CSA scores.
SETTINGS = dict(max_num_seqs=4, max_model_len=256, decode_steps=4, log_interval=None)


@pytest.fixture(scope="module")
def model():
  return build(seed=11)


@functools.lru_cache(maxsize=None)
def _reference(model, prompts: tuple, new: int = NEW, cache_dtype="fp32") -> list[list[int]]:
  return generate(model, [list(p) for p in prompts], new, cache_dtype=cache_dtype).tokens


def _prompts(seed: int, lengths) -> tuple:
  rng = np.random.default_rng(seed)
  return tuple(tuple(rng.integers(0, 256, n).tolist()) for n in lengths)


def _walked(engine) -> None:
  """Every compiled program holds, layer by layer, what the classes declare, and no loop or
  branch on a device value (tests/test_engine_dispatch.py)."""
  assert engine.programs
  for c in engine.programs:
    assert selection_violations(engine.model.attentions, c.plan.capacity, c.summary) == [], (
        c.shape)
    assert not DEVICE_PREDICATED & set(c.summary.primitives), c.shape


def _no_leaks(engine) -> None:
  engine.pages.check()
  assert engine.pages.num_free == engine.num_pages
  assert all(engine.pages.refcount(p) == 0 for p in range(engine.num_pages))
  _walked(engine)


@pytest.mark.parametrize("page_size, budget, hits", [(4, 5, [12, 28, 40]), (16, 16, [0, 16, 32])])
def test_tokens_equal_generate_with_chunks_and_prefix_hits(model, page_size, budget, hits):
  """Ragged prompts (1 to 150 tokens) prefilled in chunks of at most ``budget`` tokens; then
  prompts sharing 13, 29 and 41 tokens with one of them take its pages and its state as of
  the last whole page: with pages of 4, hits of 12 and 28 end inside an HCA window (m = 8)
  and every hit inside the sliding window (8). Then a prompt one token past a hit: its last
  prompt token is a decode, so a multi-step dispatch reads the snapshot in its first step
  and its own slot after."""
  first = _prompts(0, (1, 9, 40, 150))
  engine = Engine(model, num_pages=256, page_size=page_size, max_step_tokens=budget,
                  num_snapshots=64, **SETTINGS)
  outputs = engine.generate([list(p) for p in first], max_tokens=NEW)
  assert [list(o.tokens) for o in outputs] == _reference(model, first)
  second = tuple(first[3][:n] + (7, 8) for n in (13, 29, 41))
  outputs = engine.generate([list(p) for p in second], max_tokens=NEW)
  assert [o.num_cached_prompt_tokens for o in outputs] == hits
  assert [list(o.tokens) for o in outputs] == _reference(model, second)
  third = (first[3][:hits[1] + 1],)  # one token past a hit
  outputs = engine.generate([list(p) for p in third], max_tokens=NEW)
  assert outputs[0].num_cached_prompt_tokens == hits[1]
  assert [list(o.tokens) for o in outputs] == _reference(model, third)
  assert engine.stats.decode_dispatches > 0
  _no_leaks(engine)


def test_one_token_chunks_equal_generate(model):
  """A step budget of one token: every prompt is prefilled one row a step, beside the other
  sequences' decodes (the rings and compressors' state carried from step to step)."""
  prompts = _prompts(9, (1, 9, 23))
  engine = Engine(model, num_pages=64, page_size=4, max_step_tokens=1, **SETTINGS)
  outputs = engine.generate([list(p) for p in prompts], max_tokens=NEW)
  assert [list(o.tokens) for o in outputs] == _reference(model, prompts)
  _no_leaks(engine)


def test_seeded_sampling_draws_generates_tokens(model):
  """At temperature 1, an engine request of seed s + b draws what ``generate(seed=s)`` draws
  for its row b, as for V3.2 (tests/test_engine.py)."""
  prompts = [list(p) for p in _prompts(5, (3, 30, 70))]
  want = generate(model, prompts, NEW, temperature=1.0, seed=11).tokens
  params = [SamplingParams(max_tokens=NEW, temperature=1.0, seed=11 + b) for b in range(3)]
  engine = Engine(model, num_pages=64, page_size=8, max_step_tokens=16, **SETTINGS)
  assert [list(o.tokens) for o in engine.generate(prompts, params)] == want
  assert want != _reference(model, tuple(map(tuple, prompts)))


def test_preemption_aborts_and_few_snapshots(model):
  """A 16-page pool of 8-token pages: decodes that need a page preempt the newest sequence,
  which recomputes (from a prefix hit where its snapshot survived: one snapshot slot, most
  recently used); a running and a waiting request are aborted. The others' greedy tokens
  are generate's; a seeded request at temperature 1 draws what it draws alone; no page is
  left in use."""
  prompts = _prompts(3, (40, 33, 47, 20, 35))
  engine = Engine(model, num_pages=16, page_size=8, max_step_tokens=16, num_snapshots=1,
                  **SETTINGS)
  seeded = SamplingParams(max_tokens=3 * NEW, temperature=1.0, seed=3)
  params = [seeded if i == 3 else SamplingParams(max_tokens=3 * NEW) for i in range(5)]
  ids = [engine.add_request(list(p), q) for p, q in zip(prompts, params)]
  engine.step()
  engine.step()
  aborted = {engine.scheduler.running[0].request_id, engine.scheduler.waiting[-1].request_id}
  for request_id in aborted:
    engine.abort(request_id)
  while engine.has_unfinished():
    engine.step()
  want = _reference(model, prompts, 3 * NEW)
  for i, request_id in enumerate(ids):
    output = engine.release(request_id)
    if request_id in aborted:
      assert output.finish_reason == "abort"
    elif i == 3:
      drawn = output.tokens
    else:
      assert list(output.tokens) == want[i], request_id
  alone = engine.generate([list(prompts[3])], [seeded])[0].tokens
  assert list(alone) == list(drawn) != want[3]
  assert engine.scheduler.num_preemptions > 0
  assert len(engine.scheduler.snapshots) == 1
  _no_leaks(engine)


def test_fp8_caches_give_generates_fp8_tokens(model):
  """cache_dtype fp8: the pools hold compressed entries and indexer keys in V3.2's fp8
  layouts and the rings in the model's dtype. Ragged prompts prefilled in chunks of 16 in a
  16-page pool (a sequence is preempted and recomputed), decoded 4 steps a dispatch, then
  prompts that hit the preempted one's pages: greedy tokens equal generate's with fp8 caches
  (measured: 2 of the first 5 differ from its float32 ones, so float pools fail here); no
  page is left in use."""
  first = _prompts(3, (40, 33, 47, 20, 35))
  second = (first[4][:33] + (7, 8), first[4][:17] + (9,))
  engine = Engine(model, num_pages=16, page_size=8, max_step_tokens=16, num_snapshots=64,
                  cache_dtype="fp8", **SETTINGS)
  csa = engine.runner.pools[0][1]  # sliding, CSA, HCA, CSA
  assert isinstance(csa.entries, Fp8LatentRows) and isinstance(csa.index_keys, Fp8Keys)
  assert csa.window.dtype == csa.pool_kv.dtype == model.dtype
  want = _reference(model, first + second, 3 * NEW, "fp8")  # one generate for both rounds
  outputs = engine.generate([list(p) for p in first], max_tokens=3 * NEW)
  assert [o.num_preemptions for o in outputs] == [0, 0, 0, 0, 1]
  assert [list(o.tokens) for o in outputs] == want[:5]
  outputs = engine.generate([list(p) for p in second], max_tokens=3 * NEW)
  assert [o.num_cached_prompt_tokens for o in outputs] == [32, 8]
  assert [list(o.tokens) for o in outputs] == want[5:]
  assert engine.stats.decode_dispatches > 0
  _no_leaks(engine)


def test_the_program_walk_catches_a_misdeclared_class(model):
  """Positive control: the walk each engine test runs refuses the programs of a model whose
  CSA layers declare that they score but select every entry unscored."""
  bad = build(seed=11)
  for layer in bad.model.layers:
    if layer.self_attn.layer_type == "compressed_sparse_attention":
      layer.self_attn.__class__ = MisdeclaredCSA
  engine = Engine(bad, num_pages=64, page_size=8, max_step_tokens=16, **SETTINGS)
  prompt = list(_prompts(5, (120,))[0])
  tokens = engine.generate([prompt], max_tokens=NEW)[0].tokens
  with pytest.raises(AssertionError, match="does not score, its class declares SCORED"):
    _walked(engine)
  assert list(tokens) != _reference(model, (tuple(prompt),))[0]


def test_drafting_is_refused_before_anything_is_allocated():
  """The engine's drafts would write rejected rows into V4's rings (no rollback in pages yet):
  refused by name, on an abstract model (nothing allocated)."""
  config = tiny_v4_config(num_mtp_layers=1)
  abstract = nnx.eval_shape(lambda: V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla"))
  with pytest.raises(ValueError, match="per-sequence state"):
    Engine(abstract, num_pages=64, page_size=8, max_speculative_tokens=1, **SETTINGS)


def test_every_warmup_program_keeps_the_selection_contract():
  """Every program an engine warms up (one step, FULL with scores, multi-step; traced, not
  compiled, on an abstract model) holds what each layer class declares and no loop or
  branch on a device value."""
  abstract = nnx.eval_shape(lambda: V4CausalLM(tiny_v4_config(), rngs=nnx.Rngs(0),
                                               backend="xla"))
  engine = Engine(abstract, num_pages=64, page_size=8, prompt_logprobs=True,
                  **{**SETTINGS, "max_num_seqs": 2, "decode_steps": 8})
  shapes = engine.buckets.all_shapes()
  assert {s.decode_steps for s in shapes} == {1, 8} and any(s.scores for s in shapes)
  for shape in shapes:
    plan, traced = engine.trace_step(shape)
    summary = summarize_jaxpr(traced.jaxpr)
    assert selection_violations(abstract.attentions, plan.capacity, summary) == [], shape
    assert not DEVICE_PREDICATED & set(summary.primitives), shape
