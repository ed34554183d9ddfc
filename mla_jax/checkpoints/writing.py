"""Saving a ``CausalLM`` as an HF checkpoint, all or nothing.

Everything is validated before the first byte is written (the config is expressible, every
dtype has a safetensors name, ``max_shard_bytes`` is a positive int). The files are written
and synced in a staging directory beside the target, then moved into it: the old checkpoint
files are set aside, the new ones moved in, and any error puts the old ones back. Files in the
target that are not checkpoint files (a tokenizer, a README) are left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import safetensors.numpy
from flax import nnx

from mla_jax import quant

from mla_jax.checkpoints.hf_export import config_to_hf
from mla_jax.checkpoints.mapping import model_tensors
from mla_jax.checkpoints.reading import DTYPES, INDEX_FILE, SINGLE_FILE, safetensors_dtype
from mla_jax.models.lm import CausalLM

CONFIG_FILE = "config.json"
_METADATA = {"format": "pt"}  # HF refuses safetensors files without a known format tag


def _check_dtypes(tensors: dict[str, np.ndarray]) -> None:
  for name, array in tensors.items():
    if safetensors_dtype(np.asarray(array).dtype) is None:
      raise ValueError(f"tensor {name!r}: dtype {np.asarray(array).dtype} has no safetensors "
                       f"name (supported: {', '.join(DTYPES)})")


def write_safetensors(tensors: dict[str, np.ndarray], path: str | os.PathLike,
                      metadata: dict[str, str] | None = None) -> None:
  """One safetensors file with the library; every dtype must have a safetensors name."""
  _check_dtypes(tensors)
  safetensors.numpy.save_file({name: np.asarray(array, order="C")
                               for name, array in tensors.items()}, str(path), metadata)


def quantization_config(model: CausalLM) -> dict | None:
  """HF's ``quantization_config`` for a model holding fp8 weights (as DeepSeek's release
  writes it), None for one without."""
  weights = [m for _, m in nnx.iter_modules(model) if isinstance(m, quant.BlockScaledWeight)]
  if not weights:
    return None
  blocks = {w.block for w in weights}
  formats = {getattr(w, quant.VALUES).dtype for w in weights}
  if len(blocks) > 1 or len(formats) > 1:
    raise ValueError(f"fp8 weights with several block sizes {sorted(blocks)} or formats "
                     f"{sorted(map(str, formats))} cannot be described by one "
                     "quantization_config")
  fmt = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}.get(str(formats.pop()))
  if fmt is None:
    raise ValueError(f"fp8 weights of dtype {getattr(weights[0], quant.VALUES).dtype} have no "
                     "HF quantization format (e4m3 or e5m2)")
  return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": fmt,
          "weight_block_size": list(blocks.pop())}


def is_checkpoint_file(name: str) -> bool:
  """Files a save replaces: the config and every weights file, stale shards included."""
  return name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE) or (
      name.startswith("model-") and "-of-" in name and name.endswith(".safetensors"))


def _shards(tensors: dict[str, np.ndarray], max_shard_bytes: int | None) -> dict[str, list[str]]:
  """File name -> tensor names: one file, or sorted names packed up to ``max_shard_bytes``."""
  if max_shard_bytes is None:
    return {SINGLE_FILE: sorted(tensors)}
  groups, size = [[]], 0
  for name in sorted(tensors):
    if groups[-1] and size + tensors[name].nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += tensors[name].nbytes
  return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": names
          for i, names in enumerate(groups)}


def _sync(path: Path) -> None:
  with open(path, "rb") as f:
    os.fsync(f.fileno())


def _install(staging: Path, target: Path) -> None:
  """Moves the staged files into ``target``, replacing its checkpoint files; all or nothing
  against errors (each move is an atomic rename on the same file system)."""
  if not target.exists():
    os.rename(staging, target)
    return
  backup = staging / ".previous"
  backup.mkdir()
  old = sorted(p.name for p in target.iterdir() if p.is_file() and is_checkpoint_file(p.name))
  new = sorted(p.name for p in staging.iterdir() if p.is_file())
  set_aside, moved_in = [], []
  try:
    for name in old:
      os.replace(target / name, backup / name)
      set_aside.append(name)
    for name in new:
      os.replace(staging / name, target / name)
      moved_in.append(name)
  except BaseException:
    for name in moved_in:
      os.replace(target / name, staging / name)
    for name in set_aside:
      os.replace(backup / name, target / name)
    raise


def save_pretrained(model: CausalLM, path: str | os.PathLike, *, model_type: str | None = None,
                    max_shard_bytes: int | None = None) -> None:
  """Writes ``config.json`` and ``model.safetensors`` (sharded with an index beyond
  ``max_shard_bytes``); parameters keep their dtypes, so load -> save -> load is bitwise.
  fp8 weights are written as they are held, values and ``weight_scale_inv`` blocks, with
  their ``quantization_config``.

  Raises:
    ValueError: the model, config, a dtype or ``max_shard_bytes`` cannot be saved; nothing
      has been written then. An error while writing leaves the previous checkpoint as it was.
  """
  if not isinstance(model, CausalLM):
    raise ValueError(f"model must be a CausalLM, got {type(model).__name__}")
  if max_shard_bytes is not None and (type(max_shard_bytes) is not int or max_shard_bytes <= 0):
    raise ValueError(f"max_shard_bytes must be a positive int or None, got {max_shard_bytes!r}")
  hf = config_to_hf(model.config, model_type)
  quantization = quantization_config(model)
  if quantization is not None:
    hf["quantization_config"] = quantization
  tensors = model_tensors(model)
  _check_dtypes(tensors)
  target = Path(path).resolve()  # the staging directory must share its file system
  if target.exists() and not target.is_dir():
    raise ValueError(f"{target} exists and is not a directory")
  target.parent.mkdir(parents=True, exist_ok=True)
  staging = target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:12]}"
  staging.mkdir()
  try:
    shards = _shards(tensors, max_shard_bytes)
    for file, names in shards.items():
      write_safetensors({n: tensors[n] for n in names}, staging / file, _METADATA)
    if max_shard_bytes is not None:
      index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
               "weight_map": {n: file for file, names in shards.items() for n in names}}
      (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (staging / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    for file in staging.iterdir():
      _sync(file)
    _install(staging, target)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
