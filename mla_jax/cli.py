"""``mla-jax`` command line: ``generate`` (the main job) and ``routes`` (the route demo)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import tokenizer
from mla_jax.backends import BACKEND_NAMES, get_backend
from mla_jax.models.config import ATTENTION_KINDS, small_lm, tiny_lm

PRESETS = {"tiny": tiny_lm, "small": small_lm}


def _build_model(args):
  from mla_jax.models.lm import CausalLM

  if args.checkpoint:
    from mla_jax.checkpoints import load_pretrained

    return load_pretrained(args.checkpoint, attention=args.attention, backend=args.backend)
  return CausalLM(PRESETS[args.preset](args.attention), rngs=nnx.Rngs(args.seed),
                  backend=args.backend)


def _prompt_ids(args, vocab_size: int) -> list[int]:
  if args.prompt is not None:
    ids = tokenizer.encode(args.prompt)
    if max(ids) >= vocab_size:
      raise SystemExit(f"error: the byte tokenizer needs a vocabulary of {tokenizer.VOCAB_SIZE}, "
                       f"the model has {vocab_size}")
    return ids
  rng = np.random.default_rng(args.seed)
  return rng.integers(0, min(vocab_size, 256), size=args.prompt_len).tolist()


def cmd_generate(args) -> int:
  from mla_jax.generation import generate

  t0 = time.perf_counter()
  model = _build_model(args)
  build_s = time.perf_counter() - t0
  prompt = _prompt_ids(args, model.config.vocab_size)
  print(f"model: {type(model.layer_module(0).self_attn).__name__} x "
        f"{model.config.num_layers} layers, backend {model.backend.name}, "
        f"index_topk {model.config.mla.indexer.topk if model.config.mla.indexer else '-'}, "
        f"built in {build_s:.2f}s")
  print(f"prompt: {len(prompt)} tokens")
  eos = tokenizer.EOS_ID if args.stop_at_eos else None
  result = generate(model, [prompt], args.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, seed=args.seed, eos_id=eos, progress=not args.quiet)
  for i, route in enumerate(result.prefill_routes):
    print(f"prefill route, layer {i}: {route.value}")
  ids = result.tokens[0]
  print(f"generated ids: {ids}")
  if args.prompt is not None:
    print(f"generated text: {tokenizer.decode(ids)!r}")
  print(f"compile time: {result.compile_s:.2f}s")
  print(f"prefill: {result.prefill_tokens} tokens, {result.prefill_tokens_per_s:.1f} tokens/s")
  print(f"decode: {result.decode_tokens} tokens, {result.decode_tokens_per_s:.1f} tokens/s")
  return 0


def cmd_routes(args) -> int:
  """Per prefill length: each class's route, whether scoring ran, and the outputs' difference."""
  from mla_jax import testing
  from mla_jax.attention import DeepseekV32Attention, MLAAttention
  from mla_jax.cache import init_layer_cache
  from mla_jax.inspect import traced_scopes

  config = tiny_lm().mla
  backend = get_backend(args.backend)
  dense = MLAAttention(config, rngs=nnx.Rngs(args.seed), backend=backend)
  testing.randomize_params(dense, args.seed)
  mqa = DeepseekV32Attention(config, rngs=nnx.Rngs(args.seed), backend=backend)
  nnx.update(mqa, nnx.state(dense, nnx.Param))
  topk = config.indexer.topk
  print(f"tiny preset, index_topk {topk}, backend {backend.name}")
  print("| length | MLAAttention route | scored | DeepseekV32Attention route | scored | "
        "max |diff| |")
  print("|---|---|---|---|---|---|")
  for length in (1, topk - 1, topk, topk + 1, 4 * topk):
    x = testing.random_hidden(length, (1, length, config.hidden_size))
    cache = init_layer_cache(config, 1, 4 * topk)
    row, outs = [str(length)], []
    for layer in (dense, mqa):
      fwd = nnx.jit(lambda layer, x, c: layer(x, c, num_cached_tokens=0).out_BTD)
      scopes = traced_scopes(fwd, layer, x, cache)
      row += [layer.prefill_route(length).value, "yes" if "indexer_score" in scopes else "no"]
      outs.append(fwd(layer, x, cache))
    row.append(f"{float(jnp.abs(outs[0] - outs[1]).max()):.2e}")
    print("| " + " | ".join(row) + " |")
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="mla-jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  gen = sub.add_parser("generate", help="jit-compiled generation on a built-in or HF model")
  gen.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="built-in model with random weights from --seed (default tiny)")
  gen.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face safetensors checkpoint")
  source = gen.add_mutually_exclusive_group()
  source.add_argument("--prompt", help="text prompt (byte-level tokenizer)")
  source.add_argument("--prompt-len", type=int, default=24,
                      help="random prompt of this many ids when no --prompt (default 24)")
  gen.add_argument("--max-new-tokens", type=int, default=32)
  gen.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
  gen.add_argument("--attention", choices=ATTENTION_KINDS, default="mqa-only")
  gen.add_argument("--seed", type=int, default=0)
  gen.add_argument("--temperature", type=float, default=0.0)
  gen.add_argument("--top-p", type=float, default=1.0)
  gen.add_argument("--stop-at-eos", action="store_true", help="stop at the tokenizer's EOS id")
  gen.add_argument("--quiet", action="store_true", help="no progress bar")
  gen.set_defaults(func=cmd_generate)
  routes = sub.add_parser("routes", help="route demo: which route each module class takes")
  routes.add_argument("--backend", choices=BACKEND_NAMES, default="xla")
  routes.add_argument("--seed", type=int, default=0)
  routes.set_defaults(func=cmd_routes)
  return parser


def main(argv=None) -> int:
  logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
  args = build_parser().parse_args(argv)
  if getattr(args, "prompt_len", 1) < 1:
    raise SystemExit("error: --prompt-len must be >= 1")
  if getattr(args, "max_new_tokens", 1) < 1:
    raise SystemExit("error: --max-new-tokens must be >= 1")
  try:
    return args.func(args)
  except (ValueError, TypeError, OSError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
