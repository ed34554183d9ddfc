"""DeepSeek-V4 checkpoints without torch: config rules, save -> load, errors, the CLI."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import cli
from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.loading import dequantize_fp8_blocks
from mla_jax.checkpoints.reading import open_checkpoint
from mla_jax.checkpoints.writing import write_safetensors
from mla_jax.config import RopeConfig, YarnConfig
from mla_jax.v4.checkpoint import load_pretrained, model_tensors, save_pretrained
from mla_jax.v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, tiny_v4_config
from mla_jax.v4.hf_config import v4_config_from_hf, v4_config_to_hf
from mla_jax.v4.model import V4CausalLM
from tests.checkpoint_models import quantize_fp8
from tests.test_v4_model import randomize, run


def hf_config(**fields):
  return {"model_type": "deepseek_v4", "num_hidden_layers": 4, **fields}


def test_defaults_follow_hf():
  """V4-Pro's schedule (2 HCA, then CSA / HCA alternating), 3 hash layers, rope 64 of 512."""
  config = v4_config_from_hf(hf_config())
  assert config.layer_types == (HCA, HCA, HCA, CSA)
  assert config.mlp_layer_types == (HASH_MOE, HASH_MOE, HASH_MOE, MOE)
  assert (config.rope_dim, config.csa_ratio, config.hca_ratio) == (64, 4, 128)
  assert config.compress_rope == RopeConfig(theta=160000.0)
  assert config.main_rope == RopeConfig(theta=10000.0)


def test_legacy_fields():
  config = v4_config_from_hf(hf_config(
      compress_ratios=[0, 4, 128, 4], compress_rate_csa=8, num_hash_layers=1,
      qk_rope_head_dim=32,
      rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}))
  assert config.layer_types == (SLIDING, CSA, HCA, CSA)
  assert config.csa_ratio == 8 and config.hca_ratio == 128
  assert config.mlp_layer_types == (HASH_MOE, MOE, MOE, MOE)
  assert config.rope_dim == 32
  assert config.compress_rope.yarn == YarnConfig(factor=16.0,
                                                 original_max_position_embeddings=65536)
  assert config.main_rope.yarn is None  # YaRN is the compressed branches' only


def test_yarn_magnitude_follows_hf():
  """Flat: 1 (HF forces it for V4). Nested without attention_factor: HF's
  0.1 ln(factor) + 1; with both mscales, their ratio."""
  from mla_jax.rope import rope_attention_factor

  yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}
  nested = lambda compress: hf_config(rope_parameters={"main": {"rope_type": "default"},
                                                      "compress": compress})
  magnitude = lambda hf: rope_attention_factor(v4_config_from_hf(hf).compress_rope)
  assert magnitude(hf_config(rope_parameters=yarn)) == 1.0
  assert magnitude(nested(yarn)) == pytest.approx(0.1 * np.log(16.0) + 1)
  assert magnitude(nested({**yarn, "attention_factor": 1.0})) == 1.0
  assert magnitude(nested({**yarn, "mscale": 2.0, "mscale_all_dim": 1.0})) == pytest.approx(
      (0.2 * np.log(16.0) + 1) / (0.1 * np.log(16.0) + 1))
  # V4's softmax does not read mscale_all_dim, so alone it changes nothing (V3.2 refuses it).
  assert magnitude(nested({**yarn, "mscale_all_dim": 1.0})) == pytest.approx(
      0.1 * np.log(16.0) + 1)
  with pytest.raises(CheckpointError, match="attention_factor 1.5"):
    v4_config_from_hf(nested({**yarn, "attention_factor": 1.5}))


