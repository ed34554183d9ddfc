"""HF checkpoint loading and saving: configs, safetensors, fp8, sharding and every error path.

Every checkpoint is built here in tmp_path from a random model (parameters drawn in NumPy,
norms near 1) with HF key names, so no download is needed.
"""

import dataclasses
import functools
import json
import logging

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from mla_jax.attention import causal_indices
from mla_jax.checkpoints import (CheckpointError, config_from_hf, config_to_hf,
                                 dequantize_fp8_blocks, load_pretrained, open_safetensors,
                                 save_pretrained, write_safetensors)
from mla_jax.config import RopeConfig, YarnConfig
from mla_jax.models.hf_layout import hf_params
from mla_jax.routing import PrefillRoute
from tests.checkpoint_models import TOPK, random_model, small_config
from tests.helpers import layer_by_layer, patch_hf_config

def _read_all(path):
  return {name: handle.read() for name, handle in open_safetensors(path).items()}


@functools.partial(nnx.jit, static_argnames=("num_cached",))
def _step(model, ids, caches, num_cached):
  return model(ids, caches, num_cached_tokens=num_cached)


def _logits(model, ids):
  return np.asarray(_step(model, ids, model.init_cache(ids.shape[0], 16), 0)[0])


def _ids(t=12, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 64, (1, t)), jnp.int32)


def _assert_same_params(a, b):
  fa, fb = hf_params(a), hf_params(b)
  assert sorted(fa) == sorted(fb)
  for name in fa:
    assert fa[name].dtype == fb[name].dtype, name
    np.testing.assert_array_equal(np.asarray(fa[name]), np.asarray(fb[name]), err_msg=name)


@pytest.fixture
def ds32_dir(tmp_path):
  model = random_model(small_config("ds32"))
  save_pretrained(model, tmp_path / "ckpt")
  return model, tmp_path / "ckpt"


# ---- load / run / round trip ------------------------------------------------------------------

@pytest.mark.parametrize("kind,model_type", [("ds32", "deepseek_v32"), ("glm", "glm_moe_dsa"),
                                             ("v3", "deepseek_v3")])
def test_round_trip_runs_and_is_bitwise(tmp_path, kind, model_type):
  source = random_model(small_config(kind), seed=1)
  save_pretrained(source, tmp_path / "a")
  hf = json.loads((tmp_path / "a" / "config.json").read_text())
  assert hf["model_type"] == model_type
  loaded = load_pretrained(tmp_path / "a", dtype=jnp.float32)
  assert loaded.config == source.config
  _assert_same_params(source, loaded)
  assert loaded.grouped_matmul == "tiled"  # "auto" on a CPU
  ragged = load_pretrained(tmp_path / "a", dtype=jnp.float32, grouped_matmul="ragged_dot")
  assert ragged.grouped_matmul == "ragged_dot"
  np.testing.assert_allclose(_logits(ragged, _ids()), _logits(source, _ids()), rtol=1e-5,
                             atol=1e-5)
  logits = _logits(loaded, _ids())
  assert np.isfinite(logits).all()
  np.testing.assert_array_equal(logits, _logits(source, _ids()))
  save_pretrained(loaded, tmp_path / "b")
  again = load_pretrained(tmp_path / "b", dtype=jnp.float32)
  assert again.config == loaded.config
  _assert_same_params(loaded, again)
  for name in ("model.safetensors", "config.json"):
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_handwritten_glm52_style_config_with_mtp_keys(tmp_path):
  """HF style by hand: nested rope_theta, indexer_types, head_dim = rope dim, an MTP layer."""
  expected = small_config("glm")
  hf = {
      "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
      "dtype": "bfloat16", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
      "num_hidden_layers": 3, "num_nextn_predict_layers": 1, "num_attention_heads": 2,
      "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
      "qk_rope_head_dim": 16, "head_dim": 16, "qk_head_dim": 32, "v_head_dim": 16,
      "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-5,
      "max_position_embeddings": 256, "rope_interleave": True,
      "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
      "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
      "topk_group": 1, "moe_intermediate_size": 32, "routed_scaling_factor": 2.5,
      "norm_topk_prob": True, "mlp_layer_types": ["dense", "sparse", "sparse"],
      "index_n_heads": 2, "index_head_dim": 32, "index_topk": TOPK,
      "index_topk_pattern": None, "indexer_types": ["full", "shared", "full", "full"],
      "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 0,
  }
  assert config_from_hf(hf) == dataclasses.replace(expected, num_mtp_layers=1)
  source = random_model(expected, seed=2, round_to=ml_dtypes.bfloat16)
  tensors = {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in hf_params(source).items()}
  assert not any(".1.self_attn.indexer." in k for k in tensors)  # shared: no indexer weights
  tensors["model.layers.3.eh_proj.weight"] = np.ones((64, 128), ml_dtypes.bfloat16)
  tensors["model.layers.3.self_attn.indexer.wk.weight"] = np.ones((7,), ml_dtypes.bfloat16)
  write_safetensors(tensors, tmp_path / "model.safetensors", {"format": "pt"})
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(CheckpointError, match=r"model\.layers\.3\.hnorm\.weight"):
    load_pretrained(tmp_path, dtype=jnp.float32)  # not a loadable MTP layer
  loaded = load_pretrained(tmp_path, dtype=jnp.float32, mtp=False)  # skipped, as HF does
  _assert_same_params(source, loaded)
  np.testing.assert_array_equal(_logits(loaded, _ids()), _logits(source, _ids()))


