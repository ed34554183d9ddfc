"""Sharded models on 8 CPU host devices (tests/conftest.py) and across two processes.

Sharded results are checked against the unsharded model with the same weights: logits to
float32 tolerance and identical greedy tokens.
"""

import functools
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mla_jax import cli, generation, sharding
from mla_jax import testing as mt
from mla_jax.models.config import small_lm, tiny_lm, tiny_moe_lm
from mla_jax.models.hf_layout import param_layouts
from mla_jax.models.lm import CausalLM
from mla_jax.routing import PrefillRoute
from mla_jax.traces import summarize
from tests.helpers import free_port

MESHES = ("data=1,tensor=2,expert=4", "data=2,tensor=2,expert=2", "data=1,tensor=8,expert=1",
          "data=8,tensor=1,expert=1")
PRESETS = {"tiny_moe": tiny_moe_lm, "small": small_lm}
BATCH, PROMPT, NEW = 8, 20, 5


def _prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, PROMPT - i % 3).tolist() for i in range(BATCH)]


@functools.lru_cache(maxsize=None)
def _unsharded(preset):
  model = CausalLM(PRESETS[preset](), rngs=nnx.Rngs(0), backend="xla")
  return generate_with_logits(model)


def generate_with_logits(model):
  result = generation.generate(model, _prompts(), NEW, return_logits=True)
  return result.tokens, result.step_logits


