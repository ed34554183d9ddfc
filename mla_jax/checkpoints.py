"""Hugging Face checkpoints: ``config.json`` plus safetensors <-> ``CausalLM`` (SPEC.md 10).

Parameter names of ``CausalLM`` are the HF state-dict names and ``Linear.weight`` is [out, in]
as in PyTorch, so loading is a lookup: no rename, no transpose. Before anything is built,
the loader checks every tensor against the model (missing, unexpected and mis-shaped keys)
and reports all problems in one ``CheckpointError``. Only safetensors are read: pickle-based
``*.bin`` / ``*.pt`` files can run code on load and are refused.

Multi-token-prediction layers (``model.layers.{L}.*`` with L >= num_hidden_layers, layer 61
of DeepSeek-V3.2 and 78 of GLM-5) are skipped, as HF's DeepSeek model does. fp8 tensors with
a ``weight_scale_inv`` are dequantized per 128x128 block (SPEC.md 10.3).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.backends import Backend
from mla_jax.config import IndexerConfig, MLAConfig, RopeConfig, YarnConfig
from mla_jax.models.config import MoEConfig, ModelConfig
from mla_jax.models.lm import CausalLM
from mla_jax.models import hf_layout
from mla_jax.rope import rope_attention_factor
from mla_jax.safetensors_io import CheckpointError, SafetensorsFile, save_file

__all__ = ["CheckpointError", "SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf",
           "dequantize_fp8_blocks", "load_pretrained", "save_pretrained"]

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3")
_ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM",
                  "glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# HF ignores indexer_rope_interleave (SPEC.md 3.2); these are its per-model pairings.
_INDEXER_INTERLEAVE_DEFAULT = {"deepseek_v32": False, "glm_moe_dsa": True}
_HF_INDEXER_NORM_EPS = 1e-6  # HF hard-codes the indexer k_norm LayerNorm eps
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_MAX_LISTED = 50  # per problem kind, to keep one error readable


# ---- config.json -----------------------------------------------------------------------------

def _field(hf: dict, key: str):
  if hf.get(key) is None:
    raise CheckpointError(f"config field {key!r} is missing (or null)")
  return hf[key]


def _rope_from_hf(hf: dict) -> RopeConfig:
  """``rope_theta`` (top level or nested in ``rope_parameters``) and optional YaRN."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  thetas = {v for v in (hf.get("rope_theta"), params.get("rope_theta")) if v is not None}
  if len(thetas) != 1:
    raise CheckpointError("rope_theta must be given (top level or in rope_parameters) "
                          f"exactly once or consistently, got {sorted(thetas)}")
  theta = float(thetas.pop())
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return RopeConfig(theta=theta)
  if rope_type != "yarn":
    raise CheckpointError(f"rope_type {rope_type!r} is not supported (only 'default', 'yarn')")
  if params.get("truncate", True) is not True:
    raise CheckpointError("YaRN with truncate=false is not supported")
  factor = float(_field(params, "factor"))
  mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
  # HF's cos/sin magnitude is mscale(f, mscale) / mscale(f, mscale_all_dim) only when both
  # are set and mscale(f, 1) otherwise, while the softmax scale uses mscale_all_dim alone.
  if mscale and mscale_all_dim:
    pair = (float(mscale), float(mscale_all_dim))
  elif not mscale_all_dim:
    pair = (1.0, 0.0)
  else:
    raise CheckpointError("YaRN with mscale_all_dim but without mscale is not supported")
  yarn = YarnConfig(factor=factor,
                    original_max_position_embeddings=_field(params,
                                                            "original_max_position_embeddings"),
                    beta_fast=float(params.get("beta_fast", 32.0)),
                    beta_slow=float(params.get("beta_slow", 1.0)),
                    mscale=pair[0], mscale_all_dim=pair[1])
  rope = RopeConfig(theta=theta, yarn=yarn)
  if params.get("attention_factor") is not None:
    if not math.isclose(params["attention_factor"], rope_attention_factor(rope), rel_tol=1e-9):
      raise CheckpointError(f"YaRN attention_factor {params['attention_factor']} differs from "
                            "the one implied by mscale/mscale_all_dim; not supported")
  return rope