def test_sharded_checkpoint(tmp_path, ds32_dir):
  source, _ = ds32_dir
  save_pretrained(source, tmp_path / "s", max_shard_bytes=20_000)
  index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and not (tmp_path / "s" / "model.safetensors").exists()
  _assert_same_params(source, load_pretrained(tmp_path / "s", dtype=jnp.float32))
  index_file = tmp_path / "s" / "model.safetensors.index.json"
  good = index_file.read_text()
  index["weight_map"]["lm_head.weight"] = shards[-1] if index["weight_map"][
      "lm_head.weight"] != shards[-1] else shards[0]
  index_file.write_text(json.dumps(index))
  with pytest.raises(CheckpointError, match="places tensor 'lm_head.weight' in .*which does "
                                            "not hold it"):
    load_pretrained(tmp_path / "s")
  index_file.write_text(good)
  (tmp_path / "s" / shards[1]).unlink()
  with pytest.raises(CheckpointError, match=f"shard '{shards[1]}' does not exist"):
    load_pretrained(tmp_path / "s")


def test_dtype_cast_keeps_router_and_weights_proj_fp32(tmp_path, ds32_dir):
  _, path = ds32_dir
  model = load_pretrained(path)  # bfloat16 unless asked otherwise
  dtypes = {name: value.dtype for name, value in hf_params(model).items()}
  fp32 = {name for name, d in dtypes.items() if d == jnp.float32}
  assert fp32 == {n for n in dtypes if n.endswith(("weights_proj.weight", "mlp.gate.weight",
                                                   "e_score_correction_bias"))}
  save_pretrained(model, tmp_path / "bf16")
  assert open_safetensors(tmp_path / "bf16" / "model.safetensors")[
      "lm_head.weight"].st_dtype == "BF16"
  _assert_same_params(model, load_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16))


# ---- fp8 ------------------------------------------------------------------------------------

def _quantize(w, block=128):
  """Per-block amax / 448 scales and the e4m3 weight, as DeepSeek's fp8 release stores them."""
  rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
  scale = np.ones((rows, cols), np.float32)
  q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
  for i in range(rows):
    for j in range(cols):
      tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
      scale[i, j] = max(np.abs(tile).max(), 1e-4) / 448.0
      q[i * block:(i + 1) * block, j * block:(j + 1) * block] = tile / scale[i, j]
  return q, scale


def _dequantize_loop(q, scale, block=128):
  out = np.zeros(q.shape, np.float32)
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
      out[rows, cols] = q[rows, cols].astype(np.float32) * scale[i, j]
  return out


def test_fp8_block_dequantization_ragged_edges():
  w = np.random.default_rng(0).standard_normal((200, 130)).astype(np.float32)
  q, scale = _quantize(w)
  assert scale.shape == (2, 2)
  out = dequantize_fp8_blocks(q, scale)
  np.testing.assert_array_equal(out, _dequantize_loop(q, scale))
  np.testing.assert_allclose(out, w, rtol=0.07, atol=scale.max())
  np.testing.assert_array_equal(dequantize_fp8_blocks(q, scale[:1, :1] * 0 + 2, (256, 256)),
                                q.astype(np.float32) * 2)


