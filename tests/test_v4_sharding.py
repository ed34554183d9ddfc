"""DeepSeek-V4 on a mesh of 8 CPU host devices (tests/conftest.py): its partition rules, steps
equal to one device's, bad meshes named, and full-size parameters placed by shape only."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax import quant, sharding
from mla_jax.v4 import plan as v4_plan
from mla_jax.v4.checkpoint import load_pretrained, save_pretrained
from mla_jax.v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, V4Config, tiny_v4_config
from mla_jax.v4.model import V4CausalLM
from mla_jax.v4.sharding import leaf_spec, rule_name, state_shardings
from tests.test_v4_model import randomize
from tests.v4_released import write_released

# Two layers (CSA with hash routing, HCA with learned routing), four output groups so that
# tensor=4 holds whole groups, experts 64 wide so that tensor=2 keeps whole MXFP4 blocks.
CONFIG = tiny_v4_config(o_groups=4, layer_types=(CSA, HCA), mlp_layer_types=(HASH_MOE, MOE),
                        moe_intermediate_size=64, hc_sinkhorn_iters=2)
LOAD = dict(backend="xla", grouped_matmul="ragged_dot")  # XLA:CPU compiles it fastest
STEP, CAPACITY = 7, 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """The same random model saved in float32 and in the release's layout (fp8 / fp4)."""
  model = randomize(V4CausalLM(CONFIG, rngs=nnx.Rngs(0), **LOAD), 1)
  root = tmp_path_factory.mktemp("v4_mesh")
  save_pretrained(model, root / "float32")
  write_released(model, root / "released")
  return root


_KINDS = {"float32": dict(dtype=jnp.float32),
          "released": dict(dtype="fp8", compute_dtype=jnp.float32)}


@nnx.jit
def _step(model, ids_BT, caches):
  return model(ids_BT, caches)


def two_steps(model):
  """Logits of two steps of ``STEP`` tokens (one compiled program): the second reads the
  first's window ring, compressed entries and compressor state from the caches."""
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 2 * STEP)), jnp.int32)
  caches = model.init_cache(2, CAPACITY)
  out = []
  for start in (0, STEP):
    logits, caches = _step(model, ids[:, start:start + STEP], caches)
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1), caches


@functools.lru_cache(maxsize=None)
def _one_device(root, kind):
  return two_steps(load_pretrained(root / kind, **_KINDS[kind], **LOAD))[0]


def _mesh(spec):
  sizes = sharding.parse_mesh_spec(spec)
  return sharding.make_mesh(sizes, jax.devices()[:math.prod(sizes.values())])


@pytest.mark.parametrize("spec, kind", [("tensor=2", "float32"),
                                        ("expert=2,tensor=2", "released"),
                                        ("tensor=4", "float32")])
def test_steps_on_a_mesh_equal_one_device(checkpoints, spec, kind):
  """Loaded onto the mesh by the rules, a V4 (fp8 / fp4 weights kept as stored too) computes
  one device's logits; its parameters and caches sit where the rules say, split evenly."""
  mesh = _mesh(spec)
  model = load_pretrained(checkpoints / kind, mesh=mesh, **_KINDS[kind], **LOAD)
  logits, caches = two_steps(model)
  want = _one_device(checkpoints, kind)
  np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
  assert np.max(np.abs(logits - want)) / np.max(np.abs(want)) < 1e-5
  assert np.array_equal(logits.argmax(-1), want.argmax(-1))
  split = set()
  for path, var in nnx.state(model).flat_state():
    value, spec_ = var[...], leaf_spec(path, var.ndim)
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec_), value.ndim), (
        rule_name(path))
    ways = math.prod(mesh.shape[a] for a in spec_ if a is not None)
    assert {s.data.nbytes for s in value.addressable_shards} == {value.nbytes // ways}
    split |= {a for a in spec_ if a is not None and mesh.shape[a] > 1}
  assert split == {a for a, n in mesh.shape.items() if n > 1}  # every axis splits something
  for leaf in jax.tree.leaves(caches):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), leaf.ndim)


