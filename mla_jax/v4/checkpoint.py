"""DeepSeek-V4 checkpoints: ``load_pretrained`` / ``save_pretrained`` in DeepSeek's layout.

DeepSeek's release and Hugging Face's ``save_pretrained`` write the same tensor names
(``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``, ...; HF puts
``model.`` in front of all but ``head.weight``); transformers renames them on load
(``conversion_mapping.py``). ``checkpoint_names`` is that renaming, run backwards from this
model's parameters: each parameter path gives the name(s) it is stored under, stacked
experts one name per expert. Names are looked up with and without the ``model.`` prefix.
The MTP layers (``mtp.{k}.*``, ``mla_jax.v4.mtp``) load when the checkpoint holds them;
HF's model has none.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mla_jax import quant, sharding
from mla_jax.backends import Backend, get_backend
from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.hf_config import fp8_block_size
from mla_jax.checkpoints.loading import (dequantize_fp8_blocks, is_float8, read_config,
                                         resolve_dtypes)
from mla_jax.checkpoints.reading import open_checkpoint
from mla_jax.checkpoints.writing import write_safetensors
from mla_jax.params import module_at
from mla_jax.v4.hf_config import v4_config_from_hf, v4_config_to_hf
from mla_jax.v4.model import V4CausalLM
from mla_jax.v4.sharding import state_shardings

# Outside the layers HF writes its own names (its renames there are anchored at the start
# of a name, so ``model.`` keeps them from being run backwards): DeepSeek's, then HF's.
_TOP = {
    ("model", "embed_tokens", "weight"): ("embed.weight", "model.embed_tokens.weight"),
    ("lm_head", "weight"): ("head.weight", "head.weight"),
    ("model", "norm", "weight"): ("norm.weight", "model.norm.weight"),
    ("model", "hc_head", "hc_fn"): ("hc_head_fn", "model.hc_head.hc_fn"),
    ("model", "hc_head", "hc_base"): ("hc_head_base", "model.hc_head.hc_base"),
    ("model", "hc_head", "hc_scale"): ("hc_head_scale", "model.hc_head.hc_scale"),
}
_IN_LAYER = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.indexer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
}
_COMPRESSOR = {"position_bias": "ape", "kv_norm.weight": "norm.weight",
               "gate_proj.weight": "wgate.weight", "kv_proj.weight": "wkv.weight"}
for _part, _stored in _COMPRESSOR.items():
  _IN_LAYER[f"self_attn.compressor.{_part}"] = f"attn.compressor.{_stored}"
  _IN_LAYER[f"self_attn.indexer.{_part}"] = f"attn.indexer.compressor.{_stored}"
for _hc in ("attn", "ffn"):
  for _part in ("fn", "base", "scale"):
    _IN_LAYER[f"{_hc}_hc.{_part}"] = f"hc_{_hc}_{_part}"
_SWIGLU = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
for _proj, _w in _SWIGLU.items():
  _IN_LAYER[f"mlp.shared_experts.{_proj}.weight"] = f"ffn.shared_experts.{_w}.weight"


# An MTP layer's own tensors (``mtp.{k}.*``, as DeepSeek's release names them and vLLM's
# deepseek_v4_mtp.py reads them); its block's are a decoder layer's names below ``mtp.{k}.``.
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
        "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight",
        "norm.weight": "norm.weight", "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}


def checkpoint_names(path: tuple, num_experts: int) -> list[tuple[str, ...]]:
  """The stored name(s) of parameter ``path``, each as the spellings it may have (DeepSeek's
  first, HF's ``save_pretrained`` last). A quantized weight's values and scales
  (``quant.BlockScaledWeight``) are stored under the weight's name."""
  path = tuple(str(p) for p in path)
  if path[-1] in (quant.VALUES, quant.SCALE_INV):
    path = path[:-1]
  if path in _TOP:
    return [_TOP[path]]
  if path[:2] == ("model", "layers"):
    prefix, rest, spellings = f"layers.{path[2]}.", path[3:], ("", "model.")
  elif path[0] == "mtp":  # DeepSeek's names only: HF's model has no MTP layers
    prefix, rest, spellings = f"mtp.{path[1]}.", path[2:], ("",)
    if rest[0] != "block":
      return [(prefix + _MTP[".".join(rest)],)]
    rest = rest[1:]
  else:
    raise KeyError(path)
  if _stacked(path):
    w = _SWIGLU[rest[2]]
    names = [f"{prefix}ffn.experts.{e}.{w}.weight" for e in range(num_experts)]
  else:
    names = [prefix + _IN_LAYER[".".join(rest)]]
  return [tuple(spelling + name for spelling in spellings) for name in names]


def _stacked(path: tuple) -> bool:
  """A routed experts' matrix: one stored tensor per expert, stacked on a leading axis."""
  return "experts" in map(str, path)


def _lookup(tensors, spellings: tuple[str, ...]):
  return next((name for name in spellings if name in tensors), None)


def _scale_name(tensors, name: str) -> str | None:
  """The block scales of a quantized weight: HF's ``weight_scale_inv`` or DeepSeek's
  ``scale``."""
  return _lookup(tensors, (name + "_scale_inv", name.removesuffix("weight") + "scale"))


FLOAT, FP8, FP4 = "float", "fp8", "fp4"


def stored_format(handle) -> str:
  """How a weight is stored: float, fp8 (e4m3 / e5m2 with block scales) or fp4 (MXFP4: int8
  bytes of two e2m1 values, with one e8m0 scale per 32 values)."""
  if is_float8(handle):
    return FP8
  return FP4 if handle.st_dtype in ("I8", "U8") else FLOAT


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """float32 [..., N, K] of MXFP4 bytes [..., N, K / 2] (low nibble first) and their e8m0
  scales [..., N, K / 32]."""
  codes = np.asarray(packed).view(np.uint8)
  nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
  values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  block = quant.MXFP4_BLOCK[1]
  return values * np.repeat(np.asarray(scale, np.float32), block, axis=-1)


def _check_stored(tensors, name: str, shape: tuple, block: tuple[int, int]) -> list[str]:
  """What is wrong with the stored ``name`` for a weight of ``shape`` (empty: nothing)."""
  handle = tensors[name]
  fmt = stored_format(handle)
  stored = (*shape[:-1], shape[-1] // 2) if fmt == FP4 else shape
  if tuple(handle.shape) != stored:
    return [f"{name}: shape {list(handle.shape)}, expected {list(stored)}"
            + (f" ({fmt}: two values a byte)" if fmt == FP4 else "")]
  if fmt == FLOAT:
    return []
  scale = _scale_name(tensors, name)
  kind = "float8" if fmt == FP8 else "fp4 (MXFP4)"
  if scale is None:
    return [f"{name}: {kind} without its scales ({name}_scale_inv or "
            f"{name.removesuffix('weight')}scale)"]
  if len(shape) != 2 or (fmt == FP4 and shape[-1] % quant.MXFP4_BLOCK[1]):
    return [f"{name}: {kind} is only supported for 2-D weights"
            + (f" whose columns are a multiple of {quant.MXFP4_BLOCK[1]}" if fmt == FP4 else "")]
  want = quant.scale_shape(shape, quant.MXFP4_BLOCK if fmt == FP4 else block)
  if tuple(tensors[scale].shape) != want:
    return [f"{scale}: shape {list(tensors[scale].shape)}, expected {list(want)} "
            f"(the scales of {kind} {name})"]
  return []


def _read(tensors, name: str, block: tuple[int, int], part: str | None = None) -> np.ndarray:
  """A stored weight dequantized to float32; with ``part`` (``quant.VALUES`` or
  ``quant.SCALE_INV``) its values (fp4: the bytes as uint8) or its scales, as stored."""
  fmt = stored_format(tensors[name])
  if part == quant.SCALE_INV:
    return tensors[_scale_name(tensors, name)].read()
  values = tensors[name].read()
  if part == quant.VALUES or fmt == FLOAT:
    return values.view(np.uint8) if fmt == FP4 else values
  scale = tensors[_scale_name(tensors, name)].read()
  if fmt == FP4:
    return dequantize_mxfp4(values, scale)
  return dequantize_fp8_blocks(values, scale, block)


def _keep_quantized(abstract: V4CausalLM, tensors, block: tuple[int, int]) -> int:
  """Turns every weight stored fp8 or fp4 with its scales into an abstract
  ``BlockScaledWeight`` holding them as stored; returns how many."""
  kept = 0
  for path, _ in nnx.state(abstract, nnx.Param).flat_state():
    if not quant.is_block_scalable(abstract, path):
      continue
    name = _lookup(tensors, checkpoint_names(path, abstract.config.n_routed_experts)[0])
    if name is None or _scale_name(tensors, name) is None:
      continue
    fmt, scale = stored_format(tensors[name]), tensors[_scale_name(tensors, name)]
    if fmt == FP8:
      quant.block_scale_abstract(abstract, path, tensors[name].dtype, block, scale.dtype)
    elif fmt == FP4:
      quant.block_scale_abstract(abstract, path, None, quant.MXFP4_BLOCK, scale.dtype,
                                 packed=True)
    kept += fmt != FLOAT
  return kept


def load_pretrained(path: str | os.PathLike, *, dtype=jnp.bfloat16, compute_dtype=None,
                    backend: str | Backend = "auto", grouped_matmul: str = "auto",
                    mesh=None, mtp: bool | None = None) -> V4CausalLM:
  """A ``V4CausalLM`` from a ``deepseek_v4`` directory (``config.json`` + safetensors).

  ``dtype`` is the weights' dtype; the mHC weights, sinks, pooling biases and norms stay
  float32, as in HF, and so do the routers' weights (HF holds those in ``dtype``). Quantized
  weights (fp8 e4m3 with block scales, ``quantization_config``'s ``weight_block_size``; the
  releases' MXFP4 experts) are dequantized as they are read, or, with ``dtype="fp8"``, kept
  as stored (``quant.BlockScaledWeight``: fp8 values, packed fp4 bytes, their scales) and
  dequantized inside each matmul; the model then computes in ``compute_dtype`` (bfloat16 by
  default; float32 checks it against a float32 reference). With ``mesh`` every parameter is
  placed by ``mla_jax.v4.sharding``'s rules (the mesh is checked first). ``mtp``: load the
  ``num_nextn_predict_layers`` MTP layers (``mtp.{k}.*``, for speculative decoding); None
  loads them when the checkpoint holds them, False skips them as HF does. Every missing or
  misshapen tensor is listed in one ``CheckpointError`` before anything is read.
  """
  if mtp is not None and not isinstance(mtp, bool):
    raise ValueError(f"mtp must be a bool or None, got {mtp!r}")
  param_dtype, keep = resolve_dtypes(dtype, compute_dtype)
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path} is not a directory")
  hf = read_config(path)
  try:
    config = v4_config_from_hf(hf)
  except CheckpointError as e:
    raise CheckpointError(f"{path / 'config.json'}: {e}") from None
  block = fp8_block_size(hf)
  backend = get_backend(backend)
  tensors = open_checkpoint(path)
  stored_mtp = any(name.startswith("mtp.") for name in tensors)
  if mtp and not config.num_mtp_layers:
    raise CheckpointError(f"{path / 'config.json'}: mtp=True, but num_nextn_predict_layers "
                          "is 0")
  if mtp is False or (mtp is None and not stored_mtp):
    config = dataclasses.replace(config, num_mtp_layers=0)  # counted but not stored (HF)
  abstract = nnx.eval_shape(lambda: V4CausalLM(config, rngs=nnx.Rngs(0), backend=backend,
                                                param_dtype=param_dtype,
                                                grouped_matmul=grouped_matmul, mesh=mesh))
  if keep and not _keep_quantized(abstract, tensors, block):
    raise CheckpointError(f"{path}: dtype='fp8' keeps a checkpoint's quantized weights, but "
                          "none is stored as fp8 or fp4 with its scales; load it with "
                          "dtype='bfloat16' or 'float32'")
  problems, plan = [], []
  for var_path, var in nnx.state(abstract).flat_state():
    names = checkpoint_names(var_path, config.n_routed_experts)
    stored = [_lookup(tensors, n) for n in names]
    part = var_path[-1] if var_path[-1] in (quant.VALUES, quant.SCALE_INV) else None
    weight = module_at(abstract, var_path[:-1]) if part else var
    shape = tuple(weight.shape[1:]) if _stacked(var_path) else tuple(weight.shape)
    for spellings, found in zip(names, stored):
      if found is None:
        problems.append(f"missing tensor {' or '.join(dict.fromkeys(spellings))}")
      elif part != quant.SCALE_INV:
        problems += _check_stored(tensors, found, shape, block)
        kept = (FP4 if weight.packed else FP8) if part else None
        if kept and stored_format(tensors[found]) != kept:
          problems.append(f"{found}: stored {stored_format(tensors[found])}, but the model "
                          f"keeps this stacked parameter as {kept} (its first expert's)")
    plan.append((var_path, var, stored, part))
  if problems:
    raise CheckpointError(f"{path}: " + "; ".join(dict.fromkeys(problems)))
  shardings = None if mesh is None else dict(state_shardings(abstract, mesh).flat_state())
  graphdef = nnx.graphdef(abstract)
  filled = []
  for var_path, var, stored, part in plan:
    arrays = [_read(tensors, name, block, part).astype(var.dtype) for name in stored]
    value = np.stack(arrays) if _stacked(var_path) else arrays[0]
    placed = (jnp.asarray(value) if shardings is None else
              sharding.put(value, mesh, shardings[var_path].spec))
    filled.append((var_path, var.replace(placed)))
  return nnx.merge(graphdef, nnx.State.from_flat_path(filled))


def model_tensors(model: V4CausalLM) -> dict[str, np.ndarray]:
  """Every parameter under its stored name, experts unstacked, in HF's ``model.`` form."""
  out = {}
  for var_path, var in nnx.state(model).flat_state():
    names = checkpoint_names(var_path, model.config.n_routed_experts)
    value = np.asarray(var[...])
    for i, spellings in enumerate(names):
      out[spellings[-1]] = value[i] if _stacked(var_path) else value
  return out


def save_pretrained(model: V4CausalLM, path: str | os.PathLike) -> None:
  """``config.json`` and ``model.safetensors`` that HF's ``DeepseekV4ForCausalLM`` loads."""
  if not isinstance(model, V4CausalLM):
    raise ValueError(f"model must be a V4CausalLM, got {type(model).__name__}")
  if any(isinstance(m, quant.BlockScaledWeight) for _, m in nnx.iter_modules(model)):
    raise ValueError("model holds quantized weights (loaded with dtype='fp8'); save_pretrained "
                     "writes float weights: load the checkpoint with a float dtype to save it")
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  write_safetensors(model_tensors(model), path / "model.safetensors", {"format": "pt"})
  (path / "config.json").write_text(json.dumps(v4_config_to_hf(model.config), indent=2) + "\n")
