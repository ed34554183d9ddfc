"""A tiny DeepSeek-V4 written as the releases are (the V4-Flash / V4-Pro layout).

DeepSeek's names (``layers.{i}.attn.wq_a.weight``, ``embed.weight``, ``head.weight``, no
``model.`` prefix), each quantized weight beside its ``<name without weight>scale``:

* fp8 projections (attention, the indexer's ``wq_b``, the shared experts): float8_e4m3fn
  values and one e8m0 scale (a power of two) per ``block`` (``quantization_config``'s
  ``weight_block_size``; 128 x 128 in the releases);
* routed experts: MXFP4, int8 bytes of two e2m1 values (the low nibble the even column) and
  one e8m0 scale per 32 values of a row (``expert_dtype: fp4``).

The scales are ``amax / (the format's largest value)`` rounded up to a power of two, as
DeepSeek's ``act_quant`` with ue8m0 scales rounds them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np

from mla_jax.checkpoints.writing import write_safetensors
from mla_jax.v4.checkpoint import model_tensors
from mla_jax.v4.hf_config import v4_config_to_hf

FP8_WEIGHTS = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|"
                         r"shared_experts\.w[123]|(e_proj|h_proj))\.weight$")
FP4_WEIGHTS = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
_TOP_RENAMES = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}


def _e8m0(amax, largest: float) -> np.ndarray:
  """Power-of-two scales: ``max(amax, 1e-4) / largest`` rounded up."""
  exponent = np.ceil(np.log2(np.maximum(amax, 1e-4) / largest))
  return np.exp2(exponent).astype(ml_dtypes.float8_e8m0fnu)


def quantize_fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
  """e4m3 values and e8m0 scales, one per [block] tile (ragged edge tiles)."""
  rows, cols = w.shape
  grid = (-(-rows // block[0]), -(-cols // block[1]))
  padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
  padded[:rows, :cols] = w
  tiles = padded.reshape(grid[0], block[0], grid[1], block[1])
  scale = _e8m0(np.abs(tiles).max(axis=(1, 3)), 448.0)
  values = tiles / scale.astype(np.float32)[:, None, :, None]
  return values.reshape(padded.shape)[:rows, :cols].astype(ml_dtypes.float8_e4m3fn), scale


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """int8 bytes [N, K / 2] (two e2m1 values, the low nibble first) and e8m0 scales
  [N, K / 32]."""
  rows, cols = w.shape
  groups = w.astype(np.float32).reshape(rows, cols // 32, 32)
  scale = _e8m0(np.abs(groups).max(axis=-1), 6.0)
  codes = (groups / scale.astype(np.float32)[..., None]).reshape(rows, cols)
  codes = codes.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8), scale


def write_released(model, path, block: tuple[int, int] = (16, 16)) -> None:
  """``model`` (a float ``V4CausalLM``) as DeepSeek's release stores it, under ``path``."""
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for name, value in model_tensors(model).items():
    name = name.removeprefix("model.")
    name = _TOP_RENAMES.get(name, name)
    scale_name = name.removesuffix("weight") + "scale"
    if FP4_WEIGHTS.search(name):
      tensors[name], tensors[scale_name] = quantize_mxfp4(np.asarray(value, np.float32))
    elif FP8_WEIGHTS.search(name):
      tensors[name], tensors[scale_name] = quantize_fp8(np.asarray(value, np.float32), block)
    else:
      tensors[name] = value
  write_safetensors(tensors, path / "model.safetensors", {"format": "pt"})
  hf = v4_config_to_hf(model.config)
  hf.update(expert_dtype="fp4", quantization_config={
      "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
      "scale_fmt": "ue8m0", "weight_block_size": list(block)})
  (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
