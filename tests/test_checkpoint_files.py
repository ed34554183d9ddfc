"""Checkpoint files: lazy tensor handles, bad files, atomic saves and config-file checks."""

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from mla_jax.checkpoints import (CheckpointError, load_pretrained, open_checkpoint,
                                 open_safetensors, save_pretrained, write_safetensors)
from mla_jax.checkpoints import writing
from mla_jax.checkpoints.reading import SafetensorsFile
from tests.checkpoint_models import random_model, small_config


@pytest.fixture(scope="module")
def model():
  return random_model(small_config("ds32"), seed=7)


def _snapshot(directory):
  """Every file below ``directory`` with its bytes."""
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(directory.rglob("*")) if p.is_file()}


# ---- tensor handles -------------------------------------------------------------------------

def _all_dtypes():
  rng = np.random.default_rng(0)
  return {"f32": rng.standard_normal((5, 7)).astype(np.float32),
          "f16": rng.standard_normal((4, 3)).astype(np.float16),
          "f64": rng.standard_normal(3),
          "bf16": rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16),
          "e4m3": rng.standard_normal((9, 4)).astype(ml_dtypes.float8_e4m3fn),
          "e5m2": rng.standard_normal((3, 8)).astype(ml_dtypes.float8_e5m2),
          "e8m0": np.exp2(rng.integers(-8, 8, (2, 3))).astype(ml_dtypes.float8_e8m0fnu),
          "i32": np.arange(5, dtype=np.int32), "i64": np.arange(3, dtype=np.int64),
          "i8": np.arange(-3, 3, dtype=np.int8), "u8": np.arange(4, dtype=np.uint8),
          "u16": np.arange(4, dtype=np.uint16), "u64": np.arange(2, dtype=np.uint64),
          "bool": np.array([True, False, True]), "scalar": np.array(2.5, np.float32),
          "empty": np.zeros((0, 4), np.float32), "be": np.arange(6, dtype=">f4").reshape(2, 3)}


def test_every_dtype_round_trips_bitwise_whole_and_sliced(tmp_path):
  tensors = _all_dtypes()
  write_safetensors(tensors, tmp_path / "t.safetensors", {"format": "pt"})
  handles = open_safetensors(tmp_path / "t.safetensors")
  assert sorted(handles) == sorted(tensors)
  assert SafetensorsFile(tmp_path / "t.safetensors").metadata() == {"format": "pt"}
  for name, value in tensors.items():
    handle, expected = handles[name], value.astype(value.dtype.newbyteorder("<"))
    assert handle.dtype == expected.dtype and handle.shape == value.shape, name
    whole = handle.read()
    assert whole.dtype == expected.dtype and whole.tobytes() == expected.tobytes(), name
    if value.ndim == 2:
      for index in [(slice(1, 3), slice(None)), (slice(None), slice(1, None, 2)), (-1,),
                    (Ellipsis, 0), (slice(None, None, -1), slice(0, 2)), (slice(5, 1),),
                    (np.int64(0), slice(-2, None))]:
        try:
          want = expected[index]
        except IndexError:  # out of range for NumPy too
          with pytest.raises(IndexError):
            handle[index]
          continue
        part = handle[index]
        assert part.tobytes() == want.tobytes(), (name, index)
        assert part.shape == want.shape and part.flags.c_contiguous, (name, index)


def test_handles_refuse_bad_indices(tmp_path):
  write_safetensors({"w": np.zeros((2, 3), np.float32)}, tmp_path / "t.safetensors")
  handle = open_safetensors(tmp_path / "t.safetensors")["w"]
  for index, pattern in [((0, 0, 0), "too many indices"), ((2,), "index 2 is out of bounds"),
                         ((..., ...), "single ellipsis"), (([0, 1],), "ints, slices"),
                         ((None,), "ints, slices"), ((True,), "ints, slices")]:
    with pytest.raises(IndexError, match=pattern):
      handle[index]


