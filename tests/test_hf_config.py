"""HF config rules: a matrix generated from the defaults transformers documents.

``HF_DOCUMENTED`` is copied from transformers 5.24.0's ``DeepseekV3Config``,
``DeepseekV32Config`` and ``GlmMoeDsaConfig`` (independently of mla_jax's own table). Every
field that ``config_from_hf`` reads is taken out (its default must appear), set to null
(refused naming the field, or what HF's modeling code makes of None where HF allows it) and
given a value of the wrong JSON type (refused naming the field). Per-layer lists are put
against the scalars they would be derived from: the list wins and a warning is logged. Where
transformers is installed, every case is also given to HF's own class, which must accept it
exactly when mla_jax does (or refuse it only for what mla_jax does not support).
"""

import dataclasses
import json
import logging

import pytest

from mla_jax.checkpoints import CheckpointError, config_from_hf, config_to_hf
from tests.checkpoint_models import small_config
from tests.helpers import MISSING, patch_hf_config

try:  # optional: cross-checks each case against HF's own config classes
  import transformers
except ImportError:
  transformers = None

_DEEPSEEK = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)
HF_DOCUMENTED = {
    "deepseek_v3": {**_DEEPSEEK, "max_position_embeddings": 4096, "rope_interleave": True},
    "deepseek_v32": {**_DEEPSEEK, "max_position_embeddings": 163840, "index_topk": 2048,
                     "index_head_dim": 128, "index_n_heads": 64},
    "glm_moe_dsa": {**_DEEPSEEK, "vocab_size": 154880, "hidden_size": 6144,
                    "intermediate_size": 12288, "num_hidden_layers": 78,
                    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
                    "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1,
                    "topk_group": 1, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
                    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32},
}
HF_CLASS = {"deepseek_v3": "DeepseekV3Config", "deepseek_v32": "DeepseekV32Config",
            "glm_moe_dsa": "GlmMoeDsaConfig"}
# Where each field lands in the ModelConfig (None: checked by loading only).
WHERE = {
    "vocab_size": lambda c: c.vocab_size, "hidden_size": lambda c: c.mla.hidden_size,
    "intermediate_size": lambda c: c.intermediate_size,
    "moe_intermediate_size": lambda c: c.moe.moe_intermediate_size,
    "num_hidden_layers": lambda c: c.num_layers, "num_attention_heads": lambda c: c.mla.num_heads,
    "num_key_value_heads": None, "n_shared_experts": lambda c: c.moe.n_shared_experts,
    "n_routed_experts": lambda c: c.moe.num_experts,
    "routed_scaling_factor": lambda c: c.moe.routed_scaling_factor,
    "kv_lora_rank": lambda c: c.mla.kv_lora_rank, "q_lora_rank": lambda c: c.mla.q_lora_rank,
    "qk_rope_head_dim": lambda c: c.mla.qk_rope_head_dim,
    "v_head_dim": lambda c: c.mla.v_head_dim,
    "qk_nope_head_dim": lambda c: c.mla.qk_nope_head_dim, "n_group": lambda c: c.moe.n_group,
    "topk_group": lambda c: c.moe.topk_group,
    "num_experts_per_tok": lambda c: c.moe.num_experts_per_tok,
    "first_k_dense_replace": lambda c: c.first_k_dense_replace,
    "norm_topk_prob": lambda c: c.moe.norm_topk_prob, "hidden_act": None,
    "rms_norm_eps": lambda c: c.rms_norm_eps,
    "max_position_embeddings": lambda c: c.mla.max_position_embeddings,
    "tie_word_embeddings": None, "attention_bias": None, "rope_interleave": None,
    "index_topk": lambda c: c.mla.indexer.topk, "index_head_dim": lambda c: c.mla.indexer.head_dim,
    "index_n_heads": lambda c: c.mla.indexer.num_heads,
}
# DeepseekV3Config's ``X | None`` fields: what null means there (HF's modeling code).
V3_NULLS = {"num_key_value_heads": "loads", "norm_topk_prob": "loads",
            "q_lora_rank": "unsupported", "rope_interleave": "unsupported",
            "v_head_dim": "refused", "n_group": "refused", "topk_group": "refused",
            "num_experts_per_tok": "refused", "first_k_dense_replace": "refused"}
WRONG_TYPES = {int: ["7", 7.0, True], float: [1, "1e-6"], bool: [1, "true"], str: [1]}


def _full(model_type, **changes):
  """An explicit config with every documented default written out, then ``changes``."""
  return patch_hf_config({"model_type": model_type, **HF_DOCUMENTED[model_type]}, **changes)


def _hf_class_accepts(hf):
  """None without transformers; else whether HF's own config class takes ``hf``."""
  if transformers is None:
    return None
  try:
    getattr(transformers, HF_CLASS[hf["model_type"]]).from_dict(json.loads(json.dumps(hf)))
  except Exception:  # noqa: BLE001 - any refusal counts
    return False
  return True