def _indexer_types_from_hf(hf: dict, num_layers: int) -> tuple[str, ...] | None:
  """``indexer_types`` > ``index_topk_pattern`` > ``index_topk_freq``/offset; None: all full."""
  if hf.get("indexer_types") is not None:
    types = tuple(hf["indexer_types"])
  elif hf.get("index_topk_pattern") is not None:
    pattern = hf["index_topk_pattern"]
    if not isinstance(pattern, str) or set(pattern) - {"F", "S"}:
      raise CheckpointError(f"index_topk_pattern must be a string of 'F'/'S', got {pattern!r}")
    types = tuple("full" if ch == "F" else "shared" for ch in pattern)
  else:
    freq, offset = hf.get("index_topk_freq", 1), hf.get("index_skip_topk_offset", 2)
    if type(freq) is not int or freq < 1 or type(offset) is not int:
      raise CheckpointError(f"index_topk_freq must be an int >= 1 and index_skip_topk_offset "
                            f"an int, got {freq!r}, {offset!r}")
    # Not the first dense-MLP layers (SPEC.md 14 row 18): layer l is full iff this is 0.
    types = tuple("full" if max(l - offset + 1, 0) % freq == 0 else "shared"
                  for l in range(num_layers))
  if len(types) < num_layers:
    raise CheckpointError(f"the indexer schedule has {len(types)} entries for {num_layers} "
                          "layers")
  types = types[:num_layers]  # trailing entries describe MTP layers, which are not loaded
  return None if set(types) == {"full"} else types


def _first_k_dense_from_hf(hf: dict, num_layers: int) -> int:
  """``first_k_dense_replace``, or GLM's ``mlp_layer_types`` (dense layers then sparse)."""
  k = hf.get("first_k_dense_replace")
  kinds = hf.get("mlp_layer_types")
  if kinds is not None:
    kinds = list(kinds)[:num_layers]
    dense = kinds.count("dense")
    if len(kinds) != num_layers or kinds != ["dense"] * dense + ["sparse"] * (num_layers - dense):
      raise CheckpointError(f"mlp_layer_types must be {num_layers} entries, 'dense' layers "
                            f"then 'sparse' ones, got {hf['mlp_layer_types']!r}")
    if k is not None and k != dense:
      raise CheckpointError(f"first_k_dense_replace={k} disagrees with mlp_layer_types "
                            f"({dense} dense layers)")
    return dense
  return _field(hf, "first_k_dense_replace")