def test_fp8_checkpoint_loads_dequantized(tmp_path, ds32_dir):
  source, path = ds32_dir
  tensors = _read_all(path / "model.safetensors")
  expected = dict(tensors)
  for name in [n for n in tensors if n.endswith("proj.weight") and "weights_proj" not in n]:
    q, scale = _quantize(tensors[name], block=16)
    tensors[name], tensors[name + "_scale_inv"] = q, scale
    expected[name] = _dequantize_loop(q, scale, block=16)
  hf = json.loads((path / "config.json").read_text())
  hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  write_safetensors(tensors, tmp_path / "model.safetensors")
  loaded = hf_params(load_pretrained(tmp_path, dtype=jnp.float32))
  for name, value in expected.items():
    np.testing.assert_array_equal(np.asarray(loaded[name]), value, err_msg=name)
  del tensors["lm_head.weight"]
  tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = np.ones((3, 3), np.float32)
  write_safetensors(tensors, tmp_path / "model.safetensors")
  with pytest.raises(CheckpointError) as err:
    load_pretrained(tmp_path)
  assert "lm_head.weight" in str(err.value) and "(3, 3) != expected (4, 2)" in str(err.value)


# ---- errors: checkpoints ------------------------------------------------------------------

def test_all_mismatches_reported_together(tmp_path, ds32_dir):
  _, path = ds32_dir
  tensors = _read_all(path / "model.safetensors")
  del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
  tensors["model.layers.0.self_attn.bogus.weight"] = np.zeros((2, 2), np.float32)
  tensors["model.layers.0.self_attn.q_a_proj.weight"] = np.zeros((32, 65), np.float32)
  write_safetensors(tensors, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(CheckpointError) as err:
    load_pretrained(tmp_path)
  message = str(err.value)
  assert "missing (1)" in message and "model.layers.1.mlp.experts.3.up_proj.weight" in message
  assert "unexpected (1)" in message and "model.layers.0.self_attn.bogus.weight" in message
  assert ("model.layers.0.self_attn.q_a_proj.weight: checkpoint shape (32, 65) != model "
          "shape (32, 64)") in message


def test_unknown_model_type_and_unsupported_fields(tmp_path, ds32_dir):
  _, path = ds32_dir
  hf = json.loads((path / "config.json").read_text())
  for change, pattern in [({"model_type": "llama"}, "deepseek_v32, glm_moe_dsa, deepseek_v3"),
                          ({"tie_word_embeddings": True}, "untied"),
                          ({"q_lora_rank": None}, "'q_lora_rank' is null; HF's "
                                                  "DeepseekV32Config requires an int"),
                          ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
                          ({"attention_bias": True}, "attention_bias"),
                          ({"hidden_size": "64"}, "'hidden_size' must be an int"),
                          ({"num_hidden_layers": None}, "num_hidden_layers"),
                          ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1.0}},
                           "rope_type='linear' is not supported")]:
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(CheckpointError, match=pattern) as err:
      load_pretrained(tmp_path)
    assert "config.json" in str(err.value)


def test_pickle_only_directory_refused(tmp_path, ds32_dir):
  _, path = ds32_dir
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(CheckpointError, match="no model.safetensors"):
    load_pretrained(tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
  with pytest.raises(CheckpointError, match="safetensors only"):
    load_pretrained(tmp_path)


def test_truncated_safetensors(tmp_path, ds32_dir):
  _, path = ds32_dir
  raw = (path / "model.safetensors").read_bytes()
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  for size, pattern in [(len(raw) - 3, "run past the data buffer"), (5, "truncated file")]:
    (tmp_path / "model.safetensors").write_bytes(raw[:size])
    with pytest.raises(CheckpointError, match=pattern) as err:
      load_pretrained(tmp_path)
    assert "model.safetensors" in str(err.value)


# ---- config mapping -----------------------------------------------------------------------

def _hf(kind="glm", **changes):
  """``small_config(kind)`` as HF writes it, with ``changes``; a change to None removes a key."""
  return patch_hf_config(config_to_hf(small_config(kind)), missing=None, **changes)


def test_indexer_rope_interleave_default_and_override():
  assert config_from_hf(_hf("ds32", indexer_rope_interleave=None)).mla.indexer.rope_interleave \
      is False
  assert config_from_hf(_hf("glm", indexer_rope_interleave=None)).mla.indexer.rope_interleave
  assert config_from_hf(_hf("ds32", indexer_rope_interleave=True)).mla.indexer.rope_interleave
  assert not config_from_hf(_hf("glm", indexer_rope_interleave=False)).mla.indexer.rope_interleave
  assert config_from_hf(_hf("v3")).mla.indexer is None


def test_rope_theta_locations_and_yarn(caplog):
  caplog.set_level(logging.WARNING, logger="mla_jax")
  assert config_from_hf(_hf(rope_parameters={"rope_theta": 8e6})).mla.rope == RopeConfig(8e6)
  assert config_from_hf(_hf(rope_parameters=None, rope_theta=5e5)).mla.rope == RopeConfig(5e5)
  assert config_from_hf(_hf(rope_parameters=None)).mla.rope == RopeConfig(10000.0)  # HF default
  assert not caplog.records
  # Both given and different: the nested value wins, as in HF, with a warning.
  assert config_from_hf(_hf(rope_parameters={"rope_theta": 1e4}, rope_theta=2e4)
                        ).mla.rope == RopeConfig(1e4)
  assert "top-level rope_theta=20000.0 is ignored" in caplog.text
  legacy = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
  rope = config_from_hf(_hf(rope_parameters=None, rope_theta=10000, rope_scaling=legacy)).mla.rope
  assert rope == RopeConfig(10000.0, YarnConfig(factor=40.0))
  # HF: without mscale_all_dim the softmax scale is unscaled and cos/sin use mscale(factor, 1).
  bare = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
          "original_max_position_embeddings": 64}
  yarn = config_from_hf(_hf(rope_parameters=bare)).mla.rope.yarn
  assert (yarn.mscale, yarn.mscale_all_dim, yarn.beta_fast, yarn.beta_slow) == (1, 0, 32, 1)


