"""Multi-token prediction layers: the module's math against float64 NumPy, its caches, the
routing contract on its traced program, loading and saving (fp32 and fp8, bitwise), the
errors, the plan's bytes and a full-size DeepSeek-V3.2 model with its MTP layer as shapes."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mla_jax import plan as plan_lib
from mla_jax import sharding
from mla_jax.checkpoints import (CheckpointError, config_from_hf, config_to_hf, load_pretrained,
                                 open_checkpoint, save_pretrained, write_safetensors)
from mla_jax.models.config import deepseek_v32_lm
from mla_jax.models.hf_layout import hf_params, hf_shapes
from mla_jax.models.lm import CausalLM
from mla_jax.quant import BlockScaledWeight
from mla_jax.routing import PrefillRoute
from mla_jax.traces import summarize
from pallas_kernels.fp8_rows import Fp8LatentRows
from tests.checkpoint_models import random_model, small_config, write_fp8_checkpoint

ROUTES = {route.scope for route in PrefillRoute}


def _config(kind="ds32", attention="mqa-only", mtp=1):
  return dataclasses.replace(small_config(kind, attention), num_mtp_layers=mtp)


@functools.lru_cache(maxsize=None)
def _model(kind="ds32", attention="mqa-only", mtp=1, seed=0):
  return random_model(_config(kind, attention, mtp), seed=seed)


def _ids(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 64, shape), jnp.int32)


@functools.partial(nnx.jit, static_argnames=("index",))
def _mtp(model, index, hidden, next_ids, caches, new_lens):
  return model.mtp_forward(index, hidden, next_ids, caches, new_lens_B=new_lens)


@nnx.jit
def _main(model, ids, caches):
  logits, _, hidden = model(ids, caches, num_cached_tokens=0, return_hidden=True)
  return logits, hidden


@functools.partial(nnx.jit, static_argnames=("plan",))
def _block(block, x, cache, new_lens, plan):
  return block.forward(x, cache, plan, new_lens_B=new_lens)[0]


def _main_hidden(model, ids):
  return _main(model, ids, model.init_cache(ids.shape[0], 16))


def _rms64(x, w, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


# ---- the module ------------------------------------------------------------------------------

def test_structure_follows_the_config():
  config = _config("glm")  # IndexShare main layers; the MTP layer indexes on its own
  model = _model("glm")
  (layer,) = model.mtp
  assert layer.block.self_attn.indexer is not None and not layer.block.self_attn.shares_topk
  assert type(layer.block.mlp).__name__ == "MoE"  # layer 3 >= first_k_dense_replace
  assert tuple(layer.eh_proj.weight.shape) == (64, 128)
  names = {n for n in hf_shapes(nnx.state(model)) if n.startswith("model.layers.3.")}
  assert {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
          "model.layers.3.hnorm.weight", "model.layers.3.shared_head.norm.weight",
          "model.layers.3.self_attn.indexer.wk.weight",
          "model.layers.3.mlp.experts.3.down_proj.weight"} <= names
  assert not any("block" in n or "embed_tokens" in n or "shared_head.head" in n for n in names)
  plain = nnx.eval_shape(lambda: CausalLM(dataclasses.replace(config, num_mtp_layers=0),
                                          rngs=nnx.Rngs(0)))
  assert len(plain.mtp) == 0 and plain.init_mtp_cache(1, 8) == ()
  assert set(hf_shapes(nnx.state(model))) - set(hf_shapes(nnx.state(plain))) == names
  # One group per layer instead of the scanned groups: the same HF names and shapes.
  unscanned = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), scan_layers=False))
  assert hf_shapes(nnx.state(unscanned)) == hf_shapes(nnx.state(model))


def test_return_hidden_is_what_the_head_reads():
  model = _model()
  ids = _ids((2, 6))
  caches = model.init_cache(2, 16)
  default = nnx.jit(lambda m, i, c: m(i, c, num_cached_tokens=0))(model, ids, caches)
  assert len(default) == 2
  logits, hidden = _main(model, ids, caches)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(default[0]))
  head = hf_params(model)["lm_head.weight"].astype(np.float64)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(hidden, np.float64) @ head.T,
                             rtol=1e-5, atol=1e-5)


def test_mtp_math_matches_float64_numpy():
  model, config = _model(), _config()
  ids = _ids((2, 7))
  _, hidden = _main_hidden(model, ids)
  hidden, next_ids = hidden[:, :-1], ids[:, 1:]
  caches = model.init_mtp_cache(2, 16)
  new_lens = jnp.full((2,), 6, jnp.int32)
  logits, mtp_hidden, new_caches = _mtp(model, 0, hidden, next_ids, caches, new_lens)
  p, eps, n = hf_params(model), config.rms_norm_eps, config.num_layers
  emb = p["model.embed_tokens.weight"].astype(np.float64)[np.asarray(next_ids)]
  # vLLM's order: the token's embedding first, then the main model's hidden state.
  x_ref = np.concatenate([_rms64(emb, p[f"model.layers.{n}.enorm.weight"], eps),
                          _rms64(hidden, p[f"model.layers.{n}.hnorm.weight"], eps)], -1)
  x_ref = x_ref @ p[f"model.layers.{n}.eh_proj.weight"].astype(np.float64).T
  h_block = _block(model.mtp[0].block, jnp.asarray(x_ref, jnp.float32), caches[0], new_lens,
                   plan=model.step_plan(6, 0, capacity=16))
  np.testing.assert_allclose(np.asarray(mtp_hidden), np.asarray(h_block), rtol=1e-4, atol=1e-5)
  logits_ref = (_rms64(mtp_hidden, p[f"model.layers.{n}.shared_head.norm.weight"], eps)
                @ p["lm_head.weight"].astype(np.float64).T)
  np.testing.assert_allclose(np.asarray(logits), logits_ref, rtol=1e-5, atol=1e-5)
  assert logits.dtype == jnp.float32 and mtp_hidden.shape == hidden.shape
  np.testing.assert_array_equal(np.asarray(new_caches[0].num_cached_B), [6, 6])


def test_step_by_step_equals_all_at_once_with_ragged_lengths():
  """T pairs in one call, one pair per call on the growing cache (a draft loop's shape), or
  rolled back and written again (a rejected draft)."""
  model = _model()
  ids = _ids((2, 6), seed=3)
  _, hidden = _main_hidden(model, ids)
  hidden, next_ids = hidden[:, :-1], ids[:, 1:]
  lens = jnp.asarray([5, 3], jnp.int32)
  full, _, full_caches = _mtp(model, 0, hidden, next_ids, model.init_mtp_cache(2, 16), lens)
  caches = model.init_mtp_cache(2, 16)
  for t in range(5):
    step_lens = (lens > t).astype(jnp.int32)
    logits, _, caches = _mtp(model, 0, hidden[:, t:t + 1], next_ids[:, t:t + 1], caches,
                             step_lens)
    for b in range(2):
      if t < int(lens[b]):
        np.testing.assert_allclose(np.asarray(logits[b, 0]), np.asarray(full[b, t]),
                                   rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(full_caches[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(caches[0].num_cached_B), [5, 3])
  # Roll back to 2 pairs (a rejected draft) and write the rest again over the stale rows.
  rolled = (dataclasses.replace(full_caches[0], num_cached_B=jnp.full((2,), 2, jnp.int32)),)
  again, _, rolled = _mtp(model, 0, hidden[:, 2:], next_ids[:, 2:], rolled, lens - 2)
  np.testing.assert_allclose(np.asarray(again[0]), np.asarray(full[0, 2:]), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(again[1, :1]), np.asarray(full[1, 2:3]), rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_array_equal(np.asarray(rolled[0].num_cached_B), [5, 3])


def test_fp8_mtp_cache_stays_close_to_float32():
  model = _model()
  ids = _ids((1, 6), seed=4)
  _, hidden = _main_hidden(model, ids)
  lens = jnp.full((1,), 5, jnp.int32)
  args = (hidden[:, :-1], ids[:, 1:])
  exact = np.asarray(_mtp(model, 0, *args, model.init_mtp_cache(1, 16), lens)[0])
  fp8_caches = model.init_mtp_cache(1, 16, "fp8")
  logits, _, fp8_caches = _mtp(model, 0, *args, fp8_caches, lens)
  assert isinstance(fp8_caches[0].latent_BSL, Fp8LatentRows)  # e4m3 rows (held as bits)
  assert np.abs(np.asarray(logits) - exact).max() < 0.05 * np.abs(exact).max()


def test_bad_mtp_inputs_are_refused_by_name():
  model = _model()
  ids, hidden = _ids((1, 3)), jnp.zeros((1, 3, 64))
  caches = model.init_mtp_cache(1, 8)
  with pytest.raises(ValueError, match=r"MTP layer index must be an int in \[0, 1\)"):
    model.mtp_forward(1, hidden, ids, caches)
  with pytest.raises(ValueError, match="mtp_caches must be init_mtp_cache's tuple"):
    model.mtp_forward(0, hidden, ids, model.init_cache(1, 8))
  with pytest.raises(ValueError, match=r"hidden must be \[batch, tokens, 64\]"):
    model.mtp_forward(0, hidden[:, :2], ids, caches)
  with pytest.raises(ValueError, match="next_ids must be an int array"):
    model.mtp_forward(0, hidden, ids.astype(jnp.float32), caches)


# ---- routing ---------------------------------------------------------------------------------

def _mtp_summary(model, plan, length=3):
  ids, hidden = _ids((1, length)), jnp.zeros((1, length, 64))
  program = nnx.jit(lambda m, h, i, c: m.mtp_forward(0, h, i, c, plan=plan)[0])
  return summarize(program, model, hidden, ids, model.init_mtp_cache(1, 16))


@pytest.mark.parametrize("length", [3, 5])  # within top-k (4) and past it
def test_mqa_only_mtp_layer_never_compiles_a_dense_branch(length):
  mqa, dense = _model(attention="mqa-only"), _model(attention="dense-capable")
  summary = _mtp_summary(mqa, mqa.step_plan(length, 0, capacity=16), length)
  assert summary.scopes & ROUTES == {"mla_sparse_mqa"} and "cond" not in summary.primitives
  # The same static counts on a dense-capable model do take an MHA route (the test can fail).
  expected = "mla_dense_mha" if length <= 4 else "mla_masked_mha"
  assert _mtp_summary(dense, dense.step_plan(length, 0, capacity=16), length).scopes & ROUTES \
      == {expected}
  with pytest.raises(ValueError, match="resolved for"):
    _mtp_summary(mqa, dense.step_plan(length, 0, capacity=16), length)


# ---- checkpoints -----------------------------------------------------------------------------

def _assert_same_params(a, b):
  fa, fb = hf_params(a), hf_params(b)
  assert sorted(fa) == sorted(fb)
  for name in fa:
    assert fa[name].dtype == fb[name].dtype and fa[name].tobytes() == fb[name].tobytes(), name


def _mtp_logits(model):
  ids = _ids((1, 5), seed=7)
  _, hidden = _main_hidden(model, ids)
  lens = jnp.full((1,), 4, jnp.int32)
  return np.asarray(_mtp(model, 0, hidden[:, :-1], ids[:, 1:], model.init_mtp_cache(1, 16),
                         lens)[0])


@pytest.mark.parametrize("kind", ["glm", "v3"])  # ds32: the fp8 test below
def test_round_trip_with_mtp_layers_is_bitwise(tmp_path, kind):
  source = _model(kind)
  save_pretrained(source, tmp_path / "a")
  hf = json.loads((tmp_path / "a" / "config.json").read_text())
  n = source.config.num_layers
  assert hf["num_nextn_predict_layers"] == 1
  if kind == "glm":
    assert hf["indexer_types"] == ["full", "shared", "full", "full"]  # GLM lists the MTP layer
  assert config_from_hf(hf) == source.config == config_from_hf(config_to_hf(source.config))
  stored = open_checkpoint(tmp_path / "a")
  # DeepSeek's layout: each MTP layer stores copies of the embedding and the head.
  for copy, original in ((f"model.layers.{n}.embed_tokens.weight", "model.embed_tokens.weight"),
                         (f"model.layers.{n}.shared_head.head.weight", "lm_head.weight")):
    assert stored[copy].read().tobytes() == stored[original].read().tobytes()
  loaded = load_pretrained(tmp_path / "a", dtype=jnp.float32, backend="xla")
  assert loaded.config == source.config
  _assert_same_params(source, loaded)
  np.testing.assert_array_equal(_mtp_logits(loaded), _mtp_logits(source))
  save_pretrained(loaded, tmp_path / "b")
  _assert_same_params(loaded, load_pretrained(tmp_path / "b", dtype=jnp.float32))
  for name in ("model.safetensors", "config.json"):
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_fp8_checkpoint_with_mtp_layers_round_trips_bitwise(tmp_path):
  write_fp8_checkpoint(_model(), tmp_path / "fp8", block=(16, 16))
  # float32 for what is not fp8, as stored: the saved file can then hold the same tensors.
  model = load_pretrained(tmp_path / "fp8", dtype="fp8", compute_dtype=jnp.float32,
                          backend="xla")
  assert isinstance(model.mtp[0].block.self_attn.q_b_proj.weight, BlockScaledWeight)
  save_pretrained(model, tmp_path / "out")
  a, b = open_checkpoint(tmp_path / "fp8"), open_checkpoint(tmp_path / "out")
  assert sorted(a) == sorted(b) and "model.layers.2.mlp.experts.0.up_proj.weight_scale_inv" in a
  for name in a:
    assert a[name].st_dtype == b[name].st_dtype, name
    assert a[name].read().tobytes() == b[name].read().tobytes(), name
  again = load_pretrained(tmp_path / "out", dtype="fp8", compute_dtype=jnp.float32,
                          backend="xla")
  _assert_same_params(model, again)
  assert np.isfinite(_mtp_logits(again)).all()


def test_missing_mtp_tensors_and_skipping_them(tmp_path):
  plain = _model(mtp=0)
  save_pretrained(plain, tmp_path / "ckpt")
  config_file = tmp_path / "ckpt" / "config.json"
  hf = json.loads(config_file.read_text())
  config_file.write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
  with pytest.raises(CheckpointError, match=r"(?s)missing.*model\.layers\.2\.eh_proj\.weight"
                                            r".*num_nextn_predict_layers=1.*mtp=False"):
    load_pretrained(tmp_path / "ckpt", dtype=jnp.float32, mtp=True)
  # The default (mtp=None) skips MTP layers a checkpoint counts but holds no tensor of, as
  # HF transformers' DeepSeek-V3 saves; mtp=False skips them always.
  for mtp in (None, False):
    skipped = load_pretrained(tmp_path / "ckpt", dtype=jnp.float32, mtp=mtp)
    assert skipped.config.num_mtp_layers == 0 and len(skipped.mtp) == 0
    _assert_same_params(plain, skipped)
  # mtp=False on a checkpoint that has them: the main model alone, as before MTP support.
  save_pretrained(_model(), tmp_path / "with")
  alone = load_pretrained(tmp_path / "with", dtype=jnp.float32, mtp=False)
  assert len(alone.mtp) == 0 and sorted(hf_params(alone)) == sorted(hf_params(plain))


def test_copies_of_the_shared_tensors_must_equal_the_main_ones(tmp_path):
  save_pretrained(_model(), tmp_path / "ckpt")
  tensors = {n: h.read() for n, h in open_checkpoint(tmp_path / "ckpt").items()}
  tensors["model.layers.2.shared_head.head.weight"] = (
      tensors["model.layers.2.shared_head.head.weight"] * 2)
  write_safetensors(tensors, tmp_path / "ckpt" / "model.safetensors", {"format": "pt"})
  with pytest.raises(CheckpointError, match=r"model\.layers\.2\.shared_head\.head\.weight "
                                            r"differs from lm_head\.weight"):
    load_pretrained(tmp_path / "ckpt", dtype=jnp.float32)
  # Without the copies (a checkpoint that never stored them) the layer loads all the same.
  del tensors["model.layers.2.shared_head.head.weight"], tensors[
      "model.layers.2.embed_tokens.weight"]
  write_safetensors(tensors, tmp_path / "ckpt" / "model.safetensors", {"format": "pt"})
  _assert_same_params(_model(), load_pretrained(tmp_path / "ckpt", dtype=jnp.float32))


def test_mtp_layer_loads_and_runs_sharded(tmp_path):
  source = _model()
  save_pretrained(source, tmp_path / "ckpt")
  mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
  model = load_pretrained(tmp_path / "ckpt", dtype=jnp.float32, backend="xla", mesh=mesh)
  block = model.mtp[0].block
  # The partition rules cover the MTP layer by its HF names, experts over 'expert'.
  assert block.self_attn.q_b_proj.weight[...].sharding.spec == P(sharding.TENSOR_RANKS, None)
  assert block.mlp.experts.down_proj[...].sharding.spec == P("expert", None,
                                                              sharding.TENSOR_RANKS)
  assert model.mtp[0].eh_proj.weight[...].sharding.spec == P(None, None)
  caches = model.init_mtp_cache(2, 16)
  assert caches[0].latent_BSL.sharding.spec == P("data", None, None)
  ids = _ids((2, 5), seed=5)
  _, hidden = _main_hidden(source, ids)
  lens = jnp.full((2,), 4, jnp.int32)
  sharded = _mtp(model, 0, hidden[:, :-1], ids[:, 1:], caches, lens)[0]
  plain = _mtp(source, 0, hidden[:, :-1], ids[:, 1:], source.init_mtp_cache(2, 16), lens)[0]
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(plain), rtol=1e-5, atol=1e-5)


def test_a_shared_mtp_indexer_entry_is_refused():
  hf = config_to_hf(_config("glm"))
  with pytest.raises(CheckpointError, match="marks MTP layer 3 'shared'"):
    config_from_hf({**hf, "indexer_types": ["full", "shared", "full", "shared"]})
  with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
    config_from_hf({**hf, "num_nextn_predict_layers": -1})


# ---- full size, shapes only ------------------------------------------------------------------

def _layer_bytes(shapes, prefix):
  return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
             for name, (shape, dtype) in shapes.items() if name.startswith(prefix))


def test_deepseek_v32_with_its_mtp_layer_as_shapes_and_in_the_plan():
  config = dataclasses.replace(deepseek_v32_lm(), num_mtp_layers=1)
  model = plan_lib.abstract_model(config)  # nnx.eval_shape: nothing is allocated
  (layer,) = model.mtp
  assert tuple(layer.eh_proj.weight.shape) == (7168, 14336)
  assert tuple(layer.block.mlp.experts.gate_proj.shape) == (256, 2048, 7168)
  assert tuple(layer.block.self_attn.indexer.wk.weight.shape) == (128, 7168)
  caches = jax.eval_shape(lambda: model.init_mtp_cache(2, 4096, "fp8"))
  assert caches[0].num_cached_B.shape == (2,) and caches[0].index_keys_BSI is not None
  shapes = hf_shapes(nnx.state(model))
  layer_61 = {n[len("model.layers.61."):] for n in shapes if n.startswith("model.layers.61.")}
  layer_60 = {n[len("model.layers.60."):] for n in shapes if n.startswith("model.layers.60.")}
  assert layer_61 - layer_60 == {"enorm.weight", "hnorm.weight", "eh_proj.weight",
                                 "shared_head.norm.weight"} and layer_60 <= layer_61
  mtp_bytes = _layer_bytes(shapes, "model.layers.61.")
  with_mtp = plan_lib.make_plan("deepseek_v32", "tensor=8", mtp_layers=1)
  plain = plan_lib.make_plan("deepseek_v32", "tensor=8")
  assert with_mtp.total_param_bytes - plain.total_param_bytes == mtp_bytes
  assert with_mtp.param_bytes > plain.param_bytes
  assert with_mtp.token_bytes - plain.token_bytes == 576 * 2 + 128 * 2  # one more bf16 layer


def test_cli_plan_counts_mtp_layers(capsys):
  from mla_jax import cli

  assert cli.main(["plan", "--mesh", "tensor=8", "--mtp-layers", "1", "--context", "4096"]) == 0
  out = capsys.readouterr().out
  expected = plan_lib.make_plan("deepseek_v32", "tensor=8", context=4096, mtp_layers=1)
  assert f"deepseek_v32 with 1 MTP layer(s): {expected.total_param_bytes / 2**30:,.1f} GiB" in out
