"""Full-size DeepSeek-V4 plans: parameter bytes (``nnx.eval_shape``) and what the caches take.

A V4 layer caches per token only its compressed entries: ``head_dim / m`` values (CSA: also
the indexer's ``index_head_dim / m``); the window is a ring of ``sliding_window`` rows and
each compressor keeps the last ``m`` or ``2m`` tokens' projections, fixed per sequence.

V4 has no partition rules yet, so the per-GPU figures assume its bytes split evenly over the
GPUs (what tensor and expert parallelism would approach); they say whether a size can fit,
not how it is split.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.backends import XlaBackend
from mla_jax.plan import FIT_FRACTION, GPUS
from mla_jax.v4.config import CSA, HCA, MOE, HASH_MOE, SLIDING, V4Config
from mla_jax.v4.model import V4CausalLM


def _alternating(first: str, second: str, n: int) -> tuple[str, ...]:
  return tuple(first if i % 2 == 0 else second for i in range(n))


# The published sizes. V4-Flash is HF's DeepseekV4Config defaults with the release's
# compress_ratios (two sliding layers, then CSA and HCA alternating); V4-Pro's dimensions
# are its config's (MindFormers' DeepseekV4Config mirrors them) with HF's default schedule
# (two HCA layers, then HCA and CSA alternating).
V4_SIZES = {
    "deepseek_v4_flash": V4Config(
        layer_types=(SLIDING, SLIDING) + _alternating(CSA, HCA, 41),
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 40),
    "deepseek_v4_pro": V4Config(
        hidden_size=7168, moe_intermediate_size=3072, num_attention_heads=128,
        q_lora_rank=1536, o_groups=16, index_topk=1024, n_routed_experts=384,
        routed_scaling_factor=2.5, layer_types=(HCA, HCA) + _alternating(HCA, CSA, 59),
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 58),
}
CONTEXTS = (131072, 1048576)


@dataclasses.dataclass(frozen=True)
class V4Plan:
  model: str
  param_bytes: int  # all of them: bf16 weights; float32 norms, mHC, routers, biases
  token_bytes: int  # one more cached token, all layers
  sequence_bytes: int  # per sequence whatever its length: window rings, compressor state
  gpus: int

  def sequence_total(self, context: int) -> int:
    return self.sequence_bytes + context * self.token_bytes

  def sequences_that_fit(self, gpu: str, context: int) -> int:
    free = FIT_FRACTION * GPUS[gpu] * self.gpus - self.param_bytes
    return max(int(free // self.sequence_total(context)), 0)


def param_bytes(config: V4Config, dtype=jnp.bfloat16) -> int:
  abstract = nnx.eval_shape(lambda: V4CausalLM(config, rngs=nnx.Rngs(0), backend=XlaBackend(),
                                               param_dtype=dtype))
  return sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(nnx.state(abstract)))


def cache_bytes(config: V4Config, itemsize: int = 2) -> tuple[int, int]:
  """(bytes per token, bytes per sequence) of every layer's cache (``init_cache``'s arrays)."""
  per_token = per_sequence = 0
  for layer_type in config.layer_types:
    per_sequence += config.sliding_window * config.head_dim * itemsize
    if layer_type == SLIDING:
      continue
    m = config.compress_ratio(layer_type)
    per_token += config.head_dim * itemsize / m
    state_tokens = 2 * m if layer_type == CSA else m
    width = 2 * config.head_dim if layer_type == CSA else config.head_dim
    per_sequence += 2 * state_tokens * width * itemsize  # kv and gate
    if layer_type == CSA:
      per_token += config.index_head_dim * itemsize / m
      per_sequence += 2 * state_tokens * 2 * config.index_head_dim * itemsize
  return round(per_token), per_sequence


def make_plan(model: str, gpus: int = 8) -> V4Plan:
  config = V4_SIZES[model]
  token, sequence = cache_bytes(config)
  return V4Plan(model, param_bytes(config), token, sequence, gpus)


def format_plan(p: V4Plan, gpu: str = "H200 141GB") -> str:
  config = V4_SIZES[p.model]
  counts = {t: config.layer_types.count(t) for t in (SLIDING, CSA, HCA)}
  lines = [
      f"{p.model}: {config.num_layers} layers ({counts[SLIDING]} sliding, {counts[CSA]} CSA, "
      f"{counts[HCA]} HCA), {p.param_bytes / 2**30:,.1f} GiB of bf16 parameters, "
      f"{p.param_bytes / p.gpus / 2**30:,.1f} GiB per GPU split evenly over {p.gpus} x {gpu}",
      f"cache (bf16): {p.token_bytes:,} B per token over all layers, plus "
      f"{p.sequence_bytes / 2**20:,.1f} MiB per sequence (window rings, compressor state)",
      "| context | cache per sequence | sequences that fit |",
      "|---|---|---|"]
  for context in CONTEXTS:
    lines.append(f"| {context:,} | {p.sequence_total(context) / 2**30:,.2f} GiB | "
                 f"{p.sequences_that_fit(gpu, context):,} |")
  return "\n".join(lines)
