"""``mla-jax generate --checkpoint DIR`` on a ``deepseek_v4`` checkpoint.

``mla_jax.cli`` hands a V4 checkpoint here once it has read its ``model_type``. ``--mesh``
shards it by ``mla_jax.v4.sharding``'s rules; ``--dtype fp8`` keeps its fp8 and fp4 weights as
stored; ``--speculative-tokens`` drafts with its MTP layers. Flags for what V4 does not have yet (several processes, a context axis, fp8 caches,
the V3.2 route choice) are refused by name, before anything is loaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from mla_jax import sharding
from mla_jax.checkpoints.loading import read_config
from mla_jax.v4.hf_config import MODEL_TYPE

_DTYPES = {"bf16": jnp.bfloat16, "float32": jnp.float32, "fp8": "fp8"}


def is_v4_checkpoint(checkpoint: str | None) -> bool:
  return bool(checkpoint) and read_config(Path(checkpoint)).get("model_type") == MODEL_TYPE


def _refuse_unsupported(args: argparse.Namespace) -> None:
  context = args.mesh and sharding.parse_mesh_spec(args.mesh)[sharding.CONTEXT] > 1
  unsupported = {
      "--mesh with a 'context' axis": context, "--coordinator": args.coordinator,
      "--cache-dtype": args.cache_dtype != "fp32" and args.cache_dtype,
      "--attention dense-capable": args.attention != "mqa-only"}
  named = [flag for flag, value in unsupported.items() if value]
  if named:
    raise SystemExit(f"error: {', '.join(named)}: not supported for DeepSeek-V4 checkpoints "
                     "yet (docs/models.md)")


def cmd_generate_v4(args: argparse.Namespace) -> int:
  """``mla_jax.cli.cmd_generate`` on a V4 checkpoint (its prompt defaults already applied)."""
  _refuse_unsupported(args)
  from mla_jax.cli import _prompt_ids, _sampling, _tokenizer, print_generated
  from mla_jax.v4.checkpoint import load_pretrained
  from mla_jax.v4.generate import generate

  mesh = sharding.make_mesh(args.mesh) if args.mesh else None
  t0 = time.perf_counter()
  model = load_pretrained(args.checkpoint, dtype=_DTYPES[args.dtype or "bf16"],
                          compute_dtype=args.compute_dtype and _DTYPES[args.compute_dtype],
                          backend=args.backend, mesh=mesh, mtp=args.speculative_tokens > 0)
  build_s = time.perf_counter() - t0
  config = model.config
  tok = _tokenizer(args, config.vocab_size)
  prompt = _prompt_ids(args, tok, config.vocab_size)
  temperature, top_p = _sampling(args)
  print(f"model: DeepSeek-V4 x {config.num_layers} layers, backend {model.backend.name}, "
        f"window {config.sliding_window}, index_topk {config.index_topk}, "
        f"built in {build_s:.2f}s")
  if mesh is not None:
    print(f"mesh: {args.mesh} over {jax.device_count()} devices")
  print(f"tokenizer: {tok.describe()}")
  print(f"prompt: {len(prompt)} tokens")
  print(f"sampling: temperature {temperature:g}, top_p {top_p:g}")
  result = generate(model, [prompt] * args.batch, args.max_new_tokens,
                    temperature=temperature, top_p=top_p, seed=args.seed,
                    eos_id=tok.eos_ids if args.stop_at_eos else None, progress=not args.quiet,
                    speculative_tokens=args.speculative_tokens)
  for i, selection in enumerate(result.selections):
    print(f"layer {i}: {selection}")
  print_generated(args, tok, result)
  if result.acceptance_rate is not None:
    print(f"speculative: {args.speculative_tokens} draft tokens per step, "
          f"{result.accepted} of {result.drafted} accepted ({result.acceptance_rate:.2f})")
  return 0
