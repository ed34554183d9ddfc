"""Hugging Face ``config.json`` -> ``ModelConfig``, by the rules of transformers' own classes.

The rules are those of transformers 5.24.0's ``DeepseekV3Config``, ``DeepseekV32Config`` and
``GlmMoeDsaConfig`` (strict dataclasses) and of the modeling code that reads them:

- a missing field takes that class's default (``HF_DEFAULTS``); null is allowed only where the
  class declares ``X | None`` (only ``DeepseekV3Config`` does) and then means what HF's
  modeling code makes of None;
- a value must have the declared JSON type: an int field refuses bools, floats and strings,
  a float field refuses ints (``"rms_norm_eps": 1`` is refused by HF too);
- an explicit per-layer list (``mlp_layer_types``, ``indexer_types``, ``index_topk_pattern``)
  wins over the scalars it would otherwise be derived from (``first_k_dense_replace``,
  ``index_topk_freq`` / ``index_skip_topk_offset``); a scalar that disagrees is a warning on
  the ``"mla_jax"`` logger, as are keys HF ignores although they look meaningful;
- what HF refuses is refused, and so is what HF accepts but mla_jax cannot run (no query LoRA,
  biases, a non-SiLU activation, ...) or what is not finite: a ``CheckpointError`` naming the
  field.

``indexer_rope_interleave`` is an mla_jax (and vLLM) extension that HF ignores: the indexer
pairing defaults by model type (DeepSeek NeoX, GLM interleaved) and the key overrides it.
So is ``num_nextn_predict_layers`` (DeepSeek's and GLM's releases write it; HF runs no MTP
layer): ``ModelConfig.num_mtp_layers``, 0 when missing or null.
"""

from __future__ import annotations

import logging
import math

from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.hf_rope import finite_number, rope_from_hf
from mla_jax.config import IndexerConfig, MLAConfig, RopeConfig
from mla_jax.models.config import MoEConfig, ModelConfig

logger = logging.getLogger("mla_jax")

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3")
HF_CLASSES = {"deepseek_v3": "DeepseekV3Config", "deepseek_v32": "DeepseekV32Config",
              "glm_moe_dsa": "GlmMoeDsaConfig"}