def test_cli_generates_on_a_mesh_the_tokens_of_one_device(checkpoints, capsys):
  """``mla-jax generate --mesh`` on a V4 checkpoint: its batch over data, heads and experts
  over tensor and expert; the greedy tokens of ``mla_jax.generate`` on one device."""
  from mla_jax import cli
  from mla_jax.generation import generate

  mesh = "data=2,tensor=2,expert=2"
  assert cli.main(["generate", "--checkpoint", str(checkpoints / "float32"), "--mesh", mesh,
                   "--batch", "2", "--prompt-len", "11", "--max-new-tokens", "4", "--dtype",
                   "float32", "--backend", "xla", "--quiet"]) == 0
  out = capsys.readouterr().out
  assert f"mesh: {mesh} over 8 devices" in out
  ids = [int(t) for t in out.split("generated ids: [")[1].split("]")[0].split(",")]
  prompt = np.random.default_rng(0).integers(0, 256, size=11).tolist()  # the CLI's --seed 0
  model = load_pretrained(checkpoints / "float32", dtype=jnp.float32, **LOAD)
  assert generate(model, [prompt], 4).tokens[0] == ids


def test_the_rules(checkpoints):
  """Heads, whole output groups, MLP width and vocabulary over tensor; experts over expert;
  a quantized weight's scales split like it; the rest (kv, compressors, indexer, routers,
  tid2eid, mHC) whole."""
  def spec(name):
    path = tuple(name.split("."))
    return leaf_spec(path, 3 if rule_name(path)[1] else 2)  # stacked experts: [E, ., .]

  attn = "model.layers.0.self_attn."
  assert spec(attn + "q_b_proj.weight") == P("tensor", None)
  assert spec(attn + "q_b_proj.weight.scale_inv") == P("tensor", None)
  assert spec(attn + "o_a_proj.weight") == P("tensor", None)
  assert spec(attn + "o_b_proj.weight.quantized") == P(None, "tensor")
  assert leaf_spec(("model", "layers", 0, "self_attn", "sinks"), 1) == P("tensor")
  for whole in ("kv_proj.weight", "compressor.kv_proj.weight", "indexer.q_b_proj.weight",
                "indexer.weights_proj.weight", "q_a_proj.weight"):
    assert spec(attn + whole) == P(None, None), whole
  mlp = "model.layers.1.mlp."
  assert spec(mlp + "experts.gate_proj") == P("expert", "tensor", None)
  assert spec(mlp + "experts.down_proj.scale_inv") == P("expert", None, "tensor")
  assert spec(mlp + "shared_experts.down_proj.weight") == P(None, "tensor")
  for whole in ("gate.weight", "gate.tid2eid", "gate.e_score_correction_bias"):
    assert spec(mlp + whole) == P(None, None), whole
  assert spec("model.layers.0.attn_hc.fn") == P(None, None)
  assert spec("model.hc_head.hc_fn") == P(None, None)
  assert spec("model.embed_tokens.weight") == P("tensor", None)
  assert spec("lm_head.weight") == P("tensor", None)


@pytest.mark.parametrize("spec, message", [
    ("tensor=8", "4 attention heads cannot be split over mesh axis 'tensor' of size 8; 4 "
                 "output groups \\(o_groups\\) cannot be split"),
    ("tensor=2,expert=4", "6 routed experts cannot be split over mesh axis 'expert' of size 4"),
    ("context=2", "a 'context' axis \\(size 2\\): V4 has no context parallelism"),
])
def test_bad_meshes_are_named_before_anything_is_allocated(spec, message):
  config = tiny_v4_config(o_groups=4, n_routed_experts=6, num_experts_per_tok=2)
  with pytest.raises(ValueError, match=message):
    V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla", mesh=sharding.abstract_mesh(spec))


def test_a_split_that_cuts_mxfp4_blocks_is_named(checkpoints):
  """tensor=4 gives the 64-wide experts shards of 16 columns: half an MXFP4 block."""
  with pytest.raises(ValueError, match="down_proj.*shards of 16, which cut its 32-wide scale "
                                       "blocks"):
    load_pretrained(checkpoints / "released", dtype="fp8", mesh=_mesh("tensor=4"), **LOAD)