def _cases():
  for model_type, defaults in HF_DOCUMENTED.items():
    for field, default in defaults.items():
      yield pytest.param(model_type, field, default, id=f"{model_type}-{field}")


@pytest.mark.parametrize("model_type", list(HF_DOCUMENTED))
def test_an_empty_config_takes_every_documented_default(model_type):
  config = config_from_hf({"model_type": model_type})
  assert config == config_from_hf(_full(model_type))
  for field, default in HF_DOCUMENTED[model_type].items():
    if WHERE[field] is not None:
      assert WHERE[field](config) == default, field
  assert config.mla.rope.theta == 10000.0 and config.mla.rope.yarn is None
  assert config.mla.latent_norm_eps == 1e-6 and config.indexer_types is None
  if model_type != "deepseek_v3":
    interleave = model_type == "glm_moe_dsa"
    assert config.mla.indexer.rope_interleave is interleave
    assert config.mla.indexer.norm_eps == 1e-6


@pytest.mark.parametrize("model_type,field,default", _cases())
def test_missing_field_takes_the_default(model_type, field, default):
  changed = dict(HF_DOCUMENTED[model_type])
  changed[field] = _other_value(field, default)
  explicit = _full(model_type, **{field: changed[field]})
  try:
    config_from_hf(explicit)  # the other value loads (or is refused for its own reason)
  except CheckpointError:
    pass
  assert config_from_hf(_full(model_type, **{field: MISSING})) == config_from_hf(
      _full(model_type))


def _other_value(field, default):
  if isinstance(default, bool) or isinstance(default, str):
    return default
  return default * 2 if field != "num_hidden_layers" else 64


@pytest.mark.parametrize("model_type,field,default", _cases())
def test_null_fields(model_type, field, default):
  hf = _full(model_type, **{field: None})
  outcome = V3_NULLS.get(field, "refused") if model_type == "deepseek_v3" else "refused"
  if outcome == "loads":
    config = config_from_hf(hf)
    if field == "norm_topk_prob":  # HF: `if self.norm_topk_prob:`
      assert config.moe.norm_topk_prob is False
    else:  # DeepseekV3Config: num_key_value_heads = num_attention_heads
      assert config == config_from_hf(_full(model_type))
  else:
    with pytest.raises(CheckpointError, match=f"{field}") as err:
      config_from_hf(hf)
    assert outcome == "unsupported" or "null" in str(err.value)
  accepts = _hf_class_accepts(hf)
  if accepts is not None:  # HF's class refuses every null it does not declare
    assert accepts == (model_type == "deepseek_v3" and field in V3_NULLS)


@pytest.mark.parametrize("model_type,field,default", _cases())
def test_wrong_json_types_name_the_field(model_type, field, default):
  for value in WRONG_TYPES[type(default)]:
    hf = _full(model_type, **{field: value})
    with pytest.raises(CheckpointError, match=f"'{field}' must be (a|an) "):
      config_from_hf(hf)
    assert _hf_class_accepts(hf) in (None, False), (field, value)


def _small(model_type, layers=4, **fields):
  return _full(model_type, num_hidden_layers=layers, **fields)


def _resolved_by_hf(hf):
  """HF's own per-layer lists for ``hf`` (None without transformers)."""
  if transformers is None:
    return None
  config = getattr(transformers, HF_CLASS[hf["model_type"]]).from_dict(json.loads(json.dumps(hf)))
  if hf["model_type"] == "deepseek_v3":  # its modeling code reads first_k_dense_replace only
    mlp = ["dense" if l < config.first_k_dense_replace else "sparse"
           for l in range(config.num_hidden_layers)]
  else:
    mlp = list(config.mlp_layer_types)
  return (mlp,
          list(getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers))


def _ours(config):
  n = config.num_layers
  mlp = ["sparse" if config.uses_moe(l) else "dense" for l in range(n)]
  return mlp, list(config.indexer_types or ("full",) * n)