def test_sharded_checkpoint_opens_only_the_files_it_reads(tmp_path, model):
  save_pretrained(model, tmp_path, max_shard_bytes=20_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
  tensors = open_checkpoint(tmp_path)
  assert sorted(tensors) == sorted(index) and tensors.opened_files == []
  name = "model.layers.1.mlp.experts.2.down_proj.weight"
  handle = tensors[name]
  assert tensors.opened_files == []
  assert handle.shape == (64, 32) and tensors.opened_files == [index[name]]
  np.testing.assert_array_equal(handle[3:5], np.asarray(
      model.layer_module(1).mlp.experts.down_proj[...])[2, 3:5])
  assert tensors.opened_files == [index[name]] and len(set(index.values())) > 2


# ---- bad files ------------------------------------------------------------------------------

def _raw_file(path, header, data=b"", header_len=None):
  raw = json.dumps(header).encode() if isinstance(header, dict) else header
  size = len(raw) if header_len is None else header_len
  path.write_bytes(size.to_bytes(8, "little") + raw + data)
  return path


@pytest.mark.parametrize("header,data,header_len,pattern", [
    (b"", b"", 5, "header length 5 exceeds the file"),
    (b"{}", b"", 2**62, "exceeds the file"),
    (b"{not json", b"", None, "corrupt JSON header"),
    (b"\xff\xfe", b"", None, "corrupt JSON header"),
    (b"[1, 2]", b"", None, "header must be a JSON object, got list"),
    ({"__metadata__": {"a": 1}}, b"", None, "__metadata__ must map strings to strings"),
    ({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None,
     "'w': unknown dtype 'F7'"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None,
     "'w': shape must be a list of ints >= 0"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     r"'w': shape \(3,\) of F32 needs 12 bytes"),
    ({"w": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4, None,
     "'w': data_offsets must be"),
    ({"w": {"dtype": "F32", "shape": [25], "data_offsets": [0, 100]}}, b"\0" * 8, None,
     "'w': data_offsets .* run past the data buffer"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None,
     "'b' overlaps tensor 'a'"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12, None,
     "belong to no tensor"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, None,
     "cover only 4"),
])
def test_corrupt_safetensors(tmp_path, header, data, header_len, pattern):
  path = _raw_file(tmp_path / "bad.safetensors", header, data, header_len)
  with pytest.raises(CheckpointError, match=pattern) as err:
    open_safetensors(path)
  assert "bad.safetensors" in str(err.value)


@pytest.mark.parametrize("content", [b"", b"\x01\x02\x03"])
def test_empty_and_short_files(tmp_path, content):
  (tmp_path / "bad.safetensors").write_bytes(content)
  with pytest.raises(CheckpointError, match=f"bad.safetensors: truncated file "
                                            f"\\({len(content)} bytes"):
    open_safetensors(tmp_path / "bad.safetensors")


def test_truncated_checkpoint(tmp_path, model):
  save_pretrained(model, tmp_path / "ckpt")
  raw = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
  for size, pattern in [(len(raw) - 3, "run past the data buffer"), (5, "truncated file"),
                        (0, "truncated file")]:
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(raw[:size])
    with pytest.raises(CheckpointError, match=pattern) as err:
      load_pretrained(tmp_path / "ckpt")
    assert "model.safetensors" in str(err.value)


# ---- atomic saves ---------------------------------------------------------------------------

def test_refused_saves_leave_the_old_checkpoint_byte_identical(tmp_path, model):
  target = tmp_path / "ckpt"
  save_pretrained(model, target)
  (target / "tokenizer.json").write_text("{}")
  before = _snapshot(tmp_path)
  odd = random_model(small_config("ds32"), seed=1)
  odd.lm_head.weight = nnx.Param(odd.lm_head.weight[...].astype(jnp.complex64))
  for call, pattern in [
      (lambda: save_pretrained(odd, target),
       "'lm_head.weight': dtype complex64 has no safetensors name"),
      (lambda: save_pretrained(model, target, max_shard_bytes="big"), "max_shard_bytes"),
      (lambda: save_pretrained(model, target, max_shard_bytes=True), "max_shard_bytes"),
      (lambda: save_pretrained(model, target, max_shard_bytes=0), "max_shard_bytes"),
      (lambda: save_pretrained(model, target, model_type="deepseek_v3"), "does not fit"),
      (lambda: save_pretrained(model, target, model_type="llama"), "not supported"),
      (lambda: save_pretrained("model", target), "must be a CausalLM")]:
    with pytest.raises(ValueError, match=pattern):
      call()
    assert _snapshot(tmp_path) == before


def test_a_save_failing_mid_write_leaves_the_old_checkpoint(tmp_path, model, monkeypatch):
  target = tmp_path / "ckpt"
  save_pretrained(model, target, max_shard_bytes=20_000)
  before = _snapshot(tmp_path)
  written = []

  def fail_on_the_third_file(tensors, path, metadata=None):
    if len(written) == 2:
      raise OSError("disk full")
    written.append(path)
    original(tensors, path, metadata)

  original = writing.write_safetensors
  monkeypatch.setattr(writing, "write_safetensors", fail_on_the_third_file)
  with pytest.raises(OSError, match="disk full"):
    save_pretrained(model, target, max_shard_bytes=30_000)
  assert len(written) == 2 and _snapshot(tmp_path) == before  # no staging directory left


def test_a_failure_while_moving_files_in_rolls_back(tmp_path, model, monkeypatch):
  target = tmp_path / "ckpt"
  save_pretrained(model, target, max_shard_bytes=20_000)
  before = _snapshot(tmp_path)
  moves, real_replace = [], os.replace

  def replace(src, dst):
    if dst == target / "model.safetensors":  # old files set aside, the new config moved in
      raise OSError("interrupted")
    moves.append(dst)
    real_replace(src, dst)

  monkeypatch.setattr(os, "replace", replace)
  with pytest.raises(OSError, match="interrupted"):
    save_pretrained(model, target)
  monkeypatch.undo()
  assert target / "config.json" in moves and len(moves) > 20
  assert _snapshot(tmp_path) == before


def test_a_successful_save_replaces_only_checkpoint_files(tmp_path, model):
  target = tmp_path / "ckpt"
  save_pretrained(model, target, max_shard_bytes=20_000)
  (target / "tokenizer.json").write_text('{"model": {}}')
  (target / "README.md").write_text("my model")
  (target / "notes").mkdir()
  (target / "notes" / "a.txt").write_text("a")
  save_pretrained(model, target)
  assert sorted(p.name for p in target.iterdir()) == [
      "README.md", "config.json", "model.safetensors", "notes", "tokenizer.json"]
  assert (target / "README.md").read_text() == "my model"
  assert (target / "notes" / "a.txt").read_text() == "a"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left
  loaded = load_pretrained(target, dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(loaded.lm_head.weight[...]),
                                np.asarray(model.lm_head.weight[...]))


def test_save_into_a_new_nested_directory(tmp_path, model):
  save_pretrained(model, tmp_path / "a" / "b")
  assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == [
      "config.json", "model.safetensors"]
  assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="is not a directory"):
    save_pretrained(model, tmp_path / "file")


# ---- config files and load arguments --------------------------------------------------------

@pytest.mark.parametrize("content,pattern", [
    ("[1, 2]", "config.json: must hold a JSON object, got a JSON list"),
    ('"text"', "config.json: must hold a JSON object, got a JSON str"),
    ("{", "config.json: invalid JSON"),
    (b"\xff\xfe{}", "config.json: invalid JSON"),
])
def test_config_file_that_is_not_a_json_object(tmp_path, model, content, pattern):
  save_pretrained(model, tmp_path)
  file = tmp_path / "config.json"
  file.write_bytes(content if isinstance(content, bytes) else content.encode())
  with pytest.raises(CheckpointError, match=pattern):
    load_pretrained(tmp_path)


@pytest.mark.parametrize("field,value,pattern", [
    ("rms_norm_eps", float("inf"), "'rms_norm_eps' must be finite"),
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be finite"),
    ("rms_norm_eps", "1e-6", "'rms_norm_eps' must be a float"),
    ("rms_norm_eps", 1, "'rms_norm_eps' must be a float"),
    ("vocab_size", "64", "'vocab_size' must be an int"),
    ("vocab_size", 64.0, "'vocab_size' must be an int"),
    ("vocab_size", True, "'vocab_size' must be an int"),
    ("num_hidden_layers", 0, "'num_hidden_layers' must be a positive int"),
    ("norm_topk_prob", "yes", "'norm_topk_prob' must be a bool"),
    ("routed_scaling_factor", float("inf"), "'routed_scaling_factor' must be finite"),
    ("rope_parameters", [], "'rope_parameters' must be an object"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": float("nan")},
     "rope_parameters.rope_theta must be a finite number"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "1e4"},
     "rope_parameters.rope_theta must be a finite number"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": float("inf")},
     "rope_parameters.factor must be a finite number"),
    ("index_topk", None, "'index_topk' is null"),
    ("mlp_layer_types", "dense", "'mlp_layer_types' must be a list of strings"),
])
def test_bad_field_values_name_the_field(tmp_path, model, field, value, pattern):
  """JSON can hold Infinity and NaN; a config file with them is refused like any bad type."""
  save_pretrained(model, tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  hf[field] = value
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(CheckpointError, match=pattern) as err:
    load_pretrained(tmp_path)
  assert "config.json" in str(err.value)


@pytest.mark.parametrize("dtype", ["int8", jnp.int32, "bool", bool, "float8_e4m3fn", "bf17",
                                   object])
def test_load_dtype_must_be_floating(tmp_path, model, dtype):
  save_pretrained(model, tmp_path)
  with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16, float32"):
    load_pretrained(tmp_path, dtype=dtype)
  with pytest.raises(ValueError, match="attention must be one of"):
    load_pretrained(tmp_path, attention="dense")


def test_unknown_tensor_names_are_checkpoint_errors(tmp_path):
  write_safetensors({"w": np.zeros(2, np.float32)}, tmp_path / "t.safetensors")
  file = SafetensorsFile(tmp_path / "t.safetensors")
  with pytest.raises(CheckpointError, match="t.safetensors: tensor 'v'"):
    file.read("v")
  assert "v" not in file and "w" in file


def test_save_into_the_current_directory_and_through_a_symlink(tmp_path, model, monkeypatch):
  (tmp_path / "real").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "real")
  monkeypatch.chdir(tmp_path / "real")
  save_pretrained(model, ".")
  save_pretrained(model, tmp_path / "link", max_shard_bytes=50_000)
  assert (tmp_path / "link").is_symlink()
  names = sorted(p.name for p in (tmp_path / "real").iterdir())
  assert names[:2] == ["config.json", "model-00001-of-00008.safetensors"]
  assert names[-1] == "model.safetensors.index.json" and len(names) == 10  # no stale file
  assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
