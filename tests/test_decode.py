"""Long-context decode: donated caches, several steps per dispatch, live-context buckets."""

import re
from typing import ClassVar

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import generation
from mla_jax.generation import programs
from mla_jax.decoding.steps import Progress
from mla_jax.backends import XlaBackend
from mla_jax.cache import MIN_BUCKET, bucket_rows
from mla_jax.models.config import tiny_lm
from mla_jax.models.lm import CausalLM
from tests.helpers import lm

EOS = 7


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, n).tolist() for n in lengths]


@pytest.mark.parametrize("cache_dtype", ["fp32", "fp8"])
def test_decode_program_updates_every_cache_in_place(cache_dtype):
  """The compiled decode program aliases every cache buffer (and the tokens) to an output;
  in an fp8 cache that is every e4m3 value, scale and RoPE buffer."""
  model = lm(tiny_lm(), seed=3)
  graphdef, state = nnx.split(model)
  caches = model.init_cache(2, 512, cache_dtype)
  assert len(jax.tree.leaves(caches)) == {"fp32": 3, "fp8": 6}[cache_dtype] * 2  # 2 groups
  tokens, progress = jnp.zeros((2,), jnp.int32), Progress.start(jnp.ones((2,), bool), 1)
  step = jnp.int32(1)
  compiled = programs.trace(graphdef, state, caches, tokens, progress, jnp.uint32(0), step, step,
                            settings=programs.DecodeSettings(
                                model.step_plan(1, None, capacity=512, kv_rows=256),
                                eos_id=(EOS,), steps=4)).lower().compile()
  header = compiled.as_text().split("\n", 1)[0]
  aliased = {int(p) for p in re.findall(r"\(\s*(\d+), \{\}, (?:may|must)-alias\)", header)}
  num_state = len(jax.tree.leaves(state))
  cache_params = set(range(num_state, num_state + len(jax.tree.leaves(caches)) + 1))
  assert cache_params <= aliased, (sorted(cache_params), sorted(aliased))
  donated = sum(x.nbytes for x in jax.tree.leaves((caches, tokens)))
  assert compiled.memory_analysis().alias_size_in_bytes == donated


def test_prefill_program_updates_every_cache_in_place():
  model = lm(tiny_lm(), seed=3)
  graphdef, state = nnx.split(model)
  caches = model.init_cache(2, 64)
  compiled = programs.trace(graphdef, state, caches, jnp.zeros((2, 8), jnp.int32),
                            jnp.full((2,), 8, jnp.int32), jnp.uint32(0),
                            settings=programs.PrefillSettings(
                                model.step_plan(8, 0, capacity=64))).lower().compile()
  assert compiled.memory_analysis().alias_size_in_bytes == sum(
      x.nbytes for x in jax.tree.leaves(caches))


@pytest.mark.parametrize("steps", [3, 8])
def test_steps_per_dispatch_do_not_change_tokens_or_logits(steps):
  """Ragged prompts; EOS arrives mid-dispatch for some sequences and the others go on."""
  prompts = _prompts([5, 12, 1, 9])
  kwargs = dict(eos_id=EOS, temperature=0.8, top_p=0.9, seed=22, return_logits=True)
  one = generation.generate(lm(tiny_lm(), seed=3), prompts, 20, steps_per_dispatch=1, **kwargs)
  many = generation.generate(lm(tiny_lm(), seed=3), prompts, 20, steps_per_dispatch=steps,
                             **kwargs)
  assert many.tokens == one.tokens
  stopped = [t for t in one.tokens if t[-1] == EOS and len(t) < 20]
  assert stopped and any(len(t) == 20 for t in one.tokens)  # EOS for some, not all
  np.testing.assert_array_equal(many.step_logits, one.step_logits)


class _RowSpy(XlaBackend):
  """Records how many cache rows each traced attention call reads."""

  name: ClassVar[str] = "xla_row_spy"
  rows: ClassVar[list] = []

  def _sparse_mqa(self, q_THL, kv_SL, topk_TK, *, sm_scale, d_v):
    self.rows.append(("attention", kv_SL.shape[0]))
    return super()._sparse_mqa(q_THL, kv_SL, topk_TK, sm_scale=sm_scale, d_v=d_v)

  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=None,
                      key_rows_S=None):
    self.rows.append(("indexer", (k_SI if key_rows_S is None else key_rows_S).shape[0]))
    return super()._indexer_logits(q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S, key_rows_S)