def test_indexer_schedules():
  def types(**fields):
    base = {"indexer_types": None, "num_hidden_layers": 10, "mlp_layer_types": None,
            "layer_types": None}
    return config_from_hf(_hf(**{**base, **fields})).indexer_types

  # GLM-5.2's freq 4 / offset 3: layers 0-2 full, then every 4th from layer 6.
  assert types(index_topk_freq=4, index_skip_topk_offset=3) == tuple(
      "full" if l in (0, 1, 2, 6) else "shared" for l in range(10))
  assert types(index_topk_freq=2) == ("full", "full", "shared", "full", "shared", "full",
                                      "shared", "full", "shared", "full")  # default offset 2
  assert types(index_topk_pattern="FFSSFSSSSF") == tuple(
      "full" if c == "F" else "shared" for c in "FFSSFSSSSF")
  assert types() is None and types(index_topk_freq=1) is None
  assert types(indexer_types=["full"] * 10 + ["full"]) is None  # a trailing MTP entry
  with pytest.raises(CheckpointError, match="starting with a 'full' layer"):
    types(index_topk_pattern="SFFFFFFFFF")
  with pytest.raises(CheckpointError, match="9 entries for 10 layers"):
    types(index_topk_pattern="F" * 9)


def test_mlp_layer_types_and_head_dim():
  assert config_from_hf(_hf(first_k_dense_replace=None)).first_k_dense_replace == 1
  assert config_from_hf(_hf(mlp_layer_types=None, first_k_dense_replace=2)
                        ).first_k_dense_replace == 2
  with pytest.raises(CheckpointError, match="the 'dense' layers then the 'sparse' ones"):
    config_from_hf(_hf(mlp_layer_types=["sparse", "dense", "sparse"]))
  assert config_from_hf(_hf(head_dim=99)) == small_config("glm")  # HF's head_dim is ignored


def test_config_to_hf_refuses_what_hf_cannot_express():
  config = small_config("ds32")
  odd = dataclasses.replace(config, mla=dataclasses.replace(
      config.mla, indexer=dataclasses.replace(config.mla.indexer, norm_eps=1e-5)))
  with pytest.raises(ValueError, match="indexer.norm_eps"):
    config_to_hf(odd)
  with pytest.raises(ValueError, match="does not fit a model with an indexer"):
    config_to_hf(config, "deepseek_v3")
  assert config_to_hf(config, "glm_moe_dsa")["indexer_rope_interleave"] is False
  # HF's latent norms use eps 1e-6 whatever rms_norm_eps says (vLLM/SGLang differ).
  vllm_like = dataclasses.replace(config, mla=dataclasses.replace(config.mla,
                                                                  latent_norm_eps=1e-5))
  with pytest.raises(ValueError, match="latent_norm_eps=1e-05 cannot be expressed"):
    config_to_hf(vllm_like)
  shared = dataclasses.replace(config, indexer_types=("full", "shared"))
  with pytest.raises(ValueError, match="use model_type='glm_moe_dsa'"):
    config_to_hf(shared, "deepseek_v32")
  assert config_from_hf(config_to_hf(shared)) == shared  # glm_moe_dsa by default


# ---- GLM IndexShare semantics after loading ------------------------------------------------

@nnx.jit
def _unrolled(model, ids):
  """Logits with each shared layer fed (a) its full layer's top-k, (b) every causal row."""
  every_row = causal_indices(jnp.arange(ids.shape[1])[None], 16)
  return [layer_by_layer(model, ids, 16), layer_by_layer(model, ids, 16, every_row)]


