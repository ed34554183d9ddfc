"""The engine on a mesh and over two processes gives the tokens of ``generate`` unsharded."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from mla_jax import sharding
from mla_jax.generation.loop import generate
from mla_jax.models.config import tiny_moe_lm
from mla_jax.models.lm import CausalLM
from mla_jax.serving import Engine, SamplingParams
from tests.helpers import two_process_engine

PROMPTS = [np.random.default_rng(1).integers(0, 256, n).tolist() for n in (5, 30, 12)]
SETTINGS = dict(num_pages=16, page_size=8, max_num_seqs=4, max_step_tokens=16,
                log_interval=None)


def _reference(prompts=PROMPTS):
  return generate(CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla"), prompts, 5).tokens


@pytest.mark.slow  # over 30 s on 2 cores
def test_engine_on_a_mesh_equals_generate_unsharded():
  mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
  model = CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
  engine = Engine(model, **SETTINGS)
  assert [list(o.tokens) for o in engine.generate(PROMPTS, max_tokens=5)] == _reference()
  assert all(c.shape.tokens % 2 == 0 for c in engine.programs)  # token rows split over 'data'
  engine.pages.check()


@pytest.mark.slow  # over 30 s on 2 cores
def test_speculative_engine_on_a_mesh_equals_generate_unsharded():
  """Per-request drafts (k = 0, 1, 2) from an MTP layer whose paged caches live on the mesh."""
  config = dataclasses.replace(tiny_moe_lm(), num_mtp_layers=1)
  mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
  model = CausalLM(config, rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
  engine = Engine(model, **SETTINGS, max_speculative_tokens=2)
  params = [SamplingParams(max_tokens=5, speculative_tokens=k) for k in (0, 1, 2)]
  expected = generate(CausalLM(config, rngs=nnx.Rngs(0), backend="xla"), PROMPTS, 5).tokens
  assert [list(o.tokens) for o in engine.generate(PROMPTS, params)] == expected
  assert engine.stats.draft_tokens > 0
  engine.pages.check()


@pytest.mark.slow  # over 30 s on 2 cores
def test_two_process_engine_equals_one_process(tmp_path):
  """Process 0 schedules and broadcasts each step's inputs; process 1 follows (gloo)."""
  got, prompts = two_process_engine(tmp_path, "data=1,tensor=2,expert=2")
  assert int(got["devices"]) == 4
  assert got["tokens"].tolist() == _reference(prompts)