@pytest.mark.parametrize("model_type,fields,warning,mlp,indexer", [
    # mlp_layer_types wins over first_k_dense_replace (the all-dense V3.2 config).
    ("deepseek_v32", dict(first_k_dense_replace=1, mlp_layer_types=["dense"] * 4),
     "first_k_dense_replace=1 disagrees with mlp_layer_types", "DDDD", "FFFF"),
    ("glm_moe_dsa", dict(first_k_dense_replace=1, mlp_layer_types=["dense"] * 2 + ["sparse"] * 2),
     "first_k_dense_replace=1 disagrees with mlp_layer_types", "DDSS", "FFFF"),
    ("glm_moe_dsa", dict(first_k_dense_replace=2, mlp_layer_types=["dense"] * 2 + ["sparse"] * 2),
     None, "DDSS", "FFFF"),
    ("deepseek_v32", dict(mlp_layer_types=["dense"] + ["sparse"] * 3,
                          first_k_dense_replace=MISSING), None, "DSSS", "FFFF"),
    # indexer_types wins over index_topk_pattern and index_topk_freq / offset.
    ("glm_moe_dsa", dict(indexer_types=["full", "shared", "full", "shared"], index_topk_freq=1),
     "index_topk_freq disagrees with indexer_types", "DDDS", "FSFS"),
    ("glm_moe_dsa", dict(indexer_types=["full", "shared"] * 2, index_topk_pattern="FFFF"),
     "index_topk_pattern disagrees with indexer_types", "DDDS", "FSFS"),
    ("glm_moe_dsa", dict(indexer_types=["full", "full", "shared", "full"], index_topk_freq=2),
     None, "DDDS", "FFSF"),
    ("glm_moe_dsa", dict(index_topk_pattern="FSSF", index_topk_freq=2, index_skip_topk_offset=1),
     "index_topk_freq disagrees with index_topk_pattern", "DDDS", "FSSF"),
    ("glm_moe_dsa", dict(index_topk_pattern=["full", "shared", "full", "full"]), None, "DDDS",
     "FSFF"),
    ("glm_moe_dsa", dict(indexer_types=["full"] * 4 + ["shared"], index_topk_freq=None), None,
     "DDDS", "FFFF"),  # an MTP entry past the layers; the ignored scalar may be null
    ("glm_moe_dsa", dict(index_topk_freq=0, index_skip_topk_offset=3), None, "DDDS", "FFFF"),
    # Keys HF's class for the model type does not read are ignored, with a warning.
    ("deepseek_v3", dict(first_k_dense_replace=1, mlp_layer_types=["dense"] * 4),
     "mlp_layer_types is ignored", "DSSS", "FFFF"),
    ("deepseek_v32", dict(indexer_types=["full", "shared", "full", "shared"]),
     "indexer_types ignored: HF's DeepseekV32 runs the indexer in every layer", "DDDS", "FFFF"),
    ("deepseek_v3", dict(first_k_dense_replace=9), None, "DDDD", "FFFF"),
    ("deepseek_v3", dict(first_k_dense_replace=-1), None, "SSSS", "FFFF"),
])
def test_per_layer_lists_win_over_scalars(caplog, model_type, fields, warning, mlp, indexer):
  caplog.set_level(logging.WARNING, logger="mla_jax")
  hf = _small(model_type, **fields)
  config = config_from_hf(hf)
  letters = {"D": "dense", "S": "sparse", "F": "full"}
  expected = ([letters[c] for c in mlp], [letters[c] if c != "S" else "shared" for c in indexer])
  assert _ours(config) == expected
  if warning is None:
    assert not caplog.records
  else:
    assert len(caplog.records) == 1 and warning in caplog.text
    assert caplog.records[0].name == "mla_jax"
  by_hf = _resolved_by_hf(hf)
  if by_hf is not None:
    assert by_hf[0] == expected[0]
    if model_type == "glm_moe_dsa":
      assert by_hf[1][:4] == expected[1]


@pytest.mark.parametrize("model_type,fields,pattern,hf_accepts", [
    ("deepseek_v32", dict(mlp_layer_types=["dense"] * 5), "each of the 4 layers", False),
    ("glm_moe_dsa", dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]),
     "'mlp_layer_types' must list 'dense' or 'sparse'", False),
    ("glm_moe_dsa", dict(mlp_layer_types=["sparse", "dense", "sparse", "sparse"]),
     "mla_jax needs the 'dense' layers then the 'sparse' ones", True),
    ("deepseek_v32", dict(first_k_dense_replace=-1), "'first_k_dense_replace' must be >= 0",
     False),
    ("glm_moe_dsa", dict(layer_types=["indexed_attention"] * 3), "each of the 4 layers", False),
    ("glm_moe_dsa", dict(layer_types=["full_attention"] * 4),
     "layer_types other than 'indexed_attention'", True),
    ("glm_moe_dsa", dict(layer_types=["nope"] * 4), "'layer_types' must name", False),
    ("glm_moe_dsa", dict(index_topk_pattern="FSX"), "'index_topk_pattern' must be", False),
    ("glm_moe_dsa", dict(index_topk_pattern="FFF"), "3 entries for 4 layers", True),
    ("glm_moe_dsa", dict(index_topk_freq=None), "'index_topk_freq' must be an int", False),
    ("glm_moe_dsa", dict(indexer_types="FSFS"), "'indexer_types' must be a list", False),
    ("glm_moe_dsa", dict(indexer_types=["shared", "full", "full", "full"]),
     "starting with a 'full' layer", True),
    ("glm_moe_dsa", dict(indexer_types=["full", "sometimes", "full", "full"]),
     "only 'full' and 'shared'", True),
])
def test_bad_per_layer_lists(model_type, fields, pattern, hf_accepts):
  hf = _small(model_type, **fields)
  with pytest.raises(CheckpointError, match=pattern):
    config_from_hf(hf)
  accepts = _hf_class_accepts(hf)
  assert accepts in (None, hf_accepts)


