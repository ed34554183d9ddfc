"""Hugging Face ``config.json`` (``model_type: deepseek_v4``) <-> ``V4Config``.

The rules are those of transformers 5.25's ``DeepseekV4Config.__post_init__``:

- a missing field takes that class's default (``HF_V4_DEFAULTS``);
- ``layer_types`` wins over the legacy per-layer ``compress_ratios`` (0 / 4 / 128), and
  without either the V4-Pro schedule is built: two HCA layers, then CSA and HCA alternating;
- ``compress_rates`` (a dict per layer type) is overridden by the legacy scalars
  ``compress_rate_csa`` / ``compress_rate_hca``;
- ``mlp_layer_types`` wins over the legacy ``num_hash_layers``, which defaults to 3;
- ``partial_rotary_factor`` wins over the legacy ``qk_rope_head_dim / head_dim``, which
  defaults to 64 / 512;
- ``rope_parameters`` nested as ``{"main": ..., "compress": ...}`` is taken as it is; a flat
  one (or a ``rope_scaling``) is the compress RoPE's YaRN over ``compress_rope_theta``, and
  the main RoPE is plain over ``rope_theta``. YaRN's magnitude is 1 (HF forces
  ``attention_factor`` 1.0 for V4). Each dict is read by ``checkpoints.hf_rope``, the parser
  the V3.2 / GLM configs use too.

What mla_jax cannot run is refused with a ``CheckpointError`` naming the field: biases, a
non-SiLU activation, more than one KV head, a quantization other than fp8 blocks (with fp4
MXFP4 or fp8 experts, ``expert_dtype``).
"""

from __future__ import annotations

import math

from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.hf_rope import finite_number, rope_from_hf
from mla_jax.config import RopeConfig
from mla_jax.v4.config import CSA, HASH_MOE, HCA, LAYER_TYPES, MOE, SLIDING, V4Config

MODEL_TYPE = "deepseek_v4"
HF_V4_DEFAULTS = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
    num_experts_per_tok=6, n_routed_experts=256,
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, max_position_embeddings=1048576,
    rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024,
    index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
    num_nextn_predict_layers=1)
_LEGACY_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_HASH_LAYERS = 3
_DEFAULT_ROPE_FACTOR = 64 / 512
_INT_FIELDS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "q_lora_rank",
               "num_experts_per_tok", "n_routed_experts",
               "max_position_embeddings", "hc_mult", "hc_sinkhorn_iters", "sliding_window",
               "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
               "num_nextn_predict_layers")
_FLOAT_FIELDS = ("routed_scaling_factor", "rope_theta", "compress_rope_theta", "hc_eps",
                 "swiglu_limit", "rms_norm_eps")


def _field(hf: dict, name: str):
  value = hf.get(name, HF_V4_DEFAULTS.get(name))
  if value is None:
    raise CheckpointError(f"{name} is null; DeepseekV4Config needs a value")
  if name in _INT_FIELDS and (type(value) is not int):
    raise CheckpointError(f"{name} must be an int, got {value!r}")
  if name in _FLOAT_FIELDS and not (isinstance(value, (int, float)) and type(value) is not bool
                                    and math.isfinite(value)):
    raise CheckpointError(f"{name} must be a finite number, got {value!r}")
  return value


def _layer_types(hf: dict, n: int) -> tuple[str, ...]:
  types = hf.get("layer_types")
  if types is None and hf.get("compress_ratios") is not None:
    try:
      types = [_LEGACY_RATIOS[r] for r in hf["compress_ratios"]]
    except (KeyError, TypeError):
      raise CheckpointError(f"compress_ratios must hold 0, 4 or 128 per layer, got "
                            f"{hf['compress_ratios']!r}") from None
  if types is None:
    types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
  types = list(types)[:n]
  if len(types) != n or any(t not in LAYER_TYPES for t in types):
    raise CheckpointError(f"layer_types must list one of {LAYER_TYPES} for each of the {n} "
                          f"layers, got {types!r}")
  return tuple(types)


def _mlp_layer_types(hf: dict, n: int) -> tuple[str, ...]:
  types = hf.get("mlp_layer_types")
  if types is None:
    hashed = hf.get("num_hash_layers")
    hashed = _DEFAULT_HASH_LAYERS if hashed is None else hashed
    if type(hashed) is not int or hashed < 0:
      raise CheckpointError(f"num_hash_layers must be an int >= 0, got {hashed!r}")
    types = [HASH_MOE] * min(n, hashed) + [MOE] * max(0, n - hashed)
  types = list(types)[:n]
  if len(types) != n or any(t not in (HASH_MOE, MOE) for t in types):
    raise CheckpointError(f"mlp_layer_types must list 'hash_moe' or 'moe' for each of the {n} "
                          f"layers, got {types!r}")
  return tuple(types)


