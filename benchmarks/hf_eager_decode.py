"""HF transformers eager decode on a tiny DeepSeek-V3.2 checkpoint (run by a side Python).

    PYTHON_WITH_TORCH benchmarks/hf_eager_decode.py OUT_DIR --batches 1 8 32

Needs only torch, transformers and numpy (not mla_jax; torch is imported where it is used, so
``prompts`` can be imported without it), so ``benchmarks/decode.py`` runs it
with the interpreter of a side virtual environment given as ``--hf-python``. It builds a random
``DeepseekV32ForCausalLM`` with the dimensions of mla_jax's tiny preset, saves it to OUT_DIR
(safetensors, for mla_jax to load the same weights), then times greedy decoding with the KV
cache in eager attention and prints one JSON object: decode tokens/s per batch (the best of
``--repeats`` runs after a warm-up) and the batch-1 greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

# mla_jax's tiny preset (models/config.py tiny_lm) in HF's field names.
TINY_V32 = dict(
    vocab_size=260, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=1.0,
    kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    max_position_embeddings=4096, first_k_dense_replace=1, num_hidden_layers=2,
    index_topk=16, index_head_dim=32, index_n_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


def prompts(seed: int, batch: int, length: int) -> np.ndarray:
  """The prompts both sides decode from (``benchmarks/decode.py`` draws the same ones)."""
  return np.random.default_rng(seed).integers(0, 256, (batch, length))


def build(out_dir: str, seed: int):
  import torch
  import transformers

  torch.manual_seed(seed)
  model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**TINY_V32))
  model = model.to(torch.float32).eval()
  model.config._attn_implementation = "eager"
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():  # weights at 1/sqrt(fan_in), norms near 1: logits with real margins
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
      elif "e_score_correction_bias" in name:
        p.copy_(0.05 * noise.abs())
      else:
        p.copy_(noise * p.shape[-1] ** -0.5)
  model.save_pretrained(out_dir, safe_serialization=True)
  return model


def decode(model, ids: np.ndarray, new_tokens: int):
  """Greedy: prefill, then ``new_tokens - 1`` one-token steps. Returns (tokens, decode s)."""
  import torch

  with torch.no_grad():
    out = model(torch.as_tensor(ids), use_cache=True)
    cache, next_B = out.past_key_values, out.logits[:, -1].argmax(-1)
    tokens = [next_B]
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
      out = model(next_B[:, None], past_key_values=cache, use_cache=True)
      cache, next_B = out.past_key_values, out.logits[:, -1].argmax(-1)
      tokens.append(next_B)
    return torch.stack(tokens, 1).tolist(), time.perf_counter() - t0


def main() -> None:
  # This folder's kernels.py would shadow the optional ``kernels`` package transformers probes.
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
  import torch
  import transformers

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out_dir")
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  warnings.filterwarnings("ignore")  # deprecation notices about the cache argument's name
  model = build(args.out_dir, args.seed)
  ids = prompts(args.seed, max(args.batches), args.prompt_len)
  result = {"torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "tokens_per_s": {}}
  for batch in args.batches:
    tokens, _ = decode(model, ids[:batch], args.new_tokens)  # warm-up
    times = [decode(model, ids[:batch], args.new_tokens)[1] for _ in range(args.repeats)]
    result["tokens_per_s"][batch] = batch * (args.new_tokens - 1) / min(times)
    if batch == 1:
      result["tokens"] = tokens[0]
  print(json.dumps(result))


if __name__ == "__main__":
  main()