def test_buckets_follow_the_live_context_and_keep_the_tokens():
  """A sequence crosses the 256-row bucket mid-generation in a 2048-row cache: two decode
  programs, rows past the bucket are never read, tokens equal a teacher-forced forward."""
  model = CausalLM(tiny_lm(), rngs=nnx.Rngs(0), backend=_RowSpy())
  nnx.update(model, nnx.state(lm(tiny_lm(), seed=3), nnx.Param))
  prompt = _prompts([250])[0]
  traced = generation.trace_counts["decode"]
  _RowSpy.rows.clear()
  result = generation.generate(model, [prompt], 16, cache_capacity=2048, steps_per_dispatch=4)
  assert result.decode_buckets == (256, 512)
  assert generation.trace_counts["decode"] - traced == 2  # one trace per bucket
  read = {rows for _, rows in _RowSpy.rows}
  assert read == {256, 512}, read  # the prefill reads bucket(250) = 256 rows, never 2048
  ids = jnp.asarray([prompt + result.tokens[0]], jnp.int32)
  logits, _ = model(ids, model.init_cache(1, ids.shape[1]), num_cached_tokens=0)
  teacher = np.asarray(jnp.argmax(logits[0, len(prompt) - 1:-1], -1)).tolist()
  assert teacher == result.tokens[0]


def test_bucket_rows():
  assert [bucket_rows(n, 4096) for n in (1, 256, 257, 1000, 4096)] == [256, 256, 512, 1024,
                                                                       4096]
  assert bucket_rows(300, 300) == 300 and bucket_rows(5, 100) == 100 and MIN_BUCKET == 256
  with pytest.raises(ValueError, match="capacity is 100"):
    bucket_rows(101, 100)


@pytest.mark.parametrize("value", [0, -1, 2.0, True, None])
def test_bad_steps_per_dispatch(value):
  with pytest.raises(ValueError, match="steps_per_dispatch must be a positive int"):
    generation.generate(lm(tiny_lm(), seed=3), [[1, 2]], 4, steps_per_dispatch=value)


def test_kv_rows_must_cover_the_step():
  model = lm(tiny_lm(), seed=3)
  with pytest.raises(ValueError, match="kv_rows=8 is fewer than the 0 cached \\+ 12 new rows"):
    model(jnp.ones((1, 12), jnp.int32), model.init_cache(1, 16), num_cached_tokens=0, kv_rows=8)
  with pytest.raises(ValueError, match="kv_rows must be an int in \\[1, capacity=16\\]"):
    model(jnp.ones((1, 4), jnp.int32), model.init_cache(1, 16), kv_rows=32)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_finished_sequence_keeps_its_cache(monkeypatch, steps):
  """After its EOS a sequence's cache length and rows stay as they were while the others go
  on decoding (a finished sequence that kept appending would overflow a long batch's cache,
  or write into pages an engine has handed on). Every decode dispatch's caches are copied to
  the host as they come out."""
  seen = []
  get = programs.ProgramCache.get

  def spying_get(self, *args, settings):
    program, seconds = get(self, *args, settings=settings)
    if not isinstance(settings, programs.DecodeSettings):
      return program, seconds

    def spied(*call_args):
      out = program(*call_args)
      seen.append(jax.tree.map(np.asarray, out[1][2]))  # [reps, B, ...] per leaf
      return out

    return spied, seconds

  monkeypatch.setattr(programs.ProgramCache, "get", spying_get)
  prompts = _prompts([5, 12, 1, 9])
  result = generation.generate(lm(tiny_lm(), seed=3), prompts, 20, steps_per_dispatch=steps,
                               eos_id=EOS, temperature=0.8, top_p=0.9, seed=22)
  finished = [b for b, t in enumerate(result.tokens) if t[-1] == EOS and len(t) < 20]
  going_on = [b for b, t in enumerate(result.tokens) if len(t) == 20]
  assert finished and going_on
  for b in finished:
    num_tokens = len(result.tokens[b])
    # Token i >= 1 is sampled in dispatch (i - 1) // steps; the EOS (the last) is never written.
    last_write = max(num_tokens - 2, 0) // steps
    rows_b = lambda caches: jax.tree.map(lambda x: x[:, b], caches)
    for caches in seen[last_write:]:
      assert (caches.num_cached_B[b] == len(prompts[b]) + num_tokens - 1), b
      chex.assert_trees_all_equal(rows_b(caches), rows_b(seen[last_write]))
    assert all(seen[-1].num_cached_B[o] > seen[last_write].num_cached_B[o] for o in going_on)