def _ropes(hf: dict) -> tuple[RopeConfig, RopeConfig]:
  main_theta, compress_theta = _field(hf, "rope_theta"), _field(hf, "compress_rope_theta")
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(params, dict):
    raise CheckpointError(f"rope_parameters must be an object, got {params!r}")

  def rope(params: dict, theta: float, where: str) -> RopeConfig:
    theta = finite_number(f"{where}.rope_theta", params.get("rope_theta", theta), positive=True)
    return rope_from_hf(params, theta, where=where,
                        max_positions=_field(hf, "max_position_embeddings"),
                        mscale_all_dim_scales_softmax=False)

  if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
    return (rope(params["main"], main_theta, "rope_parameters.main"),
            rope(params["compress"], compress_theta, "rope_parameters.compress"))
  # A flat form is the compress RoPE's, with the magnitude HF forces for V4's: 1.
  flat = {k: v for k, v in params.items() if k not in ("main", "compress", "rope_theta")}
  if flat.get("rope_type", flat.get("type")) == "yarn":
    flat.setdefault("attention_factor", 1.0)
  return RopeConfig(theta=float(main_theta)), rope(flat, compress_theta, "rope_parameters")


def _rope_dim(hf: dict, head_dim: int) -> int:
  factor = hf.get("partial_rotary_factor")
  if factor is None:
    legacy = hf.get("qk_rope_head_dim")
    factor = legacy / head_dim if legacy is not None else _DEFAULT_ROPE_FACTOR
  return int(head_dim * factor)


def _refuse_unsupported(hf: dict) -> None:
  if _field(hf, "num_key_value_heads") != 1:
    raise CheckpointError("num_key_value_heads must be 1 (V4 shares one K=V head)")
  for name in ("attention_bias", "mlp_bias"):
    if hf.get(name, False):
      raise CheckpointError(f"{name}: biases are not supported")
  if _field(hf, "hidden_act") != "silu":
    raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
  quant = hf.get("quantization_config")
  if quant is not None:
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method != "fp8":
      raise CheckpointError(f"quantization_config: quant_method {method!r} is not supported "
                            "(fp8 block-scaled weights are)")
    expert_dtype = quant.get("expert_dtype", hf.get("expert_dtype"))
    if expert_dtype not in (None, "fp4", "fp8", "bf16"):
      raise CheckpointError(f"expert_dtype {expert_dtype!r}: {expert_dtype} experts are not "
                            "supported (fp4 as MXFP4, fp8 and bf16 are)")


def v4_config_from_hf(hf: dict) -> V4Config:
  """A ``V4Config`` from a ``deepseek_v4`` config dict, by HF's rules (module docstring)."""
  if hf.get("model_type") != MODEL_TYPE:
    raise CheckpointError(f"model_type must be {MODEL_TYPE!r}, got {hf.get('model_type')!r}")
  _refuse_unsupported(hf)
  n = _field(hf, "num_hidden_layers")
  rates = dict(hf.get("compress_rates") or {})
  for legacy, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
    if hf.get(legacy) is not None:
      rates[layer_type] = hf[legacy]
  head_dim = _field(hf, "head_dim")
  main_rope, compress_rope = _ropes(hf)
  fields = {name: _field(hf, name) for name in (
      "vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads",
      "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
      "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok", "scoring_func",
      "routed_scaling_factor", "swiglu_limit",
      "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "max_position_embeddings",
      "tie_word_embeddings")}
  try:
    return V4Config(
        **fields, head_dim=head_dim, rope_dim=_rope_dim(hf, head_dim),
        csa_ratio=rates.get(CSA, 4), hca_ratio=rates.get(HCA, 128),
        layer_types=_layer_types(hf, n), mlp_layer_types=_mlp_layer_types(hf, n),
        main_rope=main_rope, compress_rope=compress_rope,
        num_mtp_layers=_field(hf, "num_nextn_predict_layers"))
  except ValueError as e:
    raise CheckpointError(str(e)) from None


def _rope_to_hf(rope: RopeConfig, rope_dim: int, head_dim: int) -> dict:
  out = {"rope_type": "default", "rope_theta": rope.theta,
         "partial_rotary_factor": rope_dim / head_dim}
  if rope.yarn is not None:
    out.update(rope_type="yarn", factor=rope.yarn.factor, mscale=rope.yarn.mscale,
               mscale_all_dim=rope.yarn.mscale_all_dim,
               original_max_position_embeddings=rope.yarn.original_max_position_embeddings,
               beta_fast=rope.yarn.beta_fast, beta_slow=rope.yarn.beta_slow)
  return out


def v4_config_to_hf(config: V4Config) -> dict:
  """The ``config.json`` HF's ``DeepseekV4Config`` reads back into the same model."""
  fields = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads",
            "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
            "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
            "num_experts_per_tok", "scoring_func",
            "routed_scaling_factor", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
            "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
  hf = {name: getattr(config, name) for name in fields}
  hf.update(
      model_type=MODEL_TYPE, architectures=["DeepseekV4ForCausalLM"], num_key_value_heads=1,
      num_hidden_layers=config.num_layers, layer_types=list(config.layer_types),
      mlp_layer_types=list(config.mlp_layer_types),
      compress_rates={CSA: config.csa_ratio, HCA: config.hca_ratio},
      partial_rotary_factor=config.rope_dim / config.head_dim,
      rope_theta=config.main_rope.theta, compress_rope_theta=config.compress_rope.theta,
      rope_parameters={
          "main": _rope_to_hf(config.main_rope, config.rope_dim, config.head_dim),
          "compress": _rope_to_hf(config.compress_rope, config.rope_dim, config.head_dim)},
      num_nextn_predict_layers=config.num_mtp_layers)
  return hf