def test_glm_shared_layers_use_the_full_layers_topk(tmp_path):
  save_pretrained(random_model(small_config("glm"), seed=3), tmp_path)
  model = load_pretrained(tmp_path, dtype=jnp.float32)
  assert [model.layer_module(i).self_attn.indexer is None for i in range(3)] == [False, True,
                                                                                False]
  ids = _ids(12, seed=4)
  own_topk, all_rows = (np.asarray(x) for x in _unrolled(model, ids))
  logits = _logits(model, ids)
  np.testing.assert_allclose(logits, own_topk, rtol=1e-6, atol=1e-6)
  assert np.abs(logits - all_rows).max() > 1e-3  # the top-k really matters at T=12, K=4


def test_dense_capable_short_prefill_matches_mqa_only(tmp_path):
  """All layers take dense MHA for T <= top-k; the next decode step must still see the
  indexer keys that prefill wrote (no stale or missing indices in the shared layer)."""
  save_pretrained(random_model(small_config("glm"), seed=5), tmp_path)
  ids = _ids(12, seed=6)
  # mqa-only; causal, so prefixes agree
  reference = _logits(load_pretrained(tmp_path, dtype=jnp.float32), ids)
  model = load_pretrained(tmp_path, dtype=jnp.float32, attention="dense-capable")
  assert set(model.prefill_routes(TOPK, 0)) == {PrefillRoute.DENSE_MHA}
  prefill, caches = _step(model, ids[:, :TOPK], model.init_cache(1, 16), 0)
  decode, _ = _step(model, ids[:, TOPK:TOPK + 1], caches, None)  # 5 keys > top-k 4
  np.testing.assert_allclose(np.asarray(prefill), reference[:, :TOPK], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(decode)[:, 0], reference[:, TOPK], rtol=1e-5,
                             atol=1e-5)


def test_stacked_experts_take_each_hf_expert_tensor_in_its_own_slot(tmp_path):
  """Per-expert HF tensors written straight to safetensors (not through the mapping code):
  each lands in its own stacked slice, [layer rep, expert], gate as gate and up as up, and the
  loaded MoE layer computes HF's formula (float64 NumPy). A load/save round trip cannot see a
  gate/up swap: both directions would swap alike."""
  from safetensors.numpy import save_file

  from tests.test_moe import ref_moe, ref_route

  config = dataclasses.replace(small_config("v3"), num_layers=3)  # MoE layers 1, 2: 2 reps
  save_pretrained(random_model(config, seed=3), tmp_path)
  tensors = {}
  for file in sorted(tmp_path.glob("*.safetensors")):
    tensors.update(_read_all(file))
    file.unlink()
  for stale in tmp_path.glob("*.index.json"):
    stale.unlink()
  moe = config.moe
  e_count, f, d = moe.num_experts, moe.moe_intermediate_size, config.mla.hidden_size
  rng = np.random.default_rng(7)
  shapes = {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
  for layer in (1, 2):
    for e in range(e_count):
      for proj, shape in shapes.items():
        name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        assert name in tensors  # the HF names the checkpoint must use
        scale = {"gate_proj": 1.0, "up_proj": 0.5, "down_proj": 0.2}[proj]
        tensors[name] = (scale * rng.standard_normal(shape) / np.sqrt(shape[1])).astype(
            np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

  model = load_pretrained(tmp_path, dtype=jnp.float32, backend="xla")
  x = rng.standard_normal((1, 16, d)).astype(np.float32)
  for layer in (1, 2):
    prefix = f"model.layers.{layer}.mlp."
    mlp = model.layer_module(layer).mlp
    for proj in shapes:
      stacked = np.asarray(getattr(mlp.experts, proj)[...])  # [E, out, in]
      for e in range(e_count):
        np.testing.assert_array_equal(stacked[e], tensors[f"{prefix}experts.{e}.{proj}.weight"],
                                      err_msg=f"layer {layer} {proj} expert {e}")
    params = {n[len(prefix):]: np.asarray(v, np.float64) for n, v in tensors.items()
              if n.startswith(prefix)}
    chosen, _ = ref_route(x[0].astype(np.float64) @ params["gate.weight"].T,
                          params["gate.e_score_correction_bias"], moe)
    assert set(chosen.ravel()) == set(range(e_count))  # every expert's weights are used
    got = np.asarray(nnx.jit(lambda m, x: m(x))(mlp, jnp.asarray(x)))[0]
    want = ref_moe(x, params, moe)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5, layer
