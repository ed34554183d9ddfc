"""DeepSeek-V4 checkpoints: ``load_pretrained`` / ``save_pretrained`` in DeepSeek's layout.

DeepSeek's release and Hugging Face's ``save_pretrained`` write the same tensor names
(``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``, ...; HF puts
``model.`` in front of all but ``head.weight``); transformers renames them on load
(``conversion_mapping.py``). ``checkpoint_names`` is that renaming, run backwards from this
model's parameters: each parameter path gives the name(s) it is stored under, stacked
experts one name per expert. Names are looked up with and without the ``model.`` prefix.
The ``mtp.*`` layers are skipped, as HF skips them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.backends import Backend, get_backend
from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.hf_config import fp8_block_size
from mla_jax.checkpoints.loading import dequantize_fp8_blocks, is_float8, read_config
from mla_jax.checkpoints.reading import open_checkpoint
from mla_jax.checkpoints.writing import write_safetensors
from mla_jax.v4.hf_config import v4_config_from_hf, v4_config_to_hf
from mla_jax.v4.model import V4CausalLM

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


def checkpoint_names(path: tuple, num_experts: int) -> list[tuple[str, ...]]:
  """The stored name(s) of parameter ``path``, each as the spellings it may have (DeepSeek's
  first, HF's ``save_pretrained`` last)."""
  path = tuple(str(p) for p in path)
  if path in _TOP:
    return [_TOP[path]]
  if path[:2] != ("model", "layers"):
    raise KeyError(path)
  layer, rest = path[2], ".".join(path[3:])
  if _stacked(path):
    proj = rest.split(".")[2]
    names = [f"layers.{layer}.ffn.experts.{e}.{_SWIGLU[proj]}.weight"
             for e in range(num_experts)]
  else:
    names = [f"layers.{layer}.{_IN_LAYER[rest]}"]
  return [(name, "model." + name) for name in names]


def _stacked(path: tuple) -> bool:
  """A routed experts' matrix: one stored tensor per expert, stacked on a leading axis."""
  return "experts" in map(str, path)


def _lookup(tensors, spellings: tuple[str, ...]):
  return next((name for name in spellings if name in tensors), None)


def _scale_name(tensors, name: str) -> str | None:
  """The block scales of an fp8 weight: HF's ``weight_scale_inv`` or DeepSeek's ``scale``."""
  return _lookup(tensors, (name + "_scale_inv", name.removesuffix("weight") + "scale"))


def _read(tensors, name: str, block: tuple[int, int]) -> np.ndarray:
  """A tensor as stored, fp8 weights dequantized by their block scales."""
  if not is_float8(tensors[name]):
    return tensors[name].read()
  return dequantize_fp8_blocks(tensors[name].read(), tensors[_scale_name(tensors, name)].read(),
                               block)


def load_pretrained(path: str | os.PathLike, *, dtype=jnp.bfloat16,
                    backend: str | Backend = "auto",
                    grouped_matmul: str = "auto") -> V4CausalLM:
  """A ``V4CausalLM`` from a ``deepseek_v4`` directory (``config.json`` + safetensors).

  ``dtype`` is the weights' dtype; the mHC weights, sinks, pooling biases and norms stay
  float32, as in HF, and so do the routers' weights (HF holds those in ``dtype``). fp8
  weights (e4m3 with block scales, ``quantization_config``'s ``weight_block_size``) are
  dequantized as they are read. Every missing or misshapen tensor
  is listed in one ``CheckpointError`` before anything is read.
  """
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
  abstract = nnx.eval_shape(lambda: V4CausalLM(config, rngs=nnx.Rngs(0), backend=backend,
                                                param_dtype=dtype,
                                                grouped_matmul=grouped_matmul))
  graphdef, state = nnx.split(abstract)
  tensors = open_checkpoint(path)
  problems, plan = [], []
  for var_path, var in state.flat_state():
    names = checkpoint_names(var_path, config.n_routed_experts)
    stored = [_lookup(tensors, n) for n in names]
    shape = tuple(var.shape[1:]) if _stacked(var_path) else tuple(var.shape)
    for name, found in zip(names, stored):
      if found is None:
        problems.append(f"missing tensor {' or '.join(dict.fromkeys(name))}")
      elif tuple(tensors[found].shape) != shape:
        problems.append(f"{found}: shape {list(tensors[found].shape)}, expected {list(shape)}")
      elif is_float8(tensors[found]) and _scale_name(tensors, found) is None:
        problems.append(f"{found}: float8 without a block scale ({found}_scale_inv)")
    plan.append((var_path, var, stored))
  if problems:
    raise CheckpointError(f"{path}: " + "; ".join(problems))
  filled = []
  for var_path, var, stored in plan:
    arrays = [_read(tensors, name, block).astype(var.dtype) for name in stored]
    value = np.stack(arrays) if _stacked(var_path) else arrays[0]
    filled.append((var_path, var.replace(jnp.asarray(value))))
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
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  write_safetensors(model_tensors(model), path / "model.safetensors", {"format": "pt"})
  (path / "config.json").write_text(json.dumps(v4_config_to_hf(model.config), indent=2) + "\n")