_DEEPSEEK_DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)
# The class defaults of transformers 5.24.0 for every field config_from_hf reads.
HF_DEFAULTS = {
    "deepseek_v3": {**_DEEPSEEK_DEFAULTS, "max_position_embeddings": 4096,
                    "rope_interleave": True},
    "deepseek_v32": {**_DEEPSEEK_DEFAULTS, "max_position_embeddings": 163840,
                     "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
    "glm_moe_dsa": {**_DEEPSEEK_DEFAULTS, "vocab_size": 154880, "hidden_size": 6144,
                    "intermediate_size": 12288, "num_hidden_layers": 78,
                    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
                    "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
                    "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
                    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32},
}
# Fields declared ``X | None``; every other field refuses null.
HF_NULLABLE = {
    "deepseek_v3": frozenset({"num_key_value_heads", "q_lora_rank", "v_head_dim", "n_group",
                              "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                              "norm_topk_prob", "rope_interleave"}),
    "deepseek_v32": frozenset(), "glm_moe_dsa": frozenset(),
}
HF_DEFAULT_ROPE_THETA = 10000.0
HF_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: RMSNorm's default, not rms_norm_eps
HF_INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm LayerNorm
INDEXER_INTERLEAVE_DEFAULT = {"deepseek_v32": False, "glm_moe_dsa": True}
# HF's allowed attention layer types (configuration_utils.ALLOWED_ATTN_LAYER_TYPES) that a
# DSA model may list; HF renames the legacy name on load.
_INDEXED = "indexed_attention"
_LEGACY_LAYER_TYPES = {"deepseek_sparse_attention": _INDEXED}
_HF_ATTENTION_LAYER_TYPES = frozenset({
    "full_attention", "sliding_attention", "chunked_attention", "window_attention", _INDEXED,
    "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse", "conv",
    "moe", "hybrid", "hybrid_sliding", "reference_sliding_attention", "linear_attention"})
# Keys of older DeepSeek configs that HF 5.x no longer reads; other values change nothing in HF.
_IGNORED_WITH_EXPECTED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc",
                          "moe_layer_freq": 1}
_TYPE_NAMES = {int: "an int", float: "a float", bool: "a bool", str: "a string"}


def _is_int(value) -> bool:
  return type(value) is int


class _Fields:
  """Typed reads of one config dict with the defaults and null rules of its HF class."""

  def __init__(self, hf: dict, model_type: str):
    self.hf, self.model_type = hf, model_type
    self.hf_class = HF_CLASSES[model_type]

  def __contains__(self, key: str) -> bool:
    return key in self.hf

  def get(self, key: str):
    defaults = HF_DEFAULTS[self.model_type]
    if key not in self.hf:
      return defaults[key]
    value, kind = self.hf[key], type(defaults[key])
    if value is None:
      if key in HF_NULLABLE[self.model_type]:
        return None
      raise CheckpointError(f"config field {key!r} is null; HF's {self.hf_class} requires "
                            f"{_TYPE_NAMES[kind]}")
    if type(value) is not kind:
      raise CheckpointError(f"config field {key!r} must be {_TYPE_NAMES[kind]} (as HF's "
                            f"{self.hf_class} requires), got {value!r}")
    if kind is float and not math.isfinite(value):
      raise CheckpointError(f"config field {key!r} must be finite, got {value!r}")
    return value

  def positive_int(self, key: str) -> int:
    value = self.get(key)
    if value is None or value <= 0:
      raise CheckpointError(f"config field {key!r} must be a positive int, got {value!r}")
    return value

  def warn(self, message: str) -> None:
    logger.warning("%s config: %s", self.model_type, message)


def _string_list(f: _Fields, key: str) -> list[str] | None:
  value = f.hf.get(key)
  if value is not None and not (isinstance(value, list)
                                and all(isinstance(v, str) for v in value)):
    raise CheckpointError(f"config field {key!r} must be a list of strings (as HF's "
                          f"{f.hf_class} requires), got {value!r}")
  return value


# ---- attention, head sizes and unsupported options ------------------------------------------

def _check_supported(f: _Fields) -> None:
  if f.get("tie_word_embeddings"):
    raise CheckpointError("tie_word_embeddings=true is not supported (lm_head must be untied)")
  if f.get("attention_bias"):
    raise CheckpointError("attention_bias=true is not supported (MLA projections have no bias)")
  if f.get("hidden_act") != "silu":
    raise CheckpointError(f"hidden_act={f.get('hidden_act')!r} is not supported (only 'silu')")
  if f.get("q_lora_rank") is None:
    raise CheckpointError("q_lora_rank=null (no query LoRA) is not supported")
  if f.get("v_head_dim") is None:
    raise CheckpointError("config field 'v_head_dim' is null; HF cannot size o_proj from it")
  heads = f.positive_int("num_attention_heads")
  kv_heads = f.get("num_key_value_heads")
  kv_heads = heads if kv_heads is None else kv_heads  # DeepseekV3Config's fallback
  if kv_heads <= 0 or heads // kv_heads != 1:
    raise CheckpointError(f"num_key_value_heads={kv_heads} is not supported: HF repeats the MLA "
                          f"keys num_attention_heads // num_key_value_heads times, which must "
                          f"be 1 (num_attention_heads={heads})")
  if f.model_type == "deepseek_v3":
    if f.get("rope_interleave") is not True:
      raise CheckpointError(f"rope_interleave={f.get('rope_interleave')!r} is not supported: "
                            "HF's DeepseekV3 then rotates half-split pairs in the main "
                            "attention, mla_jax only interleaved ones")
  elif f.hf.get("rope_interleave") not in (None, True):
    f.warn(f"rope_interleave={f.hf['rope_interleave']!r} is ignored: HF's {f.hf_class} always "
           "interleaves the main attention's RoPE")
  rope_dim = f.positive_int("qk_rope_head_dim")
  nope_dim = f.positive_int("qk_nope_head_dim")
  if f.model_type == "deepseek_v3" and "head_dim" in f and f.hf["head_dim"] != rope_dim:
    # DeepseekV3Config keeps a head_dim from config.json and sizes its RoPE tables with it.
    raise CheckpointError(f"head_dim={f.hf['head_dim']!r} must equal qk_rope_head_dim "
                          f"({rope_dim}): HF's DeepseekV3 sizes the RoPE tables with it")
  if f.model_type != "deepseek_v3" and f.hf.get("head_dim", rope_dim) != rope_dim:
    f.warn(f"head_dim={f.hf['head_dim']!r} is ignored: HF sets it to qk_rope_head_dim")
  if f.hf.get("qk_head_dim", rope_dim + nope_dim) != rope_dim + nope_dim:
    f.warn(f"qk_head_dim={f.hf['qk_head_dim']!r} is ignored: HF's attention uses "
           f"qk_nope_head_dim + qk_rope_head_dim = {rope_dim + nope_dim}")
  for key, expected in _IGNORED_WITH_EXPECTED.items():
    if f.hf.get(key, expected) != expected:
      f.warn(f"{key}={f.hf[key]!r} is ignored: HF {f.hf_class} always uses {expected!r}")


# ---- RoPE -----------------------------------------------------------------------------------

def _rope(f: _Fields, max_positions: int) -> RopeConfig:
  """HF's ``convert_rope_params_to_dict`` + ``standardize_rope_params``, then the one parser."""
  for key in ("rope_scaling", "rope_parameters"):
    if f.hf.get(key) is not None and not isinstance(f.hf[key], dict):
      raise CheckpointError(f"config field {key!r} must be an object, got {f.hf[key]!r}")
  # A non-empty legacy rope_scaling replaces rope_parameters, as in HF.
  source = "rope_scaling" if f.hf.get("rope_scaling") else "rope_parameters"
  params = dict(f.hf.get(source) or {})
  nested = sorted(set(params) & (_HF_ATTENTION_LAYER_TYPES | set(_LEGACY_LAYER_TYPES)))
  if nested:
    raise CheckpointError(f"{source} nested per layer type ({nested}) is not supported")
  if "rope_theta" in params:
    theta, where = params["rope_theta"], f"{source}.rope_theta"
    if "rope_theta" in f and f.hf["rope_theta"] != theta:
      f.warn(f"top-level rope_theta={f.hf['rope_theta']!r} is ignored: {where}={theta!r} "
             "wins, as in HF")
  else:
    theta, where = f.hf.get("rope_theta", HF_DEFAULT_ROPE_THETA), "rope_theta"
  # HF's model build re-standardizes, and a top-level value then wins over the nested one.
  if "original_max_position_embeddings" in f:
    params["original_max_position_embeddings"] = f.hf["original_max_position_embeddings"]
  return rope_from_hf(params, finite_number(where, theta, positive=True), where=source,
                      max_positions=max_positions, mscale_all_dim_scales_softmax=True)


# ---- per-layer schedules --------------------------------------------------------------------

def _dense_prefix(k: int, n: int) -> tuple[str, ...]:
  dense = max(min(k, n), 0)
  return ("dense",) * dense + ("sparse",) * (n - dense)


def _mlp_layer_kinds(f: _Fields, n: int) -> tuple[str, ...]:
  """'dense' or 'sparse' per layer: ``mlp_layer_types`` wins over ``first_k_dense_replace``
  (DeepSeek-V3.2, GLM); DeepSeek-V3 reads the scalar only."""
  k = f.get("first_k_dense_replace")  # type-checked even where the list wins, as HF does
  if f.model_type == "deepseek_v3":
    if k is None:
      raise CheckpointError("config field 'first_k_dense_replace' is null; HF's DeepseekV3 "
                            "compares each layer index with it")
    kinds = _dense_prefix(k, n)
    listed = f.hf.get("mlp_layer_types")
    if listed is not None and list(listed) != list(kinds):
      f.warn("mlp_layer_types is ignored: HF's DeepseekV3 places MoE layers by "
             f"first_k_dense_replace={k}")
    return kinds
  listed = _string_list(f, "mlp_layer_types")
  if listed is None:
    if k < 0:  # HF then derives more entries than layers and refuses the config
      raise CheckpointError(f"config field 'first_k_dense_replace' must be >= 0, got {k}")
    return _dense_prefix(k, n)
  if set(listed) - {"dense", "sparse"} or len(listed) != n:
    raise CheckpointError(f"config field 'mlp_layer_types' must list 'dense' or 'sparse' for "
                          f"each of the {n} layers (num_hidden_layers), got {listed!r}")
  if "first_k_dense_replace" in f and _dense_prefix(k, n) != tuple(listed):
    f.warn(f"first_k_dense_replace={k} disagrees with mlp_layer_types "
           f"({listed.count('dense')} dense layers); mlp_layer_types wins, as in HF")
  return tuple(listed)


def _check_layer_types(f: _Fields, n: int) -> None:
  """``layer_types`` only picks HF's cache class; every DSA layer must be indexed."""
  if f.model_type == "deepseek_v3":
    return
  listed = _string_list(f, "layer_types")
  if listed is None:
    return
  listed = [_LEGACY_LAYER_TYPES.get(t, t) for t in listed]
  if set(listed) - _HF_ATTENTION_LAYER_TYPES or len(listed) != n:
    raise CheckpointError(f"config field 'layer_types' must name an HF attention layer type "
                          f"for each of the {n} layers (num_hidden_layers), got "
                          f"{f.hf['layer_types']!r}")
  if set(listed) != {_INDEXED}:
    raise CheckpointError(f"layer_types other than {_INDEXED!r} are not supported (mla_jax "
                          f"runs DSA attention in every layer), got {f.hf['layer_types']!r}")


def _pattern_types(f: _Fields) -> list | None:
  """``index_topk_pattern``: a string of F (full) / S (shared), or a list used as it is."""
  pattern = f.hf.get("index_topk_pattern")
  if pattern is None or isinstance(pattern, list):
    return pattern
  if not isinstance(pattern, str) or set(pattern) - {"F", "S"}:
    raise CheckpointError(f"config field 'index_topk_pattern' must be a string of 'F'/'S' or a "
                          f"list, got {pattern!r}")
  return ["full" if c == "F" else "shared" for c in pattern]


def _frequency_types(f: _Fields, n: int) -> list[str]:
  """Every ``index_topk_freq``-th layer runs its indexer, counted from
  ``index_skip_topk_offset``, which is unrelated to the dense-MLP layers (confusing the two
  made the first layers of GLM-5.2 misbehave in another engine)."""
  freq, offset = f.hf.get("index_topk_freq", 1), f.hf.get("index_skip_topk_offset", 2)
  for key, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
    if not _is_int(value):
      raise CheckpointError(f"config field {key!r} must be an int, got {value!r}")
  freq = max(freq, 1)  # HF clamps
  return ["full" if max(l - offset + 1, 0) % freq == 0 else "shared" for l in range(n)]


def _indexer_types(f: _Fields, n: int, mtp: int) -> tuple[str, ...] | None:
  """Per layer 'full' or 'shared'; None when every layer runs its indexer.

  GLM: ``indexer_types`` > ``index_topk_pattern`` > ``index_topk_freq``/offset, as in HF; a
  lower-priority form that is given and disagrees is a warning. DeepSeek-V3.2: all full.
  Entries past the ``n`` layers describe the ``mtp`` MTP layers, which always run their own
  indexer: one listed 'shared' is refused.
  """
  scalar_keys = ("index_topk_freq", "index_skip_topk_offset")
  if f.model_type == "deepseek_v32":
    given = [key for key in ("indexer_types", "index_topk_pattern", *scalar_keys)
             if f.hf.get(key) is not None]
    if given:
      f.warn(f"{', '.join(given)} ignored: HF's DeepseekV32 runs the indexer in every layer "
             "(model_type glm_moe_dsa shares top-k across layers)")
    return None
  forms = [("indexer_types", lambda: _string_list(f, "indexer_types")),
           ("index_topk_pattern", lambda: _pattern_types(f)),
           ("index_topk_freq", lambda: _frequency_types(f, n)
            if any(f.hf.get(key) is not None for key in scalar_keys) else None)]
  source = types = None
  for key, derive in forms:
    if source is None:
      types = derive()
      source = key if types is not None else None
      continue
    try:
      derived = derive()
    except CheckpointError:
      derived = "invalid"
    if derived is not None and list(derived)[:n] != list(types)[:n]:
      f.warn(f"{key} disagrees with {source}; {source} wins, as in HF")
  if source is None:
    source, types = "index_topk_freq", _frequency_types(f, n)
  if not all(isinstance(t, str) for t in types) or set(types) - {"full", "shared"}:
    raise CheckpointError(f"config field {source!r} must hold only 'full' and 'shared' "
                          f"entries, got {types!r}")
  if len(types) < n:
    raise CheckpointError(f"config field {source!r}: the indexer schedule has {len(types)} "
                          f"entries for {n} layers")
  for i, kind in enumerate(types[n:n + mtp]):
    if kind == "shared":
      raise CheckpointError(f"config field {source!r} marks MTP layer {n + i} 'shared', but an "
                            "MTP layer has no full layer of its own pass to share top-k with "
                            "(mla_jax runs its own indexer)")
  types = tuple(types[:n])
  return None if set(types) == {"full"} else types


# ---- the config -----------------------------------------------------------------------------

def _moe(f: _Fields) -> MoEConfig:
  values = {}
  for key in ("n_group", "topk_group", "num_experts_per_tok"):
    if f.get(key) is None:
      raise CheckpointError(f"config field {key!r} is null; HF's router needs it when a layer "
                            "is MoE")
    values[key] = f.positive_int(key)
  if "num_local_experts" in f:  # HF's attribute alias, applied last
    experts, key = f.hf["num_local_experts"], "num_local_experts"
  elif f.model_type != "deepseek_v3" and f.hf.get("num_experts") is not None:
    experts, key = f.hf["num_experts"], "num_experts"  # HF's backward-compatible name
  else:
    experts, key = f.get("n_routed_experts"), "n_routed_experts"
  if not _is_int(experts) or experts <= 0:
    raise CheckpointError(f"config field {key!r} must be a positive int, got {experts!r}")
  shared = f.get("n_shared_experts")
  if shared < 0:
    raise CheckpointError(f"config field 'n_shared_experts' must be >= 0, got {shared}")
  return MoEConfig(num_experts=experts, n_shared_experts=shared,
                   moe_intermediate_size=f.positive_int("moe_intermediate_size"),
                   routed_scaling_factor=finite_number("'routed_scaling_factor'",
                                                 f.get("routed_scaling_factor"), positive=True),
                   norm_topk_prob=bool(f.get("norm_topk_prob")),  # HF: `if norm_topk_prob`
                   **values)


def _indexer(f: _Fields) -> IndexerConfig:
  interleave = f.hf.get("indexer_rope_interleave")
  if interleave is None:
    interleave = INDEXER_INTERLEAVE_DEFAULT[f.model_type]
  elif not isinstance(interleave, bool):
    raise CheckpointError(f"config field 'indexer_rope_interleave' must be a bool, got "
                          f"{interleave!r}")
  head_dim = f.positive_int("index_head_dim")
  return IndexerConfig(num_heads=f.positive_int("index_n_heads"), head_dim=head_dim,
                       topk=f.positive_int("index_topk"), rope_interleave=interleave,
                       # exact in fp32 and unknown to HF: used whenever the width allows it
                       use_hadamard=head_dim & (head_dim - 1) == 0,
                       norm_eps=HF_INDEXER_NORM_EPS)


def config_from_hf(hf: dict, *, attention: str = "mqa-only") -> ModelConfig:
  """A ``ModelConfig`` from an HF ``config.json`` dict (rules in the module docstring).

  All-dense models (no 'sparse' layer) get ``moe=None`` and ``first_k_dense_replace=0``; an
  all-"full" indexer schedule becomes ``indexer_types=None``. The latent norms get HF's fixed
  eps (``MLAConfig.latent_norm_eps = 1e-6``), the other norms ``rms_norm_eps``.

  Raises:
    CheckpointError: naming the field HF would refuse or mla_jax cannot run.
  """
  if not isinstance(hf, dict):
    raise CheckpointError(f"the config must be a JSON object, got {type(hf).__name__}")
  model_type = hf.get("model_type")
  if model_type == "deepseek_v4":
    raise CheckpointError("model_type 'deepseek_v4' is DeepSeek-V4, a model of its own: load it "
                          "with mla_jax.v4.load_pretrained (docs/models.md)")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(f"model_type {model_type!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  try:
    return _model_config(_Fields(hf, model_type), attention)
  except CheckpointError:
    raise
  except ValueError as e:  # a value the mla_jax config classes refuse
    raise CheckpointError(f"invalid config: {e}") from None


def _mtp_layers(f: _Fields) -> int:
  """``num_nextn_predict_layers`` (DeepSeek's and GLM's releases: 1); missing or null: 0.

  HF's config classes do not declare it (HF runs no MTP layer), so it is read as is."""
  mtp = f.hf.get("num_nextn_predict_layers")
  if mtp is None:
    return 0
  if not _is_int(mtp) or mtp < 0:
    raise CheckpointError(f"config field 'num_nextn_predict_layers' must be an int >= 0, got "
                          f"{mtp!r}")
  return mtp


def _model_config(f: _Fields, attention: str) -> ModelConfig:
  _check_supported(f)
  n = f.positive_int("num_hidden_layers")
  mtp = _mtp_layers(f)
  kinds = _mlp_layer_kinds(f, n)
  dense = kinds.count("dense")
  if kinds != _dense_prefix(dense, n):
    raise CheckpointError(f"mlp_layer_types {list(kinds)!r} is not supported: mla_jax needs "
                          "the 'dense' layers then the 'sparse' ones")
  _check_layer_types(f, n)
  moe = _moe(f) if dense < n else None
  indexer = indexer_types = None
  if f.model_type != "deepseek_v3":
    indexer, indexer_types = _indexer(f), _indexer_types(f, n, mtp)
  max_positions = f.positive_int("max_position_embeddings")
  mla = MLAConfig(hidden_size=f.positive_int("hidden_size"),
                  num_heads=f.positive_int("num_attention_heads"),
                  q_lora_rank=f.positive_int("q_lora_rank"),
                  kv_lora_rank=f.positive_int("kv_lora_rank"),
                  qk_nope_head_dim=f.positive_int("qk_nope_head_dim"),
                  qk_rope_head_dim=f.positive_int("qk_rope_head_dim"),
                  v_head_dim=f.positive_int("v_head_dim"), rope=_rope(f, max_positions),
                  max_position_embeddings=max_positions, latent_norm_eps=HF_LATENT_NORM_EPS,
                  indexer=indexer)
  return ModelConfig(mla=mla, vocab_size=f.positive_int("vocab_size"), num_layers=n,
                     intermediate_size=f.positive_int("intermediate_size"), moe=moe,
                     first_k_dense_replace=dense if moe is not None else 0,
                     attention=attention, indexer_types=indexer_types, num_mtp_layers=mtp,
                     rms_norm_eps=finite_number("'rms_norm_eps'", f.get("rms_norm_eps"),
                                          positive=True))


def fp8_block_size(hf: dict) -> tuple[int, int]:
  """``quantization_config.weight_block_size`` of an fp8 checkpoint; [128, 128] by default."""
  quant = hf.get("quantization_config") or {}
  block = quant.get("weight_block_size", [128, 128]) if isinstance(quant, dict) else None
  if not (isinstance(block, list) and len(block) == 2 and all(_is_int(b) and b > 0
                                                              for b in block)):
    raise CheckpointError(f"config field 'quantization_config.weight_block_size' must be "
                          f"[int, int], got {block!r}")
  return tuple(block)
