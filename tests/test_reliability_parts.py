"""Rules that were only tested at typical values, at their boundaries: DeepSeek-V4's clipped
SwiGLU at its limit on both sides, ``backend="auto"``'s preference where both GPU backends are
available, and the reasoning split of a prompt without any ``<think>`` tag."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import backends
from mla_jax.backends import gpu_support
from mla_jax.models.mlp import swiglu
from mla_jax.serving.reasoning import output_parser, prompt_opens_think
from mla_jax.v4.config import HASH_MOE, tiny_v4_config
from mla_jax.v4.moe import V4MoE
from tests import v4_reference
from tests.test_v4_model import randomize

LIMIT = 10.0


def _swiglu64(gate, up, limit):
  gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
  return gate / (1 + np.exp(-gate)) * up


def test_clipped_swiglu_at_and_past_its_limit_on_both_sides():
  """Gate clipped above only (silu of a very negative gate is ~0 anyway, and DeepSeek's code
  leaves it), up clipped to [-limit, limit]: every pair of values below, at and past -limit
  and +limit, against float64."""
  values = np.array([-3 * LIMIT, -LIMIT - 0.5, -LIMIT, -LIMIT + 0.5, -1.0, 0.0, 1.0,
                     LIMIT - 0.5, LIMIT, LIMIT + 0.5, 3 * LIMIT])
  gate, up = (a.ravel() for a in np.meshgrid(values, values))
  got = swiglu(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32), LIMIT)
  np.testing.assert_allclose(np.asarray(got), _swiglu64(gate, up, LIMIT), rtol=1e-6, atol=1e-6)


def test_v4_moe_clips_its_experts_projections_on_both_sides():
  """V4's MoE (routed experts and the shared one) on inputs large enough that the projections
  pass the limit on both sides, against the float64 reference."""
  config = tiny_v4_config(swiglu_limit=LIMIT)
  moe = randomize(V4MoE(config, hashed=config.mlp_layer_types[1] == HASH_MOE,
                        rngs=nnx.Rngs(0)), 3)
  x = np.random.default_rng(4).standard_normal((12, config.hidden_size)) * 8
  ids = np.arange(12) * 5
  params = {f"m.{k}": v for k, v in v4_reference.params_of(moe).items()}
  up = x @ params["m.shared_experts.up_proj.weight"].T
  gate = x @ params["m.shared_experts.gate_proj.weight"].T
  assert up.min() < -LIMIT and up.max() > LIMIT and gate.max() > LIMIT  # both sides reached
  want = v4_reference.moe(x, ids, params, "m", config, config.mlp_layer_types[1])
  got = np.asarray(moe(jnp.asarray(x, jnp.float32)[None], jnp.asarray(ids)[None])[0])
  assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
  loose = dataclasses.replace(config, swiglu_limit=1e9)  # the limit decided the output
  assert np.abs(want - v4_reference.moe(x, ids, params, "m", loose, config.mlp_layer_types[1])
                ).max() > 1e-2 * np.abs(want).max()


@dataclasses.dataclass
class _Hopper:
  compute_capability: str = "9.0"
  device_kind: str = "NVIDIA H200"
  platform: str = "gpu"


@pytest.fixture
def both_gpu_backends(monkeypatch):
  """An H200 on a jax that has both Pallas-Triton (deprecated, as from 0.11) and Mosaic GPU."""
  monkeypatch.setattr(backends, "_nvidia_gpu", _Hopper)
  monkeypatch.setattr(gpu_support, "pallas_triton", lambda: gpu_support.GpuBackendSupport(
      "pallas", None, "deprecated by JAX since 0.11"))
  monkeypatch.setattr(gpu_support, "mosaic_gpu",
                      lambda: gpu_support.GpuBackendSupport("mosaic-gpu", None))


def test_auto_prefers_pallas_triton_while_both_gpu_backends_exist(both_gpu_backends):
  """jax 0.11+ on Hopper: both backends available, auto stays Pallas-Triton (gpu_support's
  table); on any jax, without a GPU in sight."""
  from mla_jax.backends.pallas import PallasTritonBackend

  assert type(backends.get_backend("auto")) is PallasTritonBackend
  assert backends.get_backend("mosaic-gpu").name == "mosaic_gpu"  # there to be preferred


def test_a_prompt_without_think_tags_leaves_the_output_content():
  """Thinking off, or a template that knows no tags: no tag in the prompt, so the output is
  content, even when it holds a stray </think>; a prompt that opens <think> starts reasoning."""
  for prompt in ("", "<user>hi<assistant>", "</think>", "<think>r</think>"):
    assert not prompt_opens_think(prompt), prompt
    parser = output_parser(None, "deepseek_v3", None, opens_think=prompt_opens_think(prompt))
    out = parser.parse("an answer</think> and more")
    assert (out.reasoning, out.content) == ("", "an answer</think> and more"), prompt
  assert prompt_opens_think("<user>hi<assistant><think>")
  opened = output_parser(None, "deepseek_v3", None, opens_think=True).parse("r</think>c")
  assert (opened.reasoning, opened.content) == ("r", "c")