def test_legacy_layer_type_name_is_accepted():
  hf = _small("glm_moe_dsa", layer_types=["deepseek_sparse_attention"] * 4)
  assert config_from_hf(hf) == config_from_hf(_small("glm_moe_dsa"))


@pytest.mark.parametrize("fields,check,warning", [
    (dict(qk_head_dim=7), lambda c: c.mla.qk_head_dim == 192, "qk_head_dim=7 is ignored"),
    (dict(head_dim=96), lambda c: c.mla.qk_rope_head_dim == 64, "head_dim=96 is ignored"),
    (dict(rope_interleave=False), lambda c: True, "rope_interleave=False is ignored"),
    (dict(scoring_func="softmax"), lambda c: True, "scoring_func='softmax' is ignored"),
    (dict(num_experts=16), lambda c: c.moe.num_experts == 16, None),
    (dict(num_local_experts=32, num_experts=16), lambda c: c.moe.num_experts == 32, None),
    (dict(original_max_position_embeddings=4096,
          rope_parameters={"rope_type": "yarn", "factor": 40.0,
                           "original_max_position_embeddings": 2048}),
     lambda c: c.mla.rope.yarn.original_max_position_embeddings == 4096, None),
    (dict(rope_parameters={"rope_type": "yarn", "factor": None,
                           "original_max_position_embeddings": 4096}),
     lambda c: c.mla.rope.yarn.factor == 163840 / 4096, None),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": None,
                           "beta_slow": 0}),
     lambda c: (c.mla.rope.yarn.beta_fast, c.mla.rope.yarn.beta_slow) == (32.0, 1.0), None),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     lambda c: c.mla.rope.yarn.original_max_position_embeddings == 163840, None),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
          rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
     lambda c: c.mla.rope.yarn.factor == 4.0 and c.mla.rope.theta == 10000.0, None),
])
def test_fields_hf_reads_its_own_way(caplog, fields, check, warning):
  caplog.set_level(logging.WARNING, logger="mla_jax")
  hf = _full("deepseek_v32", **fields)
  assert check(config_from_hf(hf))
  assert (warning in caplog.text) if warning else not caplog.records
  assert _hf_class_accepts(hf) in (None, True)


@pytest.mark.parametrize("model_type,fields,pattern", [
    ("deepseek_v3", dict(head_dim=32), "head_dim=32 must equal qk_rope_head_dim"),
    ("deepseek_v3", dict(q_lora_rank=None), "q_lora_rank=null"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=False is not supported"),
    ("deepseek_v32", dict(num_key_value_heads=1), "num_key_value_heads=1 is not supported"),
    ("deepseek_v32", dict(rope_parameters={"rope_type": "yarn"}), "factor is missing"),
    ("deepseek_v32", dict(rope_parameters={"rope_type": "yarn", "factor": None,
                                           "mscale_all_dim": 1.0}), "factor is null"),
    ("deepseek_v32", dict(rope_parameters={"rope_type": "yarn", "factor": 0.5}), "factor=0.5"),
    ("deepseek_v32", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     "rope_type='dynamic' is not supported"),
    ("deepseek_v32", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                           "truncate": False}), "truncate=false"),
    ("deepseek_v32", dict(rope_theta=None, rope_parameters=None), "rope_theta"),
])
def test_what_mla_jax_cannot_run_is_refused_by_name(model_type, fields, pattern):
  with pytest.raises(CheckpointError, match=pattern):
    config_from_hf(_full(model_type, **fields))


@pytest.mark.parametrize("value", [[], "deepseek_v32", None, 3])
def test_a_config_must_be_an_object(value):
  with pytest.raises(CheckpointError, match="the config must be a JSON object"):
    config_from_hf(value)


@pytest.mark.parametrize("kind", ["ds32", "glm", "v3"])
def test_exports_are_configs_hf_accepts(kind):
  config = small_config(kind)
  hf = config_to_hf(config)
  assert config_from_hf(hf, attention=config.attention) == config
  assert _hf_class_accepts(hf) in (None, True)
  dense = dataclasses.replace(config, moe=None, first_k_dense_replace=0)
  assert config_from_hf(config_to_hf(dense)) == dense
  assert _hf_class_accepts(config_to_hf(dense)) in (None, True)
