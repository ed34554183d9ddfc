"""Streamed, sharded checkpoint loading on 8 host devices (tests/conftest.py) and across two
processes: the same parameters bit for bit as an unsharded load, in the rule shardings, with
every byte read once and each process reading only the files that hold its pieces."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from mla_jax import plan, sharding
from mla_jax.checkpoints import (CheckpointError, load_pretrained, loading, open_checkpoint,
                                 save_pretrained)
from mla_jax.models.hf_layout import hf_params, param_layouts
from tests.checkpoint_models import fp8_config, random_model, write_fp8_checkpoint
from tests.helpers import free_port

MESH = "data=1,tensor=2,expert=4"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """The same bf16 model as an index with many small shards and as an fp8 checkpoint."""
  root = tmp_path_factory.mktemp("streaming")
  model = random_model(fp8_config(), seed=3, param_dtype=jnp.bfloat16)
  save_pretrained(model, root / "bf16", max_shard_bytes=110_000)
  write_fp8_checkpoint(model, root / "fp8")
  return root


@pytest.fixture
def spy(monkeypatch):
  """The ``CheckpointTensors`` each load opens (to see what it read)."""
  opened = []

  def record(path):
    opened.append(open_checkpoint(path))
    return opened[-1]

  monkeypatch.setattr(loading, "open_checkpoint", record)
  return opened


@pytest.mark.parametrize("kind, dtype", [("bf16", None), ("fp8", "fp8")])
def test_sharded_load_equals_unsharded_bitwise(checkpoints, kind, dtype):
  mesh = sharding.make_mesh(MESH)
  whole = load_pretrained(checkpoints / kind, dtype=dtype, backend="xla")
  split = load_pretrained(checkpoints / kind, dtype=dtype, backend="xla", mesh=mesh)
  a, b = hf_params(whole), hf_params(split)
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
  assert any(name.endswith("_scale_inv") for name in a) == (kind == "fp8")
  state = nnx.state(split, nnx.Param)
  layouts = param_layouts(state)
  for path, var in state.flat_state():
    layout = layouts[path]
    spec = sharding.param_spec(layout.rule_name, layout.leading, var.ndim)
    assert var[...].sharding == NamedSharding(mesh, spec), layout.template
  specs = {layouts[p].template: var[...].sharding.spec for p, var in state.flat_state()}
  if kind == "fp8":  # a device holds the scales of the blocks it holds
    for name in ("self_attn.q_b_proj.weight", "mlp.experts.{expert}.down_proj.weight"):
      template = f"model.layers.{{layer}}.{name}"
      assert specs[template + "_scale_inv"] == specs[template] != (None,) * 3
    # mla-jax plan's bytes (abstract, plan.FP8_WEIGHTS) are what the loaded model holds.
    first = mesh.devices.flat[0]
    held = sum(shard.data.nbytes for _, var in state.flat_state()
               for shard in var[...].addressable_shards if shard.device == first)
    total = sum(var[...].nbytes for _, var in state.flat_state())
    assert plan.param_bytes(nnx.state(plan.abstract_model(fp8_config(), "fp8")), mesh) == (
        held, total)
  devices = {d for _, var in nnx.state(whole, nnx.Param).flat_state()
             for d in var[...].sharding.device_set}
  assert devices == {jax.local_devices()[0]}
  # The model computes on its mesh, and its caches follow it.
  assert split.mesh is mesh
  caches = jax.tree.leaves(split.init_cache(2, 16))
  assert all(leaf.sharding.mesh == mesh for leaf in caches)
  if kind == "fp8":  # sharded experts dequantized in their shard = dequantized on load
    dequantized = load_pretrained(checkpoints / kind, dtype=jnp.bfloat16, backend="xla",
                                  mesh=mesh)
    x = np.random.default_rng(1).standard_normal((2, 6, 200)).astype(jnp.bfloat16)
    moe = lambda model: model.layer_module(2).mlp
    run = nnx.jit(lambda m, x: m(x))
    assert moe(split).mesh is mesh
    np.testing.assert_array_equal(np.asarray(run(moe(split), x), np.float32),
                                  np.asarray(run(moe(dequantized), x), np.float32))


def test_every_byte_is_read_once_and_only_after_validation(checkpoints, spy, tmp_path):
  path = checkpoints / "bf16"
  load_pretrained(path, backend="xla", mesh=sharding.make_mesh(MESH))
  tensors = spy[-1]
  files = {}
  for name in tensors:
    file = tensors[name].file.path.name
    files[file] = files.get(file, 0) + tensors[name].nbytes
  assert len(files) > 10 and tensors.bytes_read == files  # replicas share one read

  bad = tmp_path / "bad"
  bad.mkdir()
  for file in path.iterdir():
    (bad / file.name).write_bytes(file.read_bytes())
  index = json.loads((bad / "model.safetensors.index.json").read_text())
  index["weight_map"]["model.layers.1.mlp.experts.9.up_proj.weight"] = index["weight_map"][
      "lm_head.weight"]
  del index["weight_map"]["model.norm.weight"]
  (bad / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(CheckpointError, match="(?s)missing \\(1\\).*model.norm.weight"):
    load_pretrained(bad, backend="xla", mesh=sharding.make_mesh(MESH))
  assert spy[-1].bytes_read == {}


def test_mesh_errors_come_before_the_checkpoint_is_opened(checkpoints, spy):
  with pytest.raises(ValueError, match="4 attention heads cannot be split over the tensor x "
                                       "context ranks"):
    load_pretrained(checkpoints / "bf16", mesh=sharding.make_mesh("data=1,tensor=8,expert=1"))
  assert spy == []


def test_fp8_split_that_cuts_a_block_is_refused_before_reading(checkpoints, spy):
  """Intermediate 256 over tensor=4: 64-row shards would cut the 128-row scale blocks."""
  with pytest.raises(ValueError, match="mlp.(gate|up|down)_proj.weight: splitting dimension "
                                       "256 .* gives shards of 64, which cut its 128-wide"):
    load_pretrained(checkpoints / "fp8", dtype="fp8",
                    mesh=sharding.make_mesh("data=1,tensor=4,expert=2"))
  assert spy[-1].bytes_read == {}


def test_two_processes_read_only_the_files_holding_their_pieces(checkpoints, tmp_path):
  """2 processes x 2 devices, experts split 4 ways: each process reads the files of the
  tensors every device needs plus those of its own two experts, and nothing else."""
  path, port = checkpoints / "bf16", free_port()
  worker = Path(__file__).parents[1] / "benchmarks" / "multiprocess_load_worker.py"
  procs = [subprocess.Popen([sys.executable, str(worker), str(port), "2", str(i), str(path),
                             "data=1,tensor=1,expert=4", "default", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
  logs = [p.communicate(timeout=300)[0].decode() for p in procs]
  assert all(p.returncode == 0 for p in procs), logs
  source = open_checkpoint(path)
  expert_of = lambda name: re.search(r"\.experts\.(\d+)\.", name)
  reports = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
  assert sorted(reports[0]["experts"] + reports[1]["experts"]) == [0, 1, 2, 3]
  for i, report in enumerate(reports):
    needed = {}
    for name in source:
      match = expert_of(name)
      if match is None or int(match.group(1)) in report["experts"]:
        file = source[name].file.path.name
        needed[file] = needed.get(file, 0) + source[name].nbytes
    assert report["bytes_read"] == needed, i
    saved = open_checkpoint(tmp_path / f"p{i}")
    assert sorted(saved) == sorted(source)
    for name in source:
      assert saved[name].read().tobytes() == source[name].read().tobytes(), name
  files = {source[name].file.path.name for name in source}
  assert all(set(r["bytes_read"]) < files for r in reports)  # each skipped some files
