"""The command line as a first user meets it: ``--num-pages auto`` sized from what the engine
really allocates (a ``context`` mesh, speculative decoding's MTP pools), plans and serving of
what is not supported yet refused by name, and help texts in plain text."""

import argparse
import collections
import dataclasses
import math
from types import SimpleNamespace

import jax
import pytest
from flax import nnx

from mla_jax import cli, plan, sharding
from mla_jax.models.config import tiny_lm, tiny_moe_lm
from mla_jax.models.lm import CausalLM
from mla_jax.serving.engine import Engine

PAGE = 8


def _new_bytes_per_device(build) -> collections.Counter:
  """Bytes of the arrays ``build()`` leaves alive, per device."""
  before = {id(a) for a in jax.live_arrays()}
  kept = build()
  per_device = collections.Counter()
  for a in jax.live_arrays():
    if id(a) not in before:
      for shard in a.addressable_shards:
        per_device[shard.device] += shard.data.nbytes
  del kept
  return per_device


@pytest.mark.parametrize("mesh, speculative", [
    ("context=2", 0), (None, 2), ("tensor=4,context=2", 0), ("data=2,context=2", 0)],
    ids=["context-mesh", "mtp-pools", "tensor-x-context", "data-x-context"])
def test_num_pages_auto_fills_a_gpu_with_the_pools_the_engine_allocates(monkeypatch, mesh,
                                                                        speculative):
  """On a GPU (its memory limit stood in for), the engine built with the pages ``auto`` chose
  holds pools that fit in 90% of the busiest device after its weights, and a page more on every
  context rank would not: over a ``context`` axis each device holds 1/context of the layers'
  rows (and 1/(tensor x context) of the weights), a ``data`` axis shares one pool, and
  speculative decoding adds the MTP layers' pools."""
  config = tiny_moe_lm() if mesh == "tensor=4,context=2" else tiny_lm("mqa-only")
  config = dataclasses.replace(config, num_mtp_layers=1 if speculative else 0)
  sizes = sharding.parse_mesh_spec(mesh or "data=1")
  devices = math.prod(sizes.values())
  model_mesh = None if mesh is None else sharding.make_mesh(sizes, jax.devices()[:devices])
  model = CausalLM(config, rngs=nnx.Rngs(0), backend="xla", mesh=model_mesh)
  weights = collections.Counter()
  for leaf in jax.tree.leaves(nnx.state(model)):
    for shard in leaf.addressable_shards:
      weights[shard.device] += shard.data.nbytes
  limit = int((max(weights.values()) + 2**21) / plan.FIT_FRACTION)  # 2 MiB left for pages
  monkeypatch.setattr(plan, "_memory_limit", lambda device: limit)
  args = argparse.Namespace(num_pages="auto", page_size=PAGE, cache_dtype="fp32",
                            speculative_tokens=speculative)
  pages = cli._num_pages(args, model)
  ranks = sizes["context"]
  assert pages % ranks == 0 and pages > 8
  pools = _new_bytes_per_device(lambda: Engine(
      model, num_pages=pages, page_size=PAGE, log_interval=None,
      max_speculative_tokens=speculative))
  assert len(pools) == devices
  per_page = max(pools.values()) / pages
  for device, used in pools.items():
    left = plan.FIT_FRACTION * limit - weights[device]
    assert used <= left < used + ranks * per_page, device


def test_plan_of_v4_says_what_is_not_supported_yet(monkeypatch, capsys):
  """The V4 figures come with what V4 cannot do yet: drafts under serve, a context axis (the
  plan itself, an eval_shape of the full model, is stood in for: tests/test_v4_plan.py)."""
  from mla_jax.v4 import plan as v4_plan

  monkeypatch.setattr(v4_plan, "abstract_model", lambda config, dtype: None)
  monkeypatch.setattr(v4_plan, "make_plan",
                      lambda model, mesh, dtype, abstract, caches: SimpleNamespace(
                          total_param_bytes=0))
  monkeypatch.setattr(v4_plan, "describe",
                      lambda model, dtype, total, caches: f"{model}: figures")
  monkeypatch.setattr(v4_plan, "format_plans", lambda plans: "plans")
  monkeypatch.setattr(v4_plan, "format_best", lambda model, dtype, abstract, caches: "best")
  assert cli.main(["plan", "--model", "deepseek_v4_pro"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("deepseek_v4_pro: figures\n")
  assert "not supported yet for deepseek_v4_pro" in out and "'context' axis" in out
  assert "mla-jax serve" in out


def test_serving_a_v4_checkpoint_with_drafts_is_refused_by_name(tmp_path):
  """The engine drafts for no model with per-sequence state yet: refused before loading."""
  (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4"}')
  with pytest.raises(SystemExit, match="--speculative-tokens with mla-jax serve: not supported"):
    cli.main(["serve", "--checkpoint", str(tmp_path), "--speculative-tokens", "1"])


def test_help_texts_are_plain_text_and_name_every_command(capsys):
  """No reStructuredText markup (``x``) in any --help; the top-level description names every
  command, serve included."""
  parser = cli.build_parser()
  commands = parser._subparsers._group_actions[0].choices
  for name, sub in {"mla-jax": parser, **commands}.items():
    text = sub.format_help()
    assert "``" not in text and ":func:" not in text, name
  description = parser.description
  assert all(f"``{c}``" not in description and c in description for c in commands)
