import dataclasses

import pytest

import mla_jax as m
from mla_jax.models.config import MoEConfig, ModelConfig, tiny_lm


def test_presets_have_spec_dimensions():
  v32, glm, v3 = m.deepseek_v32(), m.glm5(), m.deepseek_v3()
  assert (v32.hidden_size, v32.num_heads, v32.latent_dim, v32.qk_head_dim) == (7168, 128, 576, 192)
  assert (v32.indexer.num_heads, v32.indexer.topk, v32.indexer.rope_interleave) == (64, 2048, False)
  assert (glm.qk_head_dim, glm.v_head_dim, glm.indexer.num_heads) == (256, 256, 32)
  assert glm.indexer.rope_interleave is True
  assert v3.indexer is None
  assert m.tiny().indexer.topk == 16


def test_softmax_scales_match_spec():
  assert m.deepseek_v32().softmax_scale == pytest.approx(0.1352338, abs=5e-8)
  assert m.glm5().softmax_scale == pytest.approx(0.0625)
  assert m.deepseek_v32().indexer.score_scale == pytest.approx(0.0110485, abs=5e-8)
  assert m.glm5().indexer.score_scale == pytest.approx(0.015625)


@pytest.mark.parametrize("field, value", [
    ("num_heads", 0), ("kv_lora_rank", -4), ("qk_rope_head_dim", 15), ("hidden_size", 1.5),
    ("latent_norm_eps", 0.0), ("latent_norm_eps", float("inf")), ("latent_norm_eps", True),
    ("max_position_embeddings", 0), ("indexer", "yes"),
])
def test_mla_config_rejects_bad_field(field, value):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(m.tiny(), **{field: value})


@pytest.mark.parametrize("field, value", [
    ("num_heads", 0), ("topk", 0), ("head_dim", 48), ("rope_interleave", 1),
])
def test_indexer_config_rejects_bad_field(field, value):
  with pytest.raises(ValueError, match=f"indexer.{field}"):
    dataclasses.replace(m.IndexerConfig(), **{field: value})


@pytest.mark.parametrize("build, field", [
    (lambda v: m.RopeConfig(theta=v), "rope.theta"),
    (lambda v: m.YarnConfig(factor=v), "yarn.factor"),
    (lambda v: m.YarnConfig(beta_fast=v), "yarn.beta_fast"),
    (lambda v: m.YarnConfig(mscale=v), "yarn.mscale"),
    (lambda v: m.YarnConfig(mscale_all_dim=v), "yarn.mscale_all_dim"),
    (lambda v: m.IndexerConfig(norm_eps=v), "indexer.norm_eps"),
    (lambda v: dataclasses.replace(m.tiny(), latent_norm_eps=v), "latent_norm_eps"),
    (lambda v: dataclasses.replace(tiny_lm(), rms_norm_eps=v), "rms_norm_eps"),
    (lambda v: MoEConfig(num_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                         routed_scaling_factor=v),
     "moe.routed_scaling_factor"),
])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -float("inf")])
def test_non_finite_floats_are_refused(build, field, value):
  with pytest.raises(ValueError, match=f"{field} must be .*finite"):
    build(value)


def test_bools_are_not_numbers_or_counts():
  with pytest.raises(ValueError, match="moe.n_shared_experts"):
    MoEConfig(num_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
              n_shared_experts=True)
  with pytest.raises(ValueError, match="moe.norm_topk_prob"):
    MoEConfig(num_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
              norm_topk_prob=1)
  with pytest.raises(ValueError, match="first_k_dense_replace"):
    dataclasses.replace(tiny_lm(), first_k_dense_replace=False)
  with pytest.raises(ValueError, match="rope.theta"):
    m.RopeConfig(theta=True)


def test_indexer_head_dim_must_hold_rope():
  with pytest.raises(ValueError, match="indexer.head_dim"):
    dataclasses.replace(m.tiny(), indexer=m.IndexerConfig(head_dim=8, use_hadamard=True))


def test_yarn_and_rope_validation():
  with pytest.raises(ValueError, match="yarn.beta_fast"):
    m.YarnConfig(beta_fast=1.0, beta_slow=2.0)
  with pytest.raises(ValueError, match="rope.theta"):
    m.RopeConfig(theta=-1.0)


def test_model_config_validation():
  with pytest.raises(ValueError, match="attention"):
    dataclasses.replace(tiny_lm(), attention="dense")
  with pytest.raises(ValueError, match="moe.n_group"):
    MoEConfig(num_experts=8, n_group=3)
  with pytest.raises(ValueError, match="moe.topk_group"):
    MoEConfig(num_experts=8, n_group=2, topk_group=3)
  with pytest.raises(ValueError, match="vocab_size"):
    ModelConfig(mla=m.tiny(), vocab_size=0, num_layers=1, intermediate_size=8)


def test_configs_are_frozen_and_hashable():
  cfg = m.tiny()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.num_heads = 3
  assert hash(cfg) == hash(m.tiny())