def _full_size(model: str) -> V4Config:
  """A model's full dimensions with one layer of each kind (hash and learned routing)."""
  import dataclasses

  return dataclasses.replace(v4_plan.V4_SIZES[model], layer_types=(SLIDING, CSA, HCA),
                             mlp_layer_types=(HASH_MOE, MOE, MOE))


@pytest.mark.parametrize("model", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_full_size_layers_on_8_devices_by_shape(model):
  """Full-size V4-Flash / V4-Pro layers as released, on an abstract 8-device mesh: every
  parameter placed by the rules, and the bytes a device are the split of the whole."""
  config = _full_size(model)
  abstract = v4_plan.abstract_model(config, "fp8")
  mesh = sharding.abstract_mesh("data=1,tensor=4,expert=2")
  per_device, total = v4_plan.param_bytes(abstract, mesh)
  d, e, f = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
  experts = abstract.model.layers[2].mlp.experts.down_proj
  assert experts.packed and experts.quantized.shape == (e, d, f // 2)
  assert experts.scale_inv.shape == (e, d, f // 32)
  assert abstract.model.layers[1].self_attn.o_a_proj.weight.quantized.dtype == jnp.float8_e4m3fn
  expected = 0
  for path, leaf in nnx.state(abstract).flat_state():
    nbytes = leaf.size * np.dtype(leaf.dtype).itemsize
    ways = math.prod(mesh.shape[a] for a in leaf_spec(path, leaf.ndim) if a is not None)
    assert nbytes % ways == 0, rule_name(path)
    expected += nbytes // ways
  assert per_device == expected
  shards = dict(state_shardings(abstract, mesh).flat_state())

  def device_bytes(module, name):
    leaf = getattr(module, name)
    return math.prod(shards[_path_of(abstract, leaf)].shard_shape(leaf.shape)) * np.dtype(
        leaf.dtype).itemsize

  # The routed experts over all 8 devices: half a byte a value, one e8m0 byte per 32.
  for proj in ("gate_proj", "up_proj", "down_proj"):
    weight = getattr(abstract.model.layers[1].mlp.experts, proj)
    assert device_bytes(weight, quant.VALUES) + device_bytes(weight, quant.SCALE_INV) == (
        e * d * f * (1 / 2 + 1 / 32) / 8)
  # The heads' query projection over tensor: one byte a value, an e8m0 byte per 128 x 128.
  q_b = abstract.model.layers[1].self_attn.q_b_proj.weight
  rows = config.num_attention_heads * config.head_dim
  assert device_bytes(q_b, quant.VALUES) == rows * config.q_lora_rank / 4
  assert device_bytes(q_b, quant.SCALE_INV) == rows * config.q_lora_rank / 128**2 / 4


def _path_of(model, leaf):
  return next(path for path, var in nnx.state(model).flat_state() if var is leaf)


def test_plans_name_the_mesh_that_fits(monkeypatch):
  """The best mesh of each GPU count holds the most sequences; weights that do not fit any
  mesh of that count are said so."""
  config = _full_size("deepseek_v4_flash")
  monkeypatch.setitem(v4_plan.V4_SIZES, "deepseek_v4_flash", config)
  abstract = v4_plan.abstract_model(config, "fp8")
  for n in v4_plan.GPU_COUNTS:
    plans = v4_plan.mesh_plans("deepseek_v4_flash", "fp8", n, abstract)
    assert {p.mesh for p in plans} == set(v4_plan.candidate_meshes(config, n))
    best = v4_plan.best_plan(plans, "H200 141GB")
    assert all(best.sequences_that_fit("H200 141GB", 131072) >= p.sequences_that_fit(
        "H200 141GB", 131072) for p in plans)
  table = v4_plan.format_best("deepseek_v4_flash", "fp8", abstract)
  assert "| H200 141GB | 8 | data=8,tensor=1,expert=1 |" in table