def test_yarn_defaults_follow_hf():
  """The parser V3.2 uses: null betas take HF's defaults, a null factor is HF's implicit one
  and a missing original length is max_position_embeddings."""
  yarn = lambda **params: v4_config_from_hf(hf_config(
      max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", **params})
  ).compress_rope.yarn
  assert yarn(factor=None, original_max_position_embeddings=1024, beta_fast=None,
              beta_slow=0) == YarnConfig(factor=4.0, original_max_position_embeddings=1024,
                                         mscale=1.0, mscale_all_dim=1.0)
  assert yarn(factor=2.0).original_max_position_embeddings == 4096


def test_n_shared_experts_is_ignored_as_hf_ignores_it():
  """HF's V4 MoE builds one shared expert of moe_intermediate_size whatever it says."""
  assert v4_config_from_hf(hf_config(n_shared_experts=2)) == v4_config_from_hf(hf_config(
      n_shared_experts=0))


def test_explicit_lists_win_over_legacy():
  config = v4_config_from_hf(hf_config(
      layer_types=[SLIDING] * 4, compress_ratios=[4] * 4, mlp_layer_types=[MOE] * 4,
      num_hash_layers=3, partial_rotary_factor=0.25, qk_rope_head_dim=8))
  assert config.layer_types == (SLIDING,) * 4 and config.mlp_layer_types == (MOE,) * 4
  assert config.rope_dim == 128


@pytest.mark.parametrize("fields, message", [
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ({"compress_ratios": [0, 3, 4, 4]}, "compress_ratios"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"hidden_size": 4096.0}, "hidden_size must be an int"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq'"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"o_groups": 7}, "o_groups"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "longrope"),
])
def test_bad_configs_are_named(fields, message):
  with pytest.raises(CheckpointError, match=message):
    v4_config_from_hf(hf_config(**fields))


@pytest.mark.parametrize("mscales", [(1.0, 1.0), (1.0, 0.0)])
def test_config_round_trip(mscales):
  config = tiny_v4_config(compress_rope=RopeConfig(theta=160000.0, yarn=YarnConfig(
      factor=16.0, original_max_position_embeddings=64, mscale=mscales[0],
      mscale_all_dim=mscales[1])))
  assert v4_config_from_hf(json.loads(json.dumps(v4_config_to_hf(config)))) == config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  model = randomize(V4CausalLM(tiny_v4_config(), rngs=nnx.Rngs(0), backend="xla"), 1)
  path = tmp_path_factory.mktemp("v4")
  save_pretrained(model, path)
  return model, path


def test_save_load_is_bitwise(saved):
  model, path = saved
  loaded = load_pretrained(path, dtype=jnp.float32, backend="xla")
  for (p1, v1), (p2, v2) in zip(nnx.state(model).flat_state(), nnx.state(loaded).flat_state()):
    assert p1 == p2
    np.testing.assert_array_equal(np.asarray(v1[...]), np.asarray(v2[...]))
  ids = jnp.asarray(np.arange(20)[None] % 256, jnp.int32)
  np.testing.assert_array_equal(run(model, ids), run(loaded, ids))


def test_deepseek_names_load_too(saved, tmp_path):
  """DeepSeek's release names the top tensors embed / head / norm / hc_head_* and puts no
  ``model.`` in front; those load into the same model."""
  model, path = saved
  tensors = {name.removeprefix("model."): value for name, value in model_tensors(model).items()}
  renames = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
             "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
  tensors = {renames.get(name, name): value for name, value in tensors.items()}
  write_safetensors(tensors, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  loaded = load_pretrained(tmp_path, dtype=jnp.float32, backend="xla")
  np.testing.assert_array_equal(np.asarray(loaded.model.hc_head.hc_fn[...]),
                                np.asarray(model.model.hc_head.hc_fn[...]))


def test_missing_and_misshapen_tensors_are_listed(saved, tmp_path):
  model, path = saved
  tensors = {name: np.asarray(open_checkpoint(path)[name].read())
             for name in open_checkpoint(path)}
  del tensors["model.layers.1.attn.indexer.wq_b.weight"]
  tensors["model.layers.2.ffn.experts.3.w2.weight"] = np.zeros((3, 3), np.float32)
  write_safetensors(tensors, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(CheckpointError) as err:
    load_pretrained(tmp_path, dtype=jnp.float32, backend="xla")
  assert "missing tensor layers.1.attn.indexer.wq_b.weight" in str(err.value)
  assert "model.layers.2.ffn.experts.3.w2.weight: shape [3, 3], expected [64, 32]" in str(
      err.value)


def test_cli_generates_from_a_v4_checkpoint(saved, capsys):
  model, path = saved
  assert cli.main(["generate", "--checkpoint", str(path), "--prompt-len", "19",
                   "--max-new-tokens", "6", "--dtype", "float32", "--backend", "xla",
                   "--quiet"]) == 0
  out = capsys.readouterr().out
  assert "DeepSeek-V4 x 4 layers" in out
  assert "layer 1: compressed_sparse_attention: compressed scored" in out
  assert "layer 2: heavily_compressed_attention: compressed all" in out
  ids = [int(t) for t in out.split("generated ids: [")[1].split("]")[0].split(",")]
  prompt = np.random.default_rng(0).integers(0, 256, size=19)
  # The same greedy tokens as the cached steps of the model it was saved from.
  from mla_jax.generation import generate
  assert generate(model, [prompt.tolist()], 6).tokens[0] == ids


def test_cli_refuses_what_v4_lacks(saved):
  _, path = saved
  with pytest.raises(SystemExit, match="--mesh with a 'context' axis.*not supported for "
                                       "DeepSeek-V4"):
    cli.main(["generate", "--checkpoint", str(path), "--mesh", "context=8"])


def test_v3_loader_points_v4_checkpoints_to_their_loader(saved):
  from mla_jax.checkpoints import load_pretrained as load_v3

  with pytest.raises(CheckpointError, match="mla_jax.v4.load_pretrained"):
    load_v3(saved[1])


# What DeepSeek's V4 releases store in fp8: the attention's and the experts' projections (the
# compressors, the indexer's compressor and its head weights stay bf16, as HF notes).
_V4_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|experts\.\d+\.w[123]|"
                     r"shared_experts\.w[123])\.weight$")


@pytest.mark.parametrize("scale_suffix", ["weight_scale_inv", "scale"])
def test_fp8_weights_are_dequantized_by_their_blocks(saved, tmp_path, scale_suffix):
  """fp8 projections with 16 x 16 block scales (HF's or DeepSeek's name for them) load as the
  model whose weights are their dequantized values: within float32 rounding of it, and
  within fp8's error of the model they were quantized from."""
  model, path = saved
  tensors = {name: h.read() for name, h in open_checkpoint(path).items()}
  quantized = [n for n in tensors if _V4_FP8.search(n)]
  assert len(quantized) > 50
  exact = dict(tensors)
  for name in quantized:
    values, scale = quantize_fp8(tensors[name], (16, 16))
    tensors[name] = values
    tensors[name.removesuffix("weight") + scale_suffix] = scale
    exact[name] = dequantize_fp8_blocks(values, scale, (16, 16))
  hf = json.loads((path / "config.json").read_text())
  for directory, weights, quantization in ((tmp_path / "fp8", tensors, True),
                                           (tmp_path / "exact", exact, False)):
    directory.mkdir()
    write_safetensors(weights, directory / "model.safetensors")
    config = dict(hf, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                           "weight_block_size": [16, 16]}) if quantization else hf
    (directory / "config.json").write_text(json.dumps(config))
  fp8, exact = (load_pretrained(tmp_path / d, dtype=jnp.float32, backend="xla")
                for d in ("fp8", "exact"))
  ids = jnp.asarray(np.arange(33)[None] * 7 % 256, jnp.int32)
  got, want, original = run(fp8, ids), run(exact, ids), run(model, ids)
  assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5
  assert np.max(np.abs(got - original)) / np.max(np.abs(original)) < 6e-2


def test_fp8_weight_without_scales_is_named(saved, tmp_path):
  model, path = saved
  tensors = {name: h.read() for name, h in open_checkpoint(path).items()}
  name = "model.layers.0.attn.wq_a.weight"
  tensors[name] = quantize_fp8(tensors[name], (16, 16))[0]
  write_safetensors(tensors, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(CheckpointError, match=f"{name}: float8 without its scales"):
    load_pretrained(tmp_path, dtype=jnp.float32, backend="xla")


def test_unknown_expert_dtype_is_refused_by_name():
  with pytest.raises(CheckpointError, match="int4 experts are not supported"):
    v4_config_from_hf(hf_config(quantization_config={"quant_method": "fp8"},
                                expert_dtype="int4"))


def test_one_routed_expert_round_trips(tmp_path):
  """A stacked experts' matrix is known by its path, not by its count: one expert too."""
  model = randomize(V4CausalLM(tiny_v4_config(n_routed_experts=1, num_experts_per_tok=1),
                               rngs=nnx.Rngs(0), backend="xla"), 2)
  save_pretrained(model, tmp_path)
  assert open_checkpoint(tmp_path)["model.layers.0.ffn.experts.0.w1.weight"].shape == (32, 64)
  loaded = load_pretrained(tmp_path, dtype=jnp.float32, backend="xla")
  np.testing.assert_array_equal(np.asarray(loaded.model.layers[0].mlp.experts.gate_proj[...]),
                                np.asarray(model.model.layers[0].mlp.experts.gate_proj[...]))
