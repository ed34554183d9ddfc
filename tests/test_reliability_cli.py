"""The command line as a first user meets it: ``--num-pages auto`` sized from what the engine
really allocates (a ``context`` mesh, speculative decoding's MTP pools), plans and serving of
what is not supported yet refused by name, and help texts in plain text."""

import argparse
import collections
import dataclasses

import jax
import pytest
from flax import nnx

from mla_jax import cli, plan, sharding
from mla_jax.models.config import tiny_lm
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


@pytest.mark.parametrize("mesh, speculative", [("context=2", 0), (None, 2)],
                         ids=["context-mesh", "mtp-pools"])
def test_num_pages_auto_fills_a_gpu_with_the_pools_the_engine_allocates(monkeypatch, mesh,
                                                                        speculative):
  """On a GPU (its memory limit stood in for), the engine built with the pages ``auto`` chose
  holds pools that fit in 90% of the busiest device after its weights, and a page more on every
  context rank would not: over a ``context`` axis each device holds 1/context of the layers'
  rows, and speculative decoding adds the MTP layers' pools."""
  config = dataclasses.replace(tiny_lm("mqa-only"), num_mtp_layers=1 if speculative else 0)
  devices = 1 if mesh is None else 2
  model_mesh = None if mesh is None else sharding.make_mesh(mesh, jax.devices()[:devices])
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
  assert pages % devices == 0 and pages > 8
  pools = _new_bytes_per_device(lambda: Engine(
      model, num_pages=pages, page_size=PAGE, log_interval=None,
      max_speculative_tokens=speculative))
  assert len(pools) == devices
  per_page = max(pools.values()) / pages
  for device, used in pools.items():
    left = plan.FIT_FRACTION * limit - weights[device]
    assert used <= left < used + devices * per_page, device
