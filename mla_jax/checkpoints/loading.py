"""Loading an HF checkpoint directory into a ``CausalLM``.

Before anything is built the loader checks every tensor against the model and reports all
missing, unexpected and mis-shaped ones in one ``CheckpointError``. Multi-token-prediction
layers (``model.layers.{L}.*`` with L >= num_hidden_layers: layer 61 of DeepSeek-V3.2, 78 of
GLM-5) are skipped, as HF's model does. fp8 weights with a ``weight_scale_inv`` are
dequantized per block (128x128 unless the config says otherwise).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.backends import Backend
from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.hf_config import config_from_hf, fp8_block_size
from mla_jax.checkpoints.mapping import expected_tensors, fill_parameters
from mla_jax.checkpoints.reading import TensorHandle, open_checkpoint
from mla_jax.models.config import ATTENTION_KINDS
from mla_jax.models.lm import CausalLM

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_MAX_LISTED = 50  # per problem kind, to keep one error readable
_PARAM_DTYPES = ("bfloat16", "float16", "float32", "float64")


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray,
                          block: tuple[int, int] = (128, 128)) -> np.ndarray:
  """float32 ``weight * scale_inv`` per [block] tile; edge tiles may be ragged."""
  rows, cols = weight.shape
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0),
                    block[1], axis=1)[:rows, :cols]
  return weight.astype(np.float32) * scale


def _is_mtp(name: str, num_layers: int) -> bool:
  """A key of a multi-token-prediction layer (``model.layers.{L}``, L >= num_layers)."""
  m = _LAYER_KEY.match(name)
  return m is not None and int(m.group(1)) >= num_layers


def _plan(path: Path, expected: dict, available: dict[str, TensorHandle],
          block: tuple[int, int]) -> dict[str, str | None]:
  """Each model parameter -> its fp8 scale key (or None); raises listing every mismatch."""
  missing, wrong, plan = [], [], {}
  for name, target in sorted(expected.items()):
    if name not in available:
      missing.append(name)
      continue
    handle = available[name]
    if handle.shape != tuple(target.shape):
      wrong.append(f"{name}: checkpoint shape {handle.shape} != model shape "
                   f"{tuple(target.shape)}")
    elif not handle.st_dtype.startswith(("F", "BF")) or handle.dtype is None:
      wrong.append(f"{name}: dtype {handle.st_dtype} cannot hold a parameter")
    plan[name] = None
    if handle.st_dtype.startswith("F8_"):
      scale = name + "_scale_inv"
      want = tuple(-(-d // b) for d, b in zip(target.shape, block))
      if len(target.shape) != 2:
        wrong.append(f"{name}: fp8 ({handle.st_dtype}) is only supported for 2-D weights")
      elif scale not in available:
        missing.append(f"{scale} (the scale of fp8 weight {name})")
      elif available[scale].shape != want:
        wrong.append(f"{scale}: checkpoint shape {available[scale].shape} != expected {want} "
                     f"for {block} blocks of {tuple(target.shape)}")
      plan[name] = scale
  unexpected = sorted(set(available) - set(expected) - {s for s in plan.values() if s})
  problems = [(f"missing ({len(missing)})", missing),
              (f"unexpected ({len(unexpected)})", unexpected),
              (f"wrong shape or dtype ({len(wrong)})", wrong)]
  lines = []
  for title, items in problems:
    if items:
      lines.append(f"  {title}:")
      lines += [f"    {item}" for item in items[:_MAX_LISTED]]
      if len(items) > _MAX_LISTED:
        lines.append(f"    ... and {len(items) - _MAX_LISTED} more")
  if lines:
    raise CheckpointError(f"{path}: checkpoint does not match the model:\n" + "\n".join(lines))
  return plan


def _param_dtype(dtype) -> jnp.dtype:
  if dtype is None:
    return jnp.dtype(jnp.float32)
  try:
    resolved = jnp.dtype(dtype)
  except TypeError:
    resolved = None
  if isinstance(dtype, bool) or resolved is None or resolved.name not in _PARAM_DTYPES:
    raise ValueError(f"dtype must be one of {', '.join(_PARAM_DTYPES)} (or None for float32), "
                     f"got {dtype!r}")
  return resolved


def read_config(path: Path) -> dict:
  """The ``config.json`` of a checkpoint directory as a dict."""
  file = path / "config.json"
  try:
    hf = json.loads(file.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise CheckpointError(f"{path}: no config.json") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file}: invalid JSON: {e}") from None
  if not isinstance(hf, dict):
    raise CheckpointError(f"{file}: must hold a JSON object, got a JSON {type(hf).__name__}")
  return hf


def load_pretrained(path: str | os.PathLike, *, dtype=None, attention: str = "mqa-only",
                    backend: str | Backend = "auto") -> CausalLM:
  """A ``CausalLM`` from an HF directory (``config.json`` + safetensors, single or sharded).

  Args:
    path: the checkpoint directory.
    dtype: parameter dtype (bfloat16, float16, float32 or float64); None is float32. The
      MoE router and the indexer's ``weights_proj`` stay float32 whatever is asked, as in HF.
    attention: ``"mqa-only"`` or ``"dense-capable"`` (``ModelConfig.attention``).
    backend: ``"auto" | "xla" | "pallas"`` or a ``Backend``.

  Raises:
    CheckpointError: a bad config, file or tensor set; every tensor mismatch is listed
      together and nothing is built before all checks pass.
    ValueError: a bad ``dtype`` or ``attention``.
  """
  param_dtype = _param_dtype(dtype)
  if attention not in ATTENTION_KINDS:
    raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path} is not a directory")
  hf = read_config(path)
  try:
    config = config_from_hf(hf, attention=attention)
    block = fp8_block_size(hf)
  except CheckpointError as e:
    raise CheckpointError(f"{path / 'config.json'}: {e}") from None
  abstract = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), backend=backend,
                                             param_dtype=param_dtype))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  tensors = open_checkpoint(path)
  available = {name: handle for name, handle in tensors.items()
               if not _is_mtp(name, config.num_layers)}
  plan = _plan(path, expected_tensors(params), available, block)

  def read(name, index):
    value = available[name].read()
    if plan[name] is not None:
      value = dequantize_fp8_blocks(value, available[plan[name]].read(), block)
    return value[index]

  return nnx.merge(graphdef, fill_parameters(params, read), rest)
