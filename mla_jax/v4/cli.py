"""``mla-jax generate --checkpoint DIR`` on a ``deepseek_v4`` checkpoint.

``mla_jax.cli`` hands a V4 checkpoint here once it has read its ``model_type``. Flags for what
V4 does not have yet (a mesh, fp8 weights or caches, speculative decoding, the V3.2 route
choice) are refused by name, before anything is loaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from mla_jax import tokenizer
from mla_jax.checkpoints.generation_config import read_generation_config
from mla_jax.checkpoints.loading import read_config
from mla_jax.v4.hf_config import MODEL_TYPE

_DTYPES = {"bf16": jnp.bfloat16, "float32": jnp.float32}


def is_v4_checkpoint(checkpoint: str | None) -> bool:
  return bool(checkpoint) and read_config(Path(checkpoint)).get("model_type") == MODEL_TYPE


def _refuse_unsupported(args: argparse.Namespace) -> None:
  unsupported = {
      "--mesh": args.mesh, "--coordinator": args.coordinator,
      "--speculative-tokens": args.speculative_tokens,
      "--cache-dtype": args.cache_dtype != "fp32" and args.cache_dtype,
      "--dtype fp8": args.dtype == "fp8", "--compute-dtype": args.compute_dtype,
      "--attention dense-capable": args.attention != "mqa-only"}
  named = [flag for flag, value in unsupported.items() if value]
  if named:
    raise SystemExit(f"error: {', '.join(named)}: not supported for DeepSeek-V4 checkpoints "
                     "yet (docs/models.md)")


def cmd_generate_v4(args: argparse.Namespace) -> int:
  """``mla_jax.cli.cmd_generate`` on a V4 checkpoint (its prompt defaults already applied)."""
  _refuse_unsupported(args)
  from mla_jax.v4.checkpoint import load_pretrained
  from mla_jax.v4.generate import generate

  t0 = time.perf_counter()
  model = load_pretrained(args.checkpoint, dtype=_DTYPES[args.dtype or "bf16"],
                          backend=args.backend)
  build_s = time.perf_counter() - t0
  config = model.config
  tok = tokenizer.checkpoint_tokenizer(args.checkpoint)
  if args.prompt is not None or args.stop_at_eos or isinstance(tok, tokenizer.HFTokenizer):
    tok.check_fits(config.vocab_size)
  if args.stop_at_eos and not tok.eos_ids:
    raise ValueError(f"--stop-at-eos: {tok.describe()} names no EOS token")
  if args.prompt is not None:
    prompt = tok.encode(args.prompt)
  else:
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, min(config.vocab_size, 256), size=args.prompt_len).tolist()
  defaults = read_generation_config(args.checkpoint)
  temperature = defaults.temperature if args.temperature is None else args.temperature
  top_p = defaults.top_p if args.top_p is None else args.top_p
  print(f"model: DeepSeek-V4 x {config.num_layers} layers, backend {model.backend.name}, "
        f"window {config.sliding_window}, index_topk {config.index_topk}, "
        f"built in {build_s:.2f}s")
  print(f"tokenizer: {tok.describe()}")
  print(f"prompt: {len(prompt)} tokens")
  print(f"sampling: temperature {temperature:g}, top_p {top_p:g}")
  result = generate(model, [prompt] * args.batch, args.max_new_tokens,
                    temperature=temperature, top_p=top_p, seed=args.seed,
                    eos_id=tok.eos_ids if args.stop_at_eos else None, progress=not args.quiet)
  for i, selection in enumerate(result.selections):
    print(f"layer {i}: {selection}")
  ids = result.tokens[0]
  print(f"generated ids: {ids}")
  if args.prompt is not None:
    print(f"generated text: {tok.decode(ids)!r}")
  print(f"compile time: {result.compile_s:.2f}s")
  print(f"prefill: {result.prefill_tokens} tokens, {result.prefill_tokens_per_s:.1f} tokens/s")
  if result.decode_tokens:
    print(f"decode: {result.decode_tokens} tokens, {result.decode_tokens_per_s:.1f} tokens/s")
  else:
    print("decode: no decode step (the first token comes from the prefill)")
  return 0