def _check_supported(hf: dict, model_type) -> None:
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(f"model_type {model_type!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  if hf.get("tie_word_embeddings"):
    raise CheckpointError("tie_word_embeddings=true is not supported (lm_head must be untied)")
  if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
    raise CheckpointError("q_lora_rank=null (no query LoRA) is not supported")
  expected = {"hidden_act": "silu", "attention_bias": False, "scoring_func": "sigmoid",
              "topk_method": "noaux_tc", "moe_layer_freq": 1}
  for key, value in expected.items():
    if key in hf and hf[key] != value:
      raise CheckpointError(f"{key}={hf[key]!r} is not supported (only {value!r})")
  rope, nope = hf.get("qk_rope_head_dim"), hf.get("qk_nope_head_dim")
  if hf.get("qk_head_dim") is not None and rope is not None and nope is not None \
      and hf["qk_head_dim"] != rope + nope:
    raise CheckpointError(f"qk_head_dim={hf['qk_head_dim']} is not qk_nope_head_dim + "
                          f"qk_rope_head_dim = {nope + rope}")


def config_from_hf(hf: dict, *, attention: str = "mqa-only") -> ModelConfig:
  """A ``ModelConfig`` from an HF ``config.json`` dict (see the module docstring).

  ``head_dim`` is ignored: HF stores the RoPE dim there, never the attention head size.
  An all-"full" indexer schedule becomes ``indexer_types=None``. The indexer's Hadamard
  rotation (exact in fp32, unknown to HF) is used whenever ``index_head_dim`` allows it.
  """
  model_type = hf.get("model_type")
  _check_supported(hf, model_type)
  num_layers = _field(hf, "num_hidden_layers")
  indexer, indexer_types = None, None
  if model_type != "deepseek_v3":
    interleave = hf.get("indexer_rope_interleave")
    interleave = _INDEXER_INTERLEAVE_DEFAULT[model_type] if interleave is None else interleave
    head_dim = _field(hf, "index_head_dim")
    try:
      indexer = IndexerConfig(num_heads=_field(hf, "index_n_heads"), head_dim=head_dim,
                              topk=_field(hf, "index_topk"), rope_interleave=interleave,
                              use_hadamard=type(head_dim) is int and head_dim > 0
                              and head_dim & (head_dim - 1) == 0,
                              norm_eps=_HF_INDEXER_NORM_EPS)
    except ValueError as e:
      raise CheckpointError(f"indexer config: {e}") from None
    indexer_types = _indexer_types_from_hf(hf, num_layers)
  moe = None
  if hf.get("n_routed_experts"):
    moe = MoEConfig(num_experts=hf["n_routed_experts"],
                    num_experts_per_tok=_field(hf, "num_experts_per_tok"),
                    n_group=_field(hf, "n_group"), topk_group=_field(hf, "topk_group"),
                    n_shared_experts=hf.get("n_shared_experts") or 0,
                    moe_intermediate_size=_field(hf, "moe_intermediate_size"),
                    routed_scaling_factor=float(_field(hf, "routed_scaling_factor")),
                    norm_topk_prob=_field(hf, "norm_topk_prob"))
  eps = float(_field(hf, "rms_norm_eps"))
  try:
    mla = MLAConfig(hidden_size=_field(hf, "hidden_size"),
                    num_heads=_field(hf, "num_attention_heads"),
                    q_lora_rank=_field(hf, "q_lora_rank"),
                    kv_lora_rank=_field(hf, "kv_lora_rank"),
                    qk_nope_head_dim=_field(hf, "qk_nope_head_dim"),
                    qk_rope_head_dim=_field(hf, "qk_rope_head_dim"),
                    v_head_dim=_field(hf, "v_head_dim"), rope=_rope_from_hf(hf),
                    max_position_embeddings=_field(hf, "max_position_embeddings"),
                    rms_norm_eps=eps, indexer=indexer)
    return ModelConfig(mla=mla, vocab_size=_field(hf, "vocab_size"), num_layers=num_layers,
                       intermediate_size=_field(hf, "intermediate_size"), moe=moe,
                       first_k_dense_replace=(_first_k_dense_from_hf(hf, num_layers)
                                              if moe is not None
                                              else hf.get("first_k_dense_replace") or 0),
                       attention=attention, rms_norm_eps=eps, indexer_types=indexer_types)
  except CheckpointError:
    raise
  except ValueError as e:
    raise CheckpointError(f"invalid config: {e}") from None


def _default_model_type(config: ModelConfig) -> str:
  indexer = config.mla.indexer
  if indexer is None:
    return "deepseek_v3"
  return "glm_moe_dsa" if indexer.rope_interleave else "deepseek_v32"


def _differences(a, b, prefix="") -> list[str]:
  if dataclasses.is_dataclass(a) and type(a) is type(b):
    return [d for f in dataclasses.fields(a)
            for d in _differences(getattr(a, f.name), getattr(b, f.name), prefix + f.name + ".")]
  return [] if a == b else [f"{prefix[:-1]}: {a!r} would reload as {b!r}"]


def config_to_hf(config: ModelConfig, model_type: str | None = None) -> dict:
  """The HF ``config.json`` dict of ``config``; ``config_from_hf`` inverts it exactly.

  ``model_type`` defaults to ``deepseek_v3`` without an indexer, else ``glm_moe_dsa`` when
  the indexer RoPE is interleaved and ``deepseek_v32`` when not. ``attention`` is a load-time
  choice and the Hadamard flag is rederived, so neither is stored. Anything else HF cannot
  express (e.g. an indexer norm eps other than 1e-6) raises ``ValueError``.
  """
  model_type = model_type or _default_model_type(config)
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  mla, moe = config.mla, config.moe
  if (mla.indexer is None) != (model_type == "deepseek_v3"):
    raise ValueError(f"model_type {model_type!r} does not fit a model "
                     f"{'without' if mla.indexer is None else 'with'} an indexer")
  rope = {"rope_type": "default", "rope_theta": mla.rope.theta}
  if mla.rope.yarn is not None:
    rope = {"rope_type": "yarn", "rope_theta": mla.rope.theta,
            **dataclasses.asdict(mla.rope.yarn)}
  n = config.num_layers
  hf = {
      "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
      "vocab_size": config.vocab_size, "hidden_size": mla.hidden_size,
      "intermediate_size": config.intermediate_size, "num_hidden_layers": n,
      "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads,
      "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
      "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
      "qk_head_dim": mla.qk_head_dim, "head_dim": mla.qk_rope_head_dim,
      "v_head_dim": mla.v_head_dim, "hidden_act": "silu", "attention_bias": False,
      "rms_norm_eps": config.rms_norm_eps,
      "max_position_embeddings": mla.max_position_embeddings, "rope_parameters": rope,
      "tie_word_embeddings": False,
      "n_routed_experts": moe.num_experts if moe else None,
      "first_k_dense_replace": config.first_k_dense_replace,
  }
  if moe is not None:
    k = config.first_k_dense_replace
    hf.update(num_experts_per_tok=moe.num_experts_per_tok, n_group=moe.n_group,
              topk_group=moe.topk_group, n_shared_experts=moe.n_shared_experts,
              moe_intermediate_size=moe.moe_intermediate_size,
              routed_scaling_factor=moe.routed_scaling_factor,
              norm_topk_prob=moe.norm_topk_prob,
              mlp_layer_types=["dense"] * min(k, n) + ["sparse"] * max(n - k, 0))
  if mla.indexer is not None:
    hf.update(index_n_heads=mla.indexer.num_heads, index_head_dim=mla.indexer.head_dim,
              index_topk=mla.indexer.topk, indexer_rope_interleave=mla.indexer.rope_interleave,
              indexer_types=list(config.indexer_types or ("full",) * n))
  reloaded = config_from_hf(hf, attention=config.attention)
  if mla.indexer is not None:  # the Hadamard flag is rederived on load, by design
    reloaded = dataclasses.replace(reloaded, mla=dataclasses.replace(
        reloaded.mla, indexer=dataclasses.replace(reloaded.mla.indexer,
                                                  use_hadamard=mla.indexer.use_hadamard)))
  if config.indexer_types is not None and set(config.indexer_types) == {"full"}:
    reloaded = dataclasses.replace(reloaded, indexer_types=config.indexer_types)
  problems = _differences(config, reloaded)
  if problems:
    raise ValueError("config cannot be expressed as an HF config.json: " + "; ".join(problems))
  return hf


# ---- tensors ---------------------------------------------------------------------------------

def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray,
                          block: tuple[int, int] = (128, 128)) -> np.ndarray:
  """float32 ``weight * scale_inv`` per [block] tile; edge tiles may be ragged."""
  rows, cols = weight.shape
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0),
                    block[1], axis=1)[:rows, :cols]
  return weight.astype(np.float32) * scale


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str]]:
  """The safetensors files (HF's preference: a single file over an index) and, for a sharded
  checkpoint, the index's tensor -> shard map."""
  if (path / _SINGLE).is_file():
    return [path / _SINGLE], {}
  if (path / _INDEX).is_file():
    try:
      weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
      names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
      raise CheckpointError(f"{path / _INDEX}: not a safetensors index ({e!r})") from None
    for name in names:
      if Path(name).name != name or not (path / name).is_file():
        raise CheckpointError(f"{path / _INDEX}: shard {name!r} does not exist in {path}")
    return [path / name for name in names], weight_map
  pickles = sorted(p.name for pattern in _PICKLE_PATTERNS for p in path.glob(pattern))
  if pickles:
    raise CheckpointError(f"{path}: only pickle-based weights ({', '.join(pickles)}); "
                          "safetensors only: pickle files can run code when loaded. Convert "
                          "them to model.safetensors with a trusted tool first")
  raise CheckpointError(f"{path}: no {_SINGLE} or {_INDEX}")