def _mesh_cases():
  """Every (preset, mesh); the small preset and the one-axis meshes of tiny_moe are slow
  (over 30 s each on 2 cores), so the default run keeps tiny_moe on two mixed meshes."""
  for preset in sorted(PRESETS):
    for mesh_spec in MESHES:
      slow = preset == "small" or mesh_spec in MESHES[2:]
      yield pytest.param(preset, mesh_spec, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("preset, mesh_spec", list(_mesh_cases()))
def test_sharded_generation_equals_unsharded(preset, mesh_spec):
  mesh = sharding.make_mesh(mesh_spec)
  model = CausalLM(PRESETS[preset](), rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
  traced = generation.trace_counts["decode"]
  tokens, logits = generate_with_logits(model)
  assert generation.trace_counts["decode"] - traced == 1  # one decode program, every token
  ref_tokens, ref_logits = _unsharded(preset)
  assert tokens == ref_tokens
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
  assert mt.relative_error(logits, ref_logits) < 1e-5


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_fp8_cache_generation_sharded_equals_unsharded():
  """fp8 values, scales and RoPE are split over ``data`` like the arrays they replace, and the
  key scales travel through the sharded indexer."""
  mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
  kwargs = dict(return_logits=True, cache_dtype="fp8")
  ref = generation.generate(CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla"),
                            _prompts(), NEW, **kwargs)
  model = CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
  got = generation.generate(model, _prompts(), NEW, **kwargs)
  assert got.tokens == ref.tokens
  # Sharded matmuls sum in another order, which can move a value across an e4m3 rounding
  # boundary (a step of 1/8 relative): logits agree to the fp8 rounding, not to float32.
  error = mt.relative_error(got.step_logits, ref.step_logits)
  print(f"fp8 cache, sharded vs unsharded logits: relative error {error:.2e}")
  assert error < 1e-2
  caches = model.init_cache(4, 32, "fp8")
  for leaf in jax.tree.leaves(caches):  # [reps, B, ...]: the batch axis is 1
    assert leaf.sharding.spec == P(None, "data", *(None,) * (leaf.ndim - 2))
    assert {s.data.shape[1] for s in leaf.addressable_shards} == {2}


def _axes(entry) -> tuple:
  """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _expected_spec(layout, ndim):
  return sharding.param_spec(layout.rule_name, layout.leading, ndim)


def test_every_leaf_carries_its_rules_sharding():
  mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
  config = tiny_moe_lm()
  model = CausalLM(config, rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
  state = nnx.state(model, nnx.Param)
  layouts = param_layouts(state)
  split = {"tensor": 0, "expert": 0}
  for path, var in state.flat_state():
    value, layout = var[...], layouts[path]
    spec = _expected_spec(layout, value.ndim)
    assert value.sharding.spec == spec, layout.template
    ways = math.prod(mesh.shape[a] for entry in spec for a in _axes(entry))
    shard_bytes = {s.data.nbytes for s in value.addressable_shards}
    assert shard_bytes == {value.nbytes // ways}, layout.template  # no padding, no copies
    for axis in split:
      split[axis] += any(axis in _axes(entry) for entry in spec)
  assert split["tensor"] and split["expert"]  # the rules really split something
  rules = {layouts[p].template: var[...].sharding.spec for p, var in state.flat_state()}
  assert rules["model.layers.{layer}.self_attn.q_b_proj.weight"] == P(None, TP, None)
  assert rules["model.layers.{layer}.self_attn.o_proj.weight"] == P(None, None, TP)
  assert rules["model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"] == P(
      None, "expert", None, TP)
  assert rules["model.layers.{layer}.self_attn.indexer.wq_b.weight"] == P(None, None, None)
  assert rules["lm_head.weight"] == P(TP, None)
  caches = model.init_cache(4, 32)
  for leaf in jax.tree.leaves(caches):
    batch_axis = leaf.ndim - (1 if leaf.dtype == jnp.int32 else 3)
    expected = [None] * leaf.ndim
    expected[batch_axis] = "data"
    assert leaf.sharding.spec == P(*expected)
    assert {s.data.shape[batch_axis] for s in leaf.addressable_shards} == {2}


@pytest.mark.parametrize("spec, match", [
    ("data=1,tensor=2,expert=2", "needs 4 devices but 8"),
    ("data=1,tensors=8", "unknown mesh axis 'tensors'"),
    ("data=1,data=8", "given twice"),
    ("data=x", "positive int size"),
    ("data=0,tensor=8", "positive int size"),
    ("tensor", "not of the form axis=size"),
])
def test_bad_mesh_specs(spec, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(spec)


def _with(config, **changes):
  import dataclasses

  moe = changes.pop("moe", None)
  if moe:
    changes["moe"] = dataclasses.replace(config.moe, **moe)
  return dataclasses.replace(config, **changes)


@pytest.mark.parametrize("config, spec, match", [
    (tiny_lm(), "data=1,tensor=8,expert=1", "4 attention heads cannot be split over the "
     "tensor x context ranks \\(mesh axes 'tensor' x 'context': 8 x 1 = 8\\)"),
    (tiny_lm(), "tensor=4,context=2", "4 attention heads cannot be split over the "
     "tensor x context ranks \\(mesh axes 'tensor' x 'context': 4 x 2 = 8\\)"),
    (tiny_lm(), "context=8", "4 attention heads cannot be split over the "
     "tensor x context ranks \\(mesh axes 'tensor' x 'context': 1 x 8 = 8\\)"),
    (_with(tiny_moe_lm(), moe=dict(num_experts=12)), "data=1,tensor=1,expert=8",
     "12 routed experts cannot be split over mesh axis 'expert' of size 8"),
    (_with(tiny_moe_lm(), vocab_size=260), "data=1,tensor=8,expert=1",
     "dimension 260 of shape \\(260, 128\\) cannot be split 8 ways over mesh axis "
     "\\('tensor', 'context'\\)"),
    (_with(tiny_moe_lm(), vocab_size=260), "tensor=2,context=4", "dimension 260"),
    (_with(tiny_moe_lm(), intermediate_size=100), "data=1,tensor=8,expert=1",
     "model.layers.0.mlp.(gate|down)_proj.weight: dimension 100"),
])
def test_meshes_the_model_cannot_use(config, spec, match, monkeypatch):
  """Refused before anything is allocated: the sharded initializer is never compiled."""
  mesh = sharding.make_mesh(spec)
  monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("allocation attempted"))
  with pytest.raises(ValueError, match=match):
    CausalLM(config, rngs=nnx.Rngs(0), backend="xla", mesh=mesh)


def test_batch_must_split_over_data():
  mesh = sharding.make_mesh("data=8,tensor=1,expert=1")
  # Abstract weights: the check is on the cache's batch, and needs no allocated model.
  model = nnx.eval_shape(lambda: CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla",
                                          mesh=mesh))
  with pytest.raises(ValueError, match="batch_size 4 cannot be split over mesh axis 'data'"):
    model.init_cache(4, 16)


@pytest.mark.parametrize("length", [8, 32])  # within the top-k (16) and past it
def test_scanned_sharded_models_keep_the_routing_contract(length):
  """Through scan and shard_map: the prefill of the MQA-only model scores and stays sparse; the
  dense-capable one goes dense within the top-k and masked past it."""
  mesh = sharding.make_mesh("data=1,tensor=2,expert=4")
  mha = {"mla_dense_mha"} if length <= 16 else {"indexer_score", "mla_masked_mha"}
  for attention, expected in (("mqa-only", {"indexer_score", "mla_sparse_mqa"}),
                              ("dense-capable", mha)):
    # Traced only: abstract weights and caches (their shardings kept) trace the same program.
    model = nnx.eval_shape(lambda: CausalLM(tiny_moe_lm(attention), rngs=nnx.Rngs(0),
                                            backend="xla", mesh=mesh))
    ids = sharding.put(np.ones((1, length), np.int32), mesh, sharding.TOKENS_SPEC)
    summary = summarize(nnx.jit(lambda m, i, c: m(i, c, num_cached_tokens=0)), model, ids,
                        jax.eval_shape(lambda: model.init_cache(1, 40)))
    route_scopes = {"indexer_score", "mla_sparse_mqa", "mla_dense_mha", "mla_masked_mha"}
    assert summary.scopes & route_scopes == expected, attention
    assert summary.primitives["cond"] == 0 and summary.primitives["scan"] >= 1


# Jitted: eager op-by-op dispatch over sharded arrays cost most of a forward's time.
_forward = nnx.jit(lambda m, i, c: m(i, c, num_cached_tokens=0)[0])


def test_sharded_masked_route_equals_unsharded():
  """The masked route's attention under shard_map (heads split over tensor) against one device."""
  ids = np.random.default_rng(1).integers(0, 256, size=(1, 32)).astype(np.int32)
  mesh = sharding.make_mesh("data=1,tensor=2,expert=4")
  logits = []
  for on_mesh in (None, mesh):
    model = CausalLM(tiny_moe_lm("dense-capable"), rngs=nnx.Rngs(0), backend="xla", mesh=on_mesh)
    assert set(model.prefill_routes(32, 0)) == {PrefillRoute.MASKED_MHA}
    tokens = ids if on_mesh is None else sharding.put(ids, mesh, sharding.TOKENS_SPEC)
    logits.append(np.asarray(_forward(model, tokens, model.init_cache(1, 40))))
  assert mt.relative_error(logits[1], logits[0]) < 1e-5


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_two_processes_equal_one(tmp_path):
  """Two processes x 2 CPU devices (gloo) form one 4-device mesh; same logits and tokens."""
  mesh_spec, port = "data=1,tensor=2,expert=2", free_port()
  worker = Path(__file__).with_name("multiprocess_worker.py")
  out = tmp_path / "out.npz"
  procs = [subprocess.Popen([sys.executable, str(worker), str(port), "2", str(i), mesh_spec,
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  logs = [p.communicate(timeout=300)[0].decode() for p in procs]
  assert all(p.returncode == 0 for p in procs), logs
  got = np.load(out)
  assert int(got["devices"]) == 4
  mesh = sharding.make_mesh(mesh_spec, devices=jax.devices()[:4])
  model = CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
  ids = np.random.default_rng(0).integers(0, 256, (2, 12)).astype(np.int32)
  logits, _ = nnx.jit(lambda m, i, c: m(i, c, num_cached_tokens=0))(
      model, sharding.put(ids, mesh, sharding.TOKENS_SPEC), model.init_cache(2, 24))
  np.testing.assert_allclose(got["logits"], np.asarray(logits), rtol=1e-5, atol=1e-5)
  assert got["tokens"].tolist() == generation.generate(model, ids.tolist(), 6).tokens


@pytest.mark.parametrize("argv, match", [
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in \\[0, 2\\)"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2"], "go together"),
    (["--coordinator", "nohost", "--num-processes", "1", "--process-id", "0"], "HOST:PORT"),
    (["--mesh", "data=1,model=2"], "unknown mesh axis 'model'"),
])
def test_cli_multiprocess_flag_errors(argv, match, capsys):
  """Refused before jax.distributed or any device is touched."""
  try:
    code = cli.main(["generate", "--quiet", *argv])
  except SystemExit as exit_:
    code, message = exit_.code, str(exit_)
  else:
    message = capsys.readouterr().err
  assert code not in (0, None)
  assert __import__("re").search(match, str(message)), message


@pytest.mark.slow  # over 30 s on 2 cores: CI runs the slow cases in a step of their own
def test_cli_generate_on_a_mesh(capsys):
  assert cli.main(["generate", "--preset", "tiny-moe", "--mesh", "data=2,tensor=2,expert=2",
                   "--batch", "2", "--prompt", "mesh", "--max-new-tokens", "3", "--quiet",
                   "--backend", "xla"]) == 0
  out = capsys.readouterr().out
  assert "mesh: data=2,tensor=2,expert=2 over 8 devices in 1 process(es)" in out
  assert "generated ids:" in out


# The rule table, pinned literally: a rule moved to another axis (kv_b_proj split over its
# columns, say) stays numerically right under any split, so only a literal check sees it.
# Heads, MLP widths and the vocabulary split over tensor x context, tensor-major.
TP = ("tensor", "context")
PINNED_RULES = (
    (r"embed_tokens\.weight$", P(TP, None)),
    (r"lm_head\.weight$", P(TP, None)),
    (r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up)_proj\.weight(_scale_inv)?$",
     P(TP, None)),
    (r"mlp\.(shared_experts\.|experts\.\d+\.)?down_proj\.weight(_scale_inv)?$",
     P(None, TP)),
    (r"self_attn\.q_b_proj\.weight(_scale_inv)?$", P(TP, None)),
    (r"self_attn\.kv_b_proj\.weight(_scale_inv)?$", P(TP, None)),
    (r"self_attn\.o_proj\.weight(_scale_inv)?$", P(None, TP)),
    (r".", P()),
)

# Every parameter of the tiny MoE preset (HF template, {layer} stacked in front) -> its full
# spec, written out by hand: rows of q_b / kv_b (heads) and gate / up (intermediate), columns
# of o_proj / down_proj, vocab rows; routed experts over "expert"; the rest replicated.
_R = (None,)  # the stacked-layer axis: whole on every device
PINNED_PARAM_SPECS = {
    "model.embed_tokens.weight": P(TP, None),
    "lm_head.weight": P(TP, None),
    "model.norm.weight": P(None),
    "model.layers.{layer}.input_layernorm.weight": P(*_R, None),
    "model.layers.{layer}.post_attention_layernorm.weight": P(*_R, None),
    "model.layers.{layer}.self_attn.q_a_proj.weight": P(*_R, None, None),
    "model.layers.{layer}.self_attn.q_a_layernorm.weight": P(*_R, None),
    "model.layers.{layer}.self_attn.q_b_proj.weight": P(*_R, TP, None),
    "model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight": P(*_R, None, None),
    "model.layers.{layer}.self_attn.kv_a_layernorm.weight": P(*_R, None),
    "model.layers.{layer}.self_attn.kv_b_proj.weight": P(*_R, TP, None),
    "model.layers.{layer}.self_attn.o_proj.weight": P(*_R, None, TP),
    "model.layers.{layer}.self_attn.indexer.wq_b.weight": P(*_R, None, None),
    "model.layers.{layer}.self_attn.indexer.wk.weight": P(*_R, None, None),
    "model.layers.{layer}.self_attn.indexer.k_norm.weight": P(*_R, None),
    "model.layers.{layer}.self_attn.indexer.k_norm.bias": P(*_R, None),
    "model.layers.{layer}.self_attn.indexer.weights_proj.weight": P(*_R, None, None),
    "model.layers.{layer}.mlp.gate_proj.weight": P(*_R, TP, None),
    "model.layers.{layer}.mlp.up_proj.weight": P(*_R, TP, None),
    "model.layers.{layer}.mlp.down_proj.weight": P(*_R, None, TP),
    "model.layers.{layer}.mlp.gate.weight": P(*_R, None, None),
    "model.layers.{layer}.mlp.gate.e_score_correction_bias": P(*_R, None),
    "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight": P(*_R, "expert", TP, None),
    "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight": P(*_R, "expert", TP, None),
    "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight": P(*_R, "expert", None, TP),
    "model.layers.{layer}.mlp.shared_experts.gate_proj.weight": P(*_R, TP, None),
    "model.layers.{layer}.mlp.shared_experts.up_proj.weight": P(*_R, TP, None),
    "model.layers.{layer}.mlp.shared_experts.down_proj.weight": P(*_R, None, TP),
}


def test_every_partition_rule_is_pinned():
  assert sharding.PARTITION_RULES == PINNED_RULES
  assert sharding.LEADING_AXIS_SPECS == {"layer": None, "expert": "expert"}


@pytest.mark.parametrize("spec", ["data=1,tensor=4,expert=2", "tensor=4,context=2",
                                  "tensor=2,context=4", "context=8"])
def test_every_parameter_shard_has_its_pinned_shape(spec):
  """Each device holds exactly the piece the pinned spec gives: on tensor=4 x expert=2
  (unequal sizes, so a rule on the wrong mesh axis changes the shapes too), and on the
  context meshes, where every attention and MLP projection (heads, widths, the vocabulary;
  the routed experts' width) is 1/8 on each device, as on tensor=8."""
  mesh = sharding.make_mesh(spec)
  model = CausalLM(tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
  state = nnx.state(model, nnx.Param)
  layouts = param_layouts(state)
  seen = set()
  for path, var in state.flat_state():
    value, template = var[...], layouts[path].template
    spec = PINNED_PARAM_SPECS[template]  # a KeyError: a parameter without a pinned spec
    seen.add(template)
    assert value.sharding.spec == spec, template
    want = tuple(n // math.prod(mesh.shape[a] for a in _axes(axes))
                 for n, axes in zip(value.shape, (*spec, *(None,) * (value.ndim - len(spec)))))
    assert {s.data.shape for s in value.addressable_shards} == {want}, template
    assert len(value.addressable_shards) == 8
    if TP in spec and mesh.shape["expert"] == 1:  # tensor x context: 8 ways
      assert value.addressable_shards[0].data.size * 8 == value.size, template
  assert seen == set(PINNED_PARAM_SPECS)
