"""What ``mla-jax generate`` and ``mla-jax serve`` do differently for a ``deepseek_v4``
checkpoint: its flags' limits, its loader and what they print about it.

``mla_jax.cli`` asks ``is_v4_checkpoint`` once it has the checkpoint's directory; then
``check_flags`` refuses, by name and before anything is loaded, what V4 does not have yet
(several processes, a context axis, drafts under serve, the V3.2 route choice), and
``load`` builds the model: ``--mesh`` shards it by ``mla_jax.v4.sharding``'s rules,
``--dtype fp8`` keeps its fp8 and fp4 weights as stored, and its MTP layers are read only
for speculative decoding.
This module imports nothing of ``mla_jax.cli``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp

from mla_jax import sharding
from mla_jax.checkpoints.loading import read_config
from mla_jax.v4.hf_config import MODEL_TYPE, v4_config_from_hf

DTYPES = {"bf16": jnp.bfloat16, "float32": jnp.float32, "fp8": "fp8"}


def is_v4_checkpoint(checkpoint: str | None) -> bool:
  return bool(checkpoint) and read_config(Path(checkpoint)).get("model_type") == MODEL_TYPE


def check_flags(args: argparse.Namespace, *, serving: bool = False) -> None:
  """``SystemExit`` naming each flag a V4 checkpoint cannot take (yet); ``serving``: those of
  ``mla-jax serve`` (its engine drafts for no model with per-sequence state yet)."""
  context = args.mesh and sharding.parse_mesh_spec(args.mesh)[sharding.CONTEXT] > 1
  unsupported = {
      "--mesh with a 'context' axis": context, "--coordinator": args.coordinator,
      "--attention dense-capable": args.attention != "mqa-only",
      "--speculative-tokens with mla-jax serve": serving and args.speculative_tokens > 0}
  named = [flag for flag, value in unsupported.items() if value]
  if named:
    raise SystemExit(f"error: {', '.join(named)}: not supported for DeepSeek-V4 checkpoints "
                     "yet (docs/models.md)")


def vocab_size(checkpoint: str) -> int:
  """The checkpoint's vocabulary, read before anything is loaded."""
  return v4_config_from_hf(read_config(Path(checkpoint))).vocab_size


def load(args: argparse.Namespace, mesh, *, mtp: bool):
  """The ``V4CausalLM`` of ``args.checkpoint`` (its MTP layers only with ``mtp``)."""
  from mla_jax.v4.checkpoint import load_pretrained

  return load_pretrained(args.checkpoint, dtype=DTYPES[args.dtype or "bf16"],
                         compute_dtype=args.compute_dtype and DTYPES[args.compute_dtype],
                         backend=args.backend, mesh=mesh, mtp=mtp)


def describe(model, build_s: float) -> str:
  config = model.config
  return (f"model: DeepSeek-V4 x {config.num_layers} layers, backend {model.backend.name}, "
          f"window {config.sliding_window}, index_topk {config.index_topk}, "
          f"built in {build_s:.2f}s")


def layer_lines(model, selections) -> list[str]:
  """What each layer selects among compressed entries (``GenerationResult.prefill_routes``)."""
  return [f"layer {i}: {layer.self_attn.layer_type}: compressed {selection.value}"
          for i, (layer, selection) in enumerate(zip(model.model.layers, selections))]