def _is_mtp(name: str, num_layers: int) -> bool:
  """A key of a multi-token-prediction layer (``model.layers.{L}``, L >= num_layers)."""
  m = _LAYER_KEY.match(name)
  return m is not None and int(m.group(1)) >= num_layers


def _open_tensors(path: Path, num_layers: int) -> dict[str, SafetensorsFile]:
  """Which file holds each tensor; MTP layers (index >= num_layers) are left out."""
  files, weight_map = _checkpoint_files(path)
  where: dict[str, SafetensorsFile] = {}
  for file in files:
    shard = SafetensorsFile(file)
    for name in shard.keys():
      if _is_mtp(name, num_layers):
        continue
      if name in where:
        raise CheckpointError(f"tensor {name!r} appears in both {where[name].path.name} and "
                              f"{file.name}")
      where[name] = shard
  for name, file in sorted(weight_map.items()):
    if _is_mtp(name, num_layers):
      continue
    if name not in where or where[name].path.name != file:
      raise CheckpointError(f"{path / _INDEX} places tensor {name!r} in {file}, which does "
                            "not hold it")
  return where


def _plan(expected: dict, where: dict[str, SafetensorsFile], block) -> dict[str, str | None]:
  """Each model parameter -> its fp8 scale key (or None); raises listing every mismatch."""
  missing, wrong, plan = [], [], {}
  for name, target in sorted(expected.items()):
    if name not in where:
      missing.append(name)
      continue
    info = where[name].info(name)
    if info.shape != tuple(target.shape):
      wrong.append(f"{name}: checkpoint shape {info.shape} != model shape "
                   f"{tuple(target.shape)}")
    elif not info.dtype.startswith(("F", "BF")):
      wrong.append(f"{name}: dtype {info.dtype} cannot hold a parameter")
    plan[name] = None
    if info.dtype.startswith("F8_"):
      scale = name + "_scale_inv"
      want = tuple(-(-d // b) for d, b in zip(target.shape, block))
      if len(target.shape) != 2:
        wrong.append(f"{name}: fp8 ({info.dtype}) is only supported for 2-D weights")
      elif scale not in where:
        missing.append(f"{scale} (the scale of fp8 weight {name})")
      elif where[scale].info(scale).shape != want:
        wrong.append(f"{scale}: checkpoint shape {where[scale].info(scale).shape} != "
                     f"expected {want} for {block} blocks of {tuple(target.shape)}")
      plan[name] = scale
  unexpected = sorted(set(where) - set(expected) - {s for s in plan.values() if s})
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
    raise CheckpointError("checkpoint does not match the model:\n" + "\n".join(lines))
  return plan


def _fp8_block(hf: dict) -> tuple[int, int]:
  quant = hf.get("quantization_config") or {}
  block = quant.get("weight_block_size", [128, 128])
  if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0
                                                              for b in block)):
    raise CheckpointError(f"quantization_config.weight_block_size must be [int, int], "
                          f"got {block!r}")
  return tuple(block)


