"""Logit parity with Hugging Face transformers on tiny random models (optional: needs torch).

Each case builds a random HF model, saves it with ``save_pretrained(safe_serialization=True)``,
loads the directory with ``mla_jax.checkpoints.load_pretrained`` and compares float32 logits
on a prompt longer than ``index_topk``, so the indexer's selection matters.

16 indexer heads: with few heads, ReLU often zeroes every head and exact-zero scores tie at
the k-th place; mla_jax breaks ties by the lower index (docs/design.md §5) while ``torch.topk``
leaves the order unspecified, so tied selections (not bugs) would differ.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from mla_jax.checkpoints import load_pretrained  # noqa: E402

TOPK = 4
COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
              num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
              n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.5,
              kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
              v_head_dim=16, max_position_embeddings=256, first_k_dense_replace=1,
              tie_word_embeddings=False)
CASES = {
    "deepseek_v32": ("DeepseekV32ForCausalLM", "DeepseekV32Config", dict(
        num_hidden_layers=2, n_group=2, topk_group=1, index_topk=TOPK, index_head_dim=32,
        index_n_heads=16, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                          "factor": 4.0, "original_max_position_embeddings": 64,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                          "mscale_all_dim": 1.0})),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", dict(
        num_hidden_layers=3, n_group=1, topk_group=1, index_topk=TOPK, index_head_dim=32,
        index_n_heads=16, indexer_types=["full", "shared", "full"], rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 8e6})),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        num_hidden_layers=2, n_group=2, topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def _randomize(model, seed):
  """Weights at a 1/sqrt(fan_in) scale and norms near 1 (HF's 0.02 init hides mistakes)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        value = (1.0 if name.endswith("weight") else 0.0) + 0.1 * noise
      elif "e_score_correction_bias" in name:
        value = 0.05 * noise.abs()  # keeps biased scores >= 0: HF's 0.0 group fill is exact
      else:
        value = noise * p.shape[-1] ** -0.5
      p.copy_(value.to(p.dtype))


@pytest.mark.parametrize("model_type", list(CASES))
def test_logits_match_transformers(tmp_path, model_type):
  class_name, config_name, fields = CASES[model_type]
  if not hasattr(transformers, class_name):
    pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
  config = getattr(transformers, config_name)(**COMMON, **fields)
  torch.manual_seed(0)
  hf_model = getattr(transformers, class_name)(config).to(torch.float32).eval()
  hf_model.config._attn_implementation = "eager"
  _randomize(hf_model, seed=1)
  hf_model.save_pretrained(tmp_path, safe_serialization=True)

  ids = np.random.default_rng(2).integers(0, 64, (1, 12))
  with torch.no_grad():
    expected = hf_model(torch.as_tensor(ids)).logits.float().numpy()
  model = load_pretrained(tmp_path, dtype=jnp.float32)
  got = np.asarray(model(jnp.asarray(ids, jnp.int32), model.init_cache(1, 16))[0])
  diff = float(np.abs(got - expected).max())
  print(f"{model_type}: max |logit diff| = {diff:.3g}")
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_recall_checkpoint_matches_transformers():
  """The shipped ``recall`` checkpoint (its MTP layer included in the files: HF ignores it)
  gives HF's logits on a lookup prompt longer than its top-k 16."""
  from mla_jax.presets import RECALL_CHECKPOINT
  from mla_jax.tokenizer import ByteTokenizer

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      RECALL_CHECKPOINT, dtype=torch.float32, attn_implementation="eager").eval()
  ids = np.asarray([ByteTokenizer().encode("aQ ..kX zB ...mP rT ..wE cV ?kX ?z")])
  with torch.no_grad():
    expected = hf_model(torch.as_tensor(ids)).logits.float().numpy()
  model = load_pretrained(RECALL_CHECKPOINT, dtype=jnp.float32)
  got = np.asarray(model(jnp.asarray(ids, jnp.int32), model.init_cache(1, ids.shape[1]))[0])
  print(f"recall: max |logit diff| = {float(np.abs(got - expected).max()):.3g}")
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