def load_pretrained(path: str | os.PathLike, *, dtype=None, attention: str = "mqa-only",
                    backend: str | Backend = "auto") -> CausalLM:
  """A ``CausalLM`` from an HF directory (``config.json`` + safetensors, single or sharded).

  Args:
    path: the checkpoint directory.
    dtype: parameter dtype; None is float32. The MoE router and the indexer's
      ``weights_proj`` stay float32 whatever is asked, as in HF.
    attention: ``"mqa-only"`` or ``"dense-capable"`` (``ModelConfig.attention``).
    backend: ``"auto" | "xla" | "pallas"`` or a ``Backend``.

  Raises:
    CheckpointError: a bad config, file or tensor set; every tensor mismatch is listed
      together and nothing is built before all checks pass.
  """
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path} is not a directory")
  try:
    hf = json.loads((path / "config.json").read_text())
  except FileNotFoundError:
    raise CheckpointError(f"{path}: no config.json") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path / 'config.json'}: invalid JSON: {e}") from None
  try:
    config = config_from_hf(hf, attention=attention)
    block = _fp8_block(hf)
  except CheckpointError as e:
    raise CheckpointError(f"{path / 'config.json'}: {e}") from None
  param_dtype = jnp.float32 if dtype is None else jnp.dtype(dtype)
  abstract = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), backend=backend,
                                             param_dtype=param_dtype))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  expected = {name: jax.ShapeDtypeStruct(shape, dtype)
              for name, (shape, dtype) in hf_layout.hf_shapes(params).items()}
  where = _open_tensors(path, config.num_layers)
  try:
    plan = _plan(expected, where, block)
  except CheckpointError as e:
    raise CheckpointError(f"{path}: {e}") from None

  def read(name, tail):
    value = where[name].get(name)
    if plan[name] is not None:
      value = dequantize_fp8_blocks(value, where[plan[name]].get(plan[name]), block)
    return value[tail]

  layouts = hf_layout.param_layouts(params)
  loaded = []
  for key, var in params.flat_state():
    value = hf_layout.assemble(layouts[key], var.shape, (), read)
    loaded.append((key, var.replace(jnp.asarray(value.astype(var.dtype)))))
  return nnx.merge(graphdef, nnx.State.from_flat_path(loaded), rest)


def save_pretrained(model: CausalLM, path: str | os.PathLike, *, model_type: str | None = None,
                    max_shard_bytes: int | None = None) -> None:
  """Writes ``config.json`` and ``model.safetensors`` (sharded with an index beyond
  ``max_shard_bytes``); parameters keep their dtypes, so load -> save -> load is bitwise."""
  hf = config_to_hf(model.config, model_type)
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = hf_layout.hf_params(model)
  # Stale weights from an earlier save would shadow or mix with the new ones on load.
  for old in [path / _SINGLE, path / _INDEX, *path.glob("model-*-of-*.safetensors")]:
    old.unlink(missing_ok=True)
  metadata = {"format": "pt"}  # HF refuses safetensors without a known format tag
  if max_shard_bytes is None:
    save_file(tensors, path / _SINGLE, metadata)
  else:
    shards, size = [[]], 0
    for name in sorted(tensors):
      if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
        shards.append([])
        size = 0
      shards[-1].append(name)
      size += tensors[name].nbytes
    weight_map = {}
    for i, names in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file({n: tensors[n] for n in names}, path / file, metadata)
      weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    (path / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
  (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
