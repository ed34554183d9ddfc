"""The ``mla-jax`` command line: its commands (``DESCRIPTION``, what ``--help`` says), their
arguments, and what each runs."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import presets, sharding, tokenizer
from mla_jax.backends import BACKEND_NAMES, get_backend
from mla_jax.backends.gpu_support import BackendUnavailable
from mla_jax.cache import CACHE_DTYPE_NAMES, init_layer_cache
from mla_jax.context_parallel import CONTEXT_TOPK_MODES
from mla_jax.checkpoints.generation_config import (GENERATION_CONFIG, GenerationDefaults,
                                                   read_generation_config)
from mla_jax.decoding import DECODE_STEPS_PER_DISPATCH
from mla_jax.models.config import ATTENTION_KINDS, FULL_SIZE, small_lm, tiny_lm, tiny_moe_lm
from mla_jax.plan import FIT_FRACTION, HOST_POOL_BYTES, HOST_POOL_FRACTION
from mla_jax.v4 import cli as v4_cli
from mla_jax.v4.plan import V4_SIZES

logger = logging.getLogger("mla_jax")

DESCRIPTION = ("generate (the main job), serve (an OpenAI-compatible server), routes (the route "
               "demo), plan (full-size memory plans on a named mesh, nothing allocated) and "
               "train (a named training recipe).")
PRESETS = {"tiny": tiny_lm, "tiny-moe": tiny_moe_lm, "small": small_lm}  # random weights
TRAINED_PRESETS = {"recall": presets.RECALL_CHECKPOINT}  # shipped checkpoints
DEFAULT_PRESET = "recall"  # the one whose answers mean something
# The recall model's task (its MODEL_CARD.md): one-letter key-value pairs, '.' filler, then
# '?k' asks for the value stored under k (here X).
RECALL_PROMPT = "aQ ..kX zB ...mP rT ..wE cV ?k"
DEFAULT_NEW_TOKENS = 32
DEFAULT_PROMPT_LEN = 24


def int_in(low: int, high: int | None = None):
  """An argparse type: an int in [low, high) (no upper bound when high is None)."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < low or (high is not None and value >= high):
      bound = f"in [{low}, {high})" if high is not None else f">= {low}"
      raise argparse.ArgumentTypeError(f"must be an int {bound}, got {value}")
    return value

  return parse


def float_in(low: float, high: float, *, low_open: bool = False):
  """An argparse type: a finite float in [low, high] (or (low, high] with ``low_open``)."""

  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and (value > low if low_open else value >= low)
            and value <= high):
      bound = (f"{'>' if low_open else '>='} {low:g}" if math.isinf(high) else
               f"in {'(' if low_open else '['}{low:g}, {high:g}]")
      raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
    return value

  return parse


def _compilation_cache(args) -> None:
  """Points JAX's persistent compilation cache at ``--compilation-cache`` (every program,
  however quick to compile: the step programs are many small ones)."""
  if not args.compilation_cache:
    return
  import jax

  Path(args.compilation_cache).mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pages_or_auto(text: str):
  """``--num-pages``: a positive int, or ``auto`` (what fits beside the weights)."""
  return "auto" if text == "auto" else int_in(1)(text)


def _num_pages(args, model) -> int:
  """``--num-pages``, or with ``auto`` the pages that fit next to the model's weights on its
  busiest device (``plan.live_capacity``, the rule of ``mla-jax plan``), printed."""
  if args.num_pages != "auto":
    return args.num_pages
  import jax

  from mla_jax import plan
  from mla_jax.serving.engine import page_bytes

  capacity = plan.live_capacity(model, page_bytes(model, args.page_size, args.cache_dtype,
                                                  mtp=args.speculative_tokens > 0))
  if jax.process_index() == 0:
    print(f"--num-pages auto: {capacity.describe()}", flush=True)
  ranks = sharding.axis_size(model.mesh, sharding.CONTEXT)
  pages = capacity.pages - capacity.pages % ranks  # whole pages on every context rank
  if pages < 1:
    raise SystemExit("--num-pages auto: not one page fits beside the weights; give a number, "
                     "a smaller --page-size or --cache-dtype, or shard over more devices")
  return pages


def _start_processes(args) -> None:
  """Joins a multi-process run (``jax.distributed``) before anything touches a device."""
  flags = (args.coordinator, args.num_processes, args.process_id)
  if all(f is None for f in flags):
    return
  if any(f is None for f in flags):
    raise SystemExit("error: --coordinator, --num-processes and --process-id go together")
  if args.process_id >= args.num_processes:
    raise SystemExit(f"error: --process-id must be in [0, {args.num_processes}), got "
                     f"{args.process_id}")
  host, _, port = args.coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise SystemExit(f"error: --coordinator must be HOST:PORT, got {args.coordinator!r}")
  import jax

  # CPU devices of different processes talk through gloo; GPUs use their own collectives.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id)


_DTYPES = {"bf16": jnp.bfloat16, "float32": jnp.float32, "fp8": "fp8"}
_COMPUTE_DTYPES = {"bf16": jnp.bfloat16, "float32": jnp.float32}


def _config(args):
  """The model's config, read before anything is built (a checkpoint's from config.json)."""
  if args.checkpoint:
    from mla_jax.checkpoints import config_from_hf
    from mla_jax.checkpoints.loading import read_config

    return config_from_hf(read_config(Path(args.checkpoint)), attention=args.attention)
  return PRESETS[args.preset](args.attention)


def _speculative_config(args, config):
  """With ``--speculative-tokens`` a random preset gets a random MTP layer to draft with."""
  if args.speculative_tokens > 0 and not args.checkpoint:
    return dataclasses.replace(config, num_mtp_layers=max(config.num_mtp_layers, 1))
  return config


def _build_model(args, config, mesh, mtp: bool = False):
  """The model; ``mtp``: with a checkpoint's MTP layers (speculative decoding drafts with
  them)."""
  from mla_jax.models.lm import CausalLM

  if args.checkpoint:
    from mla_jax.checkpoints import load_pretrained

    compute = _COMPUTE_DTYPES[args.compute_dtype] if args.compute_dtype else None
    # Plain decoding never runs the MTP layers: leave their memory (and load time) out.
    return load_pretrained(args.checkpoint, dtype=_DTYPES[args.dtype or "bf16"],
                           compute_dtype=compute, attention=args.attention,
                           backend=args.backend, mesh=mesh, mtp=mtp)
  return CausalLM(config, rngs=nnx.Rngs(args.seed), backend=args.backend, mesh=mesh,
                  param_dtype=_DTYPES[args.dtype or "float32"])


def _tokenizer(args, vocab_size: int) -> tokenizer.Tokenizer:
  """The checkpoint's tokenizer (byte tokenizer without a tokenizer.json or for presets),
  checked against the model's vocabulary where it will be used."""
  tok = tokenizer.checkpoint_tokenizer(args.checkpoint) if args.checkpoint else \
      tokenizer.ByteTokenizer()
  if isinstance(tok, tokenizer.HFTokenizer) or args.prompt is not None or args.stop_at_eos:
    tok.check_fits(vocab_size)
  if args.stop_at_eos and not tok.eos_ids:
    raise ValueError(f"--stop-at-eos: {tok.describe()} names no EOS token")
  return tok


def _sampling(args) -> tuple[float, float]:
  """Temperature and top_p: a flag wins, then the checkpoint's generation_config.json."""
  defaults = read_generation_config(args.checkpoint) if args.checkpoint else GenerationDefaults()
  return (defaults.temperature if args.temperature is None else args.temperature,
          defaults.top_p if args.top_p is None else args.top_p)


def _prompt_ids(args, tok: tokenizer.Tokenizer, vocab_size: int) -> list[int]:
  if args.prompt is not None:
    return tok.encode(args.prompt)
  rng = np.random.default_rng(args.seed)
  return rng.integers(0, min(vocab_size, 256), size=args.prompt_len).tolist()


def _request_defaults(args) -> None:
  """The recall preset answers a lookup (one token) when given neither --prompt nor
  --prompt-len; the others draw --prompt-len random ids and generate 32 tokens."""
  recall = args.preset == "recall" and not args.checkpoint
  if args.prompt is None and args.prompt_len is None:
    if recall:
      args.prompt = RECALL_PROMPT
    else:
      args.prompt_len = DEFAULT_PROMPT_LEN
  if args.max_new_tokens is None:  # the recall model answers with one token; more is noise
    args.max_new_tokens = 1 if recall else DEFAULT_NEW_TOKENS


def print_generated(args, tok: tokenizer.Tokenizer, result) -> None:
  """The first sequence's ids (and text, for a text prompt), compile time and throughput."""
  ids = result.tokens[0]
  print(f"generated ids: {ids}")
  if args.prompt is not None:
    print(f"generated text: {tok.decode(ids)!r}")
  print(f"compile time: {result.compile_s:.2f}s")
  print(f"prefill: {result.prefill_tokens} tokens, {result.prefill_tokens_per_s:.1f} tokens/s")
  if result.decode_tokens:
    print(f"decode: {result.decode_tokens} tokens, {result.decode_tokens_per_s:.1f} tokens/s")
  else:  # the only token came from the prefill: there was no decode step to time
    print("decode: no decode step (the first token comes from the prefill)")


def cmd_generate(args) -> int:
  _request_defaults(args)
  if args.preset in TRAINED_PRESETS and not args.checkpoint:
    args.checkpoint = str(TRAINED_PRESETS[args.preset])
    args.dtype = args.dtype or "float32"  # the precision it was trained and evaluated in
  v4 = v4_cli.is_v4_checkpoint(args.checkpoint)
  if v4:
    v4_cli.check_flags(args)
  mesh_sizes = sharding.parse_mesh_spec(args.mesh) if args.mesh else None
  if mesh_sizes and mesh_sizes[sharding.CONTEXT] > 1:
    raise SystemExit(f"--mesh {args.mesh}: a 'context' axis splits the page pools of "
                     "mla-jax serve's engine; generate's contiguous caches cannot be split "
                     "over it")
  _start_processes(args)
  import jax

  _compilation_cache(args)
  from mla_jax.generation import generate

  mesh = sharding.make_mesh(mesh_sizes) if mesh_sizes else None
  if jax.process_index() != 0:  # every process computes; the first one reports
    sys.stdout = open(os.devnull, "w")
  speculative = args.speculative_tokens > 0
  config = None if v4 else _speculative_config(args, _config(args))
  tok = _tokenizer(args, v4_cli.vocab_size(args.checkpoint) if v4 else config.vocab_size)
  temperature, top_p = _sampling(args)
  t0 = time.perf_counter()
  model = (v4_cli.load(args, mesh, mtp=speculative) if v4 else
           _build_model(args, config, mesh, mtp=speculative))
  build_s = time.perf_counter() - t0
  prompt = _prompt_ids(args, tok, model.vocab_size)
  print(v4_cli.describe(model, build_s) if v4 else _describe(model, build_s))
  if mesh is not None:
    print(f"mesh: {args.mesh} over {jax.device_count()} devices in "
          f"{jax.process_count()} process(es)")
  print(f"tokenizer: {tok.describe()}")
  if not v4:
    layer_cache = jax.eval_shape(lambda: init_layer_cache(model.config.mla, 1, 1,
                                                          args.cache_dtype))
    print(f"cache: {args.cache_dtype}, {layer_cache.bytes_per_token} bytes per token per layer")
  print(f"prompt: {len(prompt)} tokens")
  print(f"sampling: temperature {temperature:g}, top_p {top_p:g}")
  eos = tok.eos_ids if args.stop_at_eos else None
  result = generate(model, [prompt] * args.batch, args.max_new_tokens,
                    temperature=temperature, top_p=top_p, seed=args.seed, eos_id=eos,
                    cache_dtype=args.cache_dtype, speculative_tokens=args.speculative_tokens,
                    progress=not args.quiet and jax.process_index() == 0)
  for line in (v4_cli.layer_lines(model, result.prefill_routes) if v4 else
               [f"prefill route, layer {i}: {route.value}"
                for i, route in enumerate(result.prefill_routes)]):
    print(line)
  print_generated(args, tok, result)
  if result.acceptance_rate is not None:
    print(f"speculative: {args.speculative_tokens} draft tokens per step, "
          f"{result.accepted} of {result.drafted} accepted ({result.acceptance_rate:.2f})")
  return 0


def _describe(model, build_s: float) -> str:
  config = model.config
  return (f"model: {type(model.layer_module(0).self_attn).__name__} x {config.num_layers} "
          f"layers, backend {model.backend.name}, index_topk "
          f"{config.mla.indexer.topk if config.mla.indexer else '-'}, built in {build_s:.2f}s")


def cmd_serve(args) -> int:
  """Builds the model and the engine, then serves until SIGTERM (process 0; the other
  processes of a multi-process run follow its steps)."""
  name = args.served_model_name or (Path(args.checkpoint).name if args.checkpoint else
                                    args.preset)
  if args.preset in TRAINED_PRESETS and not args.checkpoint:
    args.checkpoint = str(TRAINED_PRESETS[args.preset])
    args.dtype = args.dtype or "float32"
  v4 = v4_cli.is_v4_checkpoint(args.checkpoint)
  if v4:
    v4_cli.check_flags(args, serving=True)
  api_key = args.api_key or os.environ.get("MLA_JAX_API_KEY")
  mesh_sizes = sharding.parse_mesh_spec(args.mesh) if args.mesh else None
  _start_processes(args)
  import jax

  _compilation_cache(args)
  from mla_jax.serving import Engine
  from mla_jax.serving.engine_loop import EngineLoop
  from mla_jax.serving.metrics import ServerMetrics
  from mla_jax.serving.server import ServerSettings, create_app, run

  mesh = sharding.make_mesh(mesh_sizes) if mesh_sizes else None
  config = None if v4 else _speculative_config(args, _config(args))
  vocab_size = v4_cli.vocab_size(args.checkpoint) if v4 else config.vocab_size
  tok = tokenizer.checkpoint_tokenizer(args.checkpoint) if args.checkpoint else \
      tokenizer.ByteTokenizer()
  if isinstance(tok, tokenizer.HFTokenizer):
    tok.check_fits(vocab_size)
  template, template_source = _chat_template(args)
  model = (v4_cli.load(args, mesh, mtp=False) if v4 else
           _build_model(args, config, mesh, mtp=args.speculative_tokens > 0))
  num_pages = _num_pages(args, model)
  engine = Engine(model, num_pages=num_pages, page_size=args.page_size,
                  max_num_seqs=args.max_num_seqs, max_step_tokens=args.max_step_tokens,
                  max_model_len=args.max_model_len, cache_dtype=args.cache_dtype,
                  tokenizer=tok, eos_token_ids=[t for t in tok.eos_ids if t < vocab_size],
                  prefix_caching=args.prefix_caching, log_interval=args.log_interval,
                  seed=args.seed, max_speculative_tokens=args.speculative_tokens,
                  decode_steps=args.decode_steps, prompt_logprobs=args.prompt_logprobs,
                  context_topk=args.dcp_indexer_mode,
                  structured_outputs=args.structured_outputs)

  def warmup():  # every process compiles every program before any step runs
    count, seconds = engine.warmup(progress=jax.process_index() == 0,
                                   every_reach=args.warmup_every_reach)
    if jax.process_index() == 0:
      print(f"warm-up: {count} step programs compiled in {seconds:.1f} s; ready", flush=True)

  if jax.process_index() != 0:
    if args.warmup:
      warmup()
    engine.follow()
    return 0
  has_defaults = args.checkpoint and (Path(args.checkpoint) / GENERATION_CONFIG).is_file()
  defaults = read_generation_config(args.checkpoint) if has_defaults else \
      GenerationDefaults(temperature=1.0)  # OpenAI's default without a checkpoint's own
  tool_parser, reasoning_parser = _output_parsers(args)
  settings = ServerSettings(
      model_name=name, tokenizer=tok, chat_template=template,
      max_model_len=engine.max_model_len, vocab_size=vocab_size,
      pool_tokens=engine.num_pages * engine.page_size, api_key=api_key,
      max_body_bytes=args.max_body_bytes, max_pending=args.max_pending,
      temperature=defaults.temperature, top_p=defaults.top_p,
      speculative_tokens=args.speculative_tokens, tool_parser=tool_parser,
      reasoning_parser=reasoning_parser)
  metrics = ServerMetrics(engine.num_pages)
  # Process 0 listens while it warms up: /health answers 503 "warming up" until it is done.
  loop = EngineLoop(engine, metrics, warmup=warmup if args.warmup else None)
  app = create_app(loop, settings, metrics)
  layers = (f"DeepSeek-V4 x {model.config.num_layers}" if v4 else
            f"{type(model.layer_module(0).self_attn).__name__} x {config.num_layers}")
  print(f"serving {name!r} ({layers} layers, backend {model.backend.name}, "
        f"{engine.num_pages} pages "
        f"of {engine.page_size} tokens, context {engine.max_model_len}, chat template "
        f"{template_source}, tool-call parser "
        f"{tool_parser or 'none'}, reasoning parser {reasoning_parser or 'none'}) on "
        f"http://{args.host}:{args.port}/v1"
        + (" (compiling its step programs first: /health answers 503 until then)"
           if args.warmup else ""), flush=True)
  try:
    run(app, loop, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout)
  finally:
    engine.shutdown()  # releases the other processes of a multi-process run
    print("server stopped", flush=True)
  return 0


TOOL_CALL_PARSERS = ("deepseek_v32", "deepseek_v4", "glm45")  # serving.tool_parsers.TOOL_PARSERS
REASONING_PARSERS = ("deepseek_v3", "glm45")    # serving.reasoning.REASONING_PARSERS


def _chat_template(args):
  """``(template, where it came from)`` for ``serve``: ``serving_template``'s choice, with a
  warning when it is the plain format."""
  from mla_jax.serving.chat import serving_template

  template, source = serving_template(args.checkpoint, args.chat_template, _model_type(args))
  if template.is_plain:
    preset = TRAINED_PRESETS.get(args.preset)
    is_preset = args.checkpoint is None or preset is not None and args.checkpoint == str(preset)
    logger.warning("%s has no chat template: chat requests are rendered in the plain "
                   "'role: content' format, which the model was likely not trained on; give "
                   "--chat-template FILE",
                   f"the {args.preset} preset" if is_preset else args.checkpoint)
  return template, source


def _model_type(args) -> str | None:
  """The checkpoint's ``model_type`` (config.json); None for a preset."""
  if not args.checkpoint:
    return None
  from mla_jax.checkpoints.loading import read_config

  return read_config(Path(args.checkpoint)).get("model_type")


def _output_parsers(args) -> tuple[str | None, str | None]:
  """``--tool-call-parser`` / ``--reasoning-parser``; without them, what the checkpoint's
  ``model_type`` is served with (``serving.reasoning.DEFAULT_PARSERS``); "none": None."""
  from mla_jax.serving.reasoning import default_parsers

  tool, reasoning = default_parsers(_model_type(args))
  tool = tool if args.tool_call_parser is None else args.tool_call_parser
  reasoning = reasoning if args.reasoning_parser is None else args.reasoning_parser
  return (None if tool == "none" else tool), (None if reasoning == "none" else reasoning)


def cmd_routes(args) -> int:
  """Per prefill length: each class's route, whether scoring ran, and the outputs' difference."""
  from mla_jax import testing
  from mla_jax.attention import DeepseekV32Attention, MLAAttention
  from mla_jax.traces import traced_scopes

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


DEFAULT_PLAN_MESH = "tensor=8"


def _plan_v4(args) -> int:
  """DeepSeek-V4's plans: bytes a device on each ``--mesh`` by V4's partition rules, then the
  mesh of 1, 2, 4 and 8 GPUs of each kind that holds the most 128K sequences."""
  from mla_jax.v4 import plan as v4_plan

  if args.lower:
    raise SystemExit(f"error: --lower is not supported for {args.model} yet (docs/models.md)")
  abstract = v4_plan.abstract_model(v4_plan.V4_SIZES[args.model], args.dtype)
  plans = [v4_plan.make_plan(args.model, mesh, args.dtype, abstract, args.cache_dtype)
           for mesh in args.mesh or [DEFAULT_PLAN_MESH]]
  print(v4_plan.describe(args.model, args.dtype, plans[0].total_param_bytes, args.cache_dtype))
  print(v4_plan.format_plans(plans))
  print(f"fits: parameters + caches <= {v4_plan.FIT_FRACTION:.0%} of the GPU's memory; caches "
        "split over 'data' only, whole on every device of a data shard")
  print("\nthe mesh of each GPU count that holds the most 128K sequences:")
  print(v4_plan.format_best(args.model, args.dtype, abstract, args.cache_dtype))
  print("\npartition rules:")
  print(v4_plan.format_rules())
  print(f"\nnot supported yet for {args.model} (docs/models.md#not-supported-yet): "
        "speculative decoding under mla-jax serve (the engine's drafts), a 'context' axis")
  return 0


def cmd_plan(args) -> int:
  from mla_jax import plan

  if args.model in V4_SIZES:
    return _plan_v4(args)
  args.mesh = args.mesh or [DEFAULT_PLAN_MESH]
  plans = [plan.make_plan(args.model, mesh, args.dtype, args.batch, args.context,
                          args.cache_dtype, args.mtp_layers) for mesh in args.mesh]
  mtp = f" with {args.mtp_layers} MTP layer(s)" if args.mtp_layers else ""
  print(f"{args.model}{mtp}: {plans[0].total_param_bytes / 2**30:,.1f} GiB of {args.dtype} "
        f"parameters in total; per device (busiest), from nnx.eval_shape and the rules below:")
  print(plan.format_plans(plans))
  print(f"fits: parameters + caches <= {plan.FIT_FRACTION:.0%} of the GPU's memory "
        "(the rest is left for activations and XLA's workspace)")
  print(f"\npaged KV cache (page size {args.page_size}, {args.cache_dtype}: "
        f"{plans[0].token_bytes:,} B per token over all layers): the pages of an engine's "
        f"pool left after the weights in {plan.FIT_FRACTION:.0%} of each GPU (`serve "
        "--num-pages auto`'s rule; the pool is whole on every device of the data, tensor and "
        "expert axes, and split over 'context': each rank holds 1/context of its pages), and "
        "the tokens and sequences it holds:")
  print(plan.format_pages(plans, args.page_size))
  print("\npartition rules:")
  print(plan.format_rules())
  if args.lower:
    for mesh in args.mesh:
      collectives, kernels, partitions = plan.lower_decode_step(args.model, mesh)
      print(f"\ndecode step lowered for CUDA on an abstract {partitions}-GPU mesh ({mesh}): "
            f"{kernels} Triton kernel calls, collectives in the program: {collectives}")
  return 0


def cmd_train(args) -> int:
  from mla_jax.training.recipes import get_recipe, run_recipe

  recipe = get_recipe(args.recipe)
  seed = recipe.seed if args.seed is None else args.seed
  backend = get_backend(args.backend)
  print(f"recipe {recipe.name} ({recipe.description}), seed {seed}, "
        f"{sum(stage.steps for stage, _ in recipe.stages)} steps, backend {backend.name}")
  trainer = run_recipe(recipe, out_dir=args.out, seed=seed, progress=not args.quiet,
                       backend=backend)
  final = trainer.evaluations[-1]
  by_width = ", ".join(f"<={w}: {a:.3f}" for w, a in final["accuracy_by_width"].items())
  print(f"final lookup accuracy {final['accuracy']:.3f} ({by_width}), lm loss "
        f"{final['lm_loss']:.4f}, indexer KL {final['indexer_loss']:.4f}")
  if args.out:
    print(f"checkpoint: {trainer.checkpoint['path']}")
  return 0


def _add_speculative_tokens(parser, how: str) -> None:
  parser.add_argument("--speculative-tokens", type=int_in(0), default=0, metavar="K",
                      help=f"speculative decoding: K draft tokens per step from the model's MTP "
                           f"layers, {how} (default 0: plain decoding; at most "
                           "decoding.speculative.MAX_SPECULATIVE_TOKENS); a checkpoint is then "
                           "loaded with its MTP layers, a random preset gets a random one")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="mla-jax", description=DESCRIPTION)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("-v", "--verbose", action="store_true",
                      help="also show the mla_jax logger's INFO messages (e.g. which route "
                           "a layer class cannot take); by default only warnings")
  sub = parser.add_subparsers(dest="command", required=True)
  model = argparse.ArgumentParser(add_help=False)  # the model, its caches and processes
  model.add_argument("--preset", choices=sorted(PRESETS | TRAINED_PRESETS),
                     default=DEFAULT_PRESET,
                     help=f"built-in model (default {DEFAULT_PRESET}): recall is the shipped "
                          "model trained on key-value lookups (prompts like "
                          f"'{RECALL_PROMPT}' -> 'X'); the others have random weights from "
                          "--seed")
  model.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face safetensors checkpoint")
  model.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
  model.add_argument("--attention", choices=ATTENTION_KINDS, default="mqa-only")
  model.add_argument("--seed", type=int_in(0, 2**32), default=0)
  model.add_argument("--dtype", choices=sorted(_DTYPES),
                     help="parameters: bf16 (checkpoint default), float32 (preset default) or "
                          "fp8 (a checkpoint's float8 weights stay float8)")
  model.add_argument("--compute-dtype", choices=sorted(_COMPUTE_DTYPES),
                     help="with --dtype fp8: the dtype the model computes in and holds its "
                          "other parameters in (default bf16; float32 to compare an fp8 "
                          "checkpoint with a float32 reference)")
  model.add_argument("--cache-dtype", choices=CACHE_DTYPE_NAMES, default="fp32",
                     help="latent and indexer-key caches; fp8: e4m3 values with float32 scales")
  model.add_argument("--mesh", metavar="SPEC",
                     help="shard over a device mesh, e.g. data=1,tensor=2,expert=2 (the "
                          "product must equal the number of devices of all processes); serve "
                          "also takes context=N, splitting the page pools over N ranks")
  model.add_argument("--coordinator", metavar="HOST:PORT",
                     help="multi-process run: the jax.distributed coordinator (process 0's "
                          "host)")
  model.add_argument("--num-processes", type=int_in(1),
                     help="multi-process run: number of processes")
  model.add_argument("--process-id", type=int_in(0),
                     help="multi-process run: this process, 0-based")
  model.add_argument("--compilation-cache", metavar="DIR",
                     help="keep compiled programs in DIR (JAX's persistent compilation cache), "
                          "so that a restart compiles again only what changed")
  gen = sub.add_parser(
      "generate", parents=[common, model], formatter_class=argparse.RawDescriptionHelpFormatter,
      help="jit-compiled generation on a built-in or HF model",
      description="jit-compiled generation on a built-in or HF model.\n\n"
                  "The default preset, recall, is a small model trained on key-value lookups: "
                  "one-letter\nkey-value pairs, '.' filler, then '?k' asks for the value "
                  "stored under k:\n\n"
                  f"  mla-jax generate --prompt \"{RECALL_PROMPT}\" --max-new-tokens 1\n\n"
                  "answers X (its prompt when neither --prompt nor --prompt-len is given).")
  source = gen.add_mutually_exclusive_group()
  source.add_argument("--prompt", help="text prompt (the checkpoint's tokenizer.json, else the "
                                       "byte-level tokenizer)")
  source.add_argument("--prompt-len", type=int_in(1),
                      help=f"random prompt of this many ids (default {DEFAULT_PROMPT_LEN}; "
                           "the recall preset's default is its example prompt)")
  gen.add_argument("--max-new-tokens", type=int_in(1),
                   help=f"tokens to generate (default {DEFAULT_NEW_TOKENS}; 1 for the recall "
                        "preset, whose answers are one token)")
  gen.add_argument("--temperature", type=float_in(0.0, math.inf),
                   help="0 is greedy (default: the checkpoint's generation_config.json, else 0)")
  gen.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True),
                   help="nucleus mass (default: the checkpoint's generation_config.json, else 1)")
  gen.add_argument("--stop-at-eos", action="store_true",
                   help="stop at the tokenizer's EOS id(s)")
  gen.add_argument("--quiet", action="store_true", help="no progress bar")
  gen.add_argument("--batch", type=int_in(1), default=1, help="sequences (copies of the prompt)")
  _add_speculative_tokens(gen, "verified in one forward")
  gen.set_defaults(func=cmd_generate)
  serve = sub.add_parser(
      "serve", parents=[common, model],
      help="an OpenAI-compatible HTTP server (completions, chat, streaming) on the engine",
      description="An OpenAI-compatible HTTP server on the engine (docs/serving.md): "
                  "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.")
  serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
  serve.add_argument("--port", type=int_in(1, 65535), default=8000)
  serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (also "
                                        "read from MLA_JAX_API_KEY)")
  serve.add_argument("--served-model-name",
                     help="the model id clients name (default: the preset, or the checkpoint "
                          "directory's name)")
  serve.add_argument("--num-pages", type=pages_or_auto, default=512,
                     help="cache pages in the pool (each of --page-size tokens in every layer), "
                          f"or 'auto': as many as fit in {FIT_FRACTION * 100:.0f}%% of the "
                          "busiest GPU's memory after the weights (the rule of mla-jax plan); "
                          f"without a GPU, {HOST_POOL_FRACTION * 100:.0f}%% of the host memory "
                          f"available, at most {HOST_POOL_BYTES // 2**30} GiB")
  serve.add_argument("--page-size", type=int_in(1), default=64)
  serve.add_argument("--max-num-seqs", type=int_in(1), default=32,
                     help="sequences running at once")
  serve.add_argument("--max-step-tokens", type=int_in(1), default=512,
                     help="tokens computed per engine step (long prompts are chunked)")
  serve.add_argument("--max-model-len", type=int_in(2),
                     help="longest prompt + output (default: the model's positions)")
  serve.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                     help="do not reuse the cached pages of shared prompt prefixes")
  serve.add_argument("--max-pending", type=int_in(1), default=256,
                     help="requests queued or running at once; more get 429 with Retry-After")
  serve.add_argument("--max-body-bytes", type=int_in(1), default=8 * 2**20,
                     help="largest request body (413 beyond)")
  serve.add_argument("--shutdown-timeout", type=float_in(0.0, math.inf), default=10.0,
                     help="seconds SIGTERM leaves requests in flight before aborting them")
  serve.add_argument("--log-interval", type=float_in(0.0, math.inf, low_open=True),
                     default=10.0, help="seconds between engine stats lines (with -v)")
  serve.add_argument("--tool-call-parser", choices=[*TOOL_CALL_PARSERS, "none"],
                     help="parse chat output for tool calls in this format: DeepSeek-V3.2's "
                          "DSML or GLM-4.5..5's <tool_call> (default: from the checkpoint's "
                          "model_type, deepseek_v32 or glm_moe_dsa; else none)")
  serve.add_argument("--reasoning-parser", choices=[*REASONING_PARSERS, "none"],
                     help="split <think>...</think> off chat output as reasoning_content "
                          "(default: from the checkpoint's model_type; else none)")
  serve.add_argument("--decode-steps", type=int_in(1, 256), default=DECODE_STEPS_PER_DISPATCH,
                     help="decode steps per dispatch when only decodes run and nothing waits")
  serve.add_argument("--chat-template", metavar="FILE",
                     help="a jinja2 chat template replacing the checkpoint's")
  serve.add_argument("--no-prompt-logprobs", dest="prompt_logprobs", action="store_false",
                     help="refuse echo with logprobs and prompt_logprobs (scoring), compiling "
                          "no scoring step programs")
  serve.add_argument("--no-structured-outputs", dest="structured_outputs",
                     action="store_false",
                     help="refuse response_format, structured_outputs / guided_* and forced "
                          "tool_choice, compiling no masked step programs")
  serve.add_argument("--dcp-indexer-mode", choices=CONTEXT_TOPK_MODES, default="exact",
                     help="with a 'context' axis in --mesh (the page pools split over it): "
                          "exact selects the global top-k (one device's tokens); union each "
                          "rank's own top-k, exchanging no candidates (approximate)")
  serve.add_argument("--no-warmup", dest="warmup", action="store_false",
                     help="serve at once, compiling each step program when a step first needs "
                          "it (by default every one is compiled before the server listens)")
  serve.add_argument("--warmup-every-reach", action="store_true",
                     help="warm up every step program at every key-block bucket too, so that "
                          "nothing compiles while serving (by default the smaller buckets, "
                          "which follow the rows' reaches, compile in the background when a "
                          "step first needs one, the step meanwhile running on the covering "
                          "program); a warm-up about log2(context / key chunk) + 1 times longer")
  _add_speculative_tokens(serve, "for every request (the engine keeps the MTP layers' paged "
                          "caches)")
  serve.set_defaults(func=cmd_serve)
  routes = sub.add_parser("routes", parents=[common],
                          help="route demo: which route each module class takes")
  routes.add_argument("--backend", choices=BACKEND_NAMES, default="xla")
  routes.add_argument("--seed", type=int_in(0, 2**32), default=0)
  routes.set_defaults(func=cmd_routes)
  plan = sub.add_parser("plan", parents=[common],
                       help="per-device bytes of a full-size model on a mesh "
                            "(nothing is allocated)")
  plan.add_argument("--model", choices=sorted(FULL_SIZE) + sorted(V4_SIZES),
                    default="deepseek_v32")
  plan.add_argument("--mesh", action="append", metavar="SPEC",
                    help="e.g. data=1,tensor=2,expert=4 (repeat for several meshes; default "
                         f"{DEFAULT_PLAN_MESH}: one host of 8 GPUs)")
  plan.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                    help="parameter storage: bf16, or fp8 as released (128x128 block-scaled "
                         "e4m3 projections; DeepSeek-V4: and MXFP4 routed experts)")
  plan.add_argument("--cache-dtype", choices=("bf16", "fp8"), default="bf16")
  plan.add_argument("--batch", type=int_in(1), default=1)
  plan.add_argument("--context", type=int_in(1), default=131072, help="tokens per sequence")
  plan.add_argument("--mtp-layers", type=int_in(0), default=0,
                    help="MTP layers to count, parameters and caches (the releases ship 1; "
                         "default 0: plain decoding)")
  plan.add_argument("--page-size", type=int_in(1), default=64,
                    help="tokens per page of the paged-cache table (default 64)")
  plan.add_argument("--lower", action="store_true",
                    help="also lower one decode step for CUDA on the abstract mesh")
  plan.set_defaults(func=cmd_plan)
  from mla_jax.training.recipes import RECIPES

  train = sub.add_parser("train", parents=[common],
                        help="train a named recipe (checkpoint in --out)")
  train.add_argument("--recipe", choices=sorted(RECIPES), required=True)
  train.add_argument("--out", metavar="DIR", help="checkpoint and history.json directory")
  train.add_argument("--seed", type=int_in(0, 2**32), default=None,
                     help="default: the recipe's seed")
  train.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                     help="attention kernels for the forward and backward: xla (the jnp "
                     "references), pallas (the Pallas-Triton kernels; interpret mode off an "
                     "NVIDIA GPU, slow) or auto (pallas on an NVIDIA GPU, else xla)")
  train.add_argument("--quiet", action="store_true", help="no progress bars")
  train.set_defaults(func=cmd_train)
  return parser


def configure_logging(verbose: bool) -> None:
  """The ``mla_jax`` logger on stderr: warnings only, INFO messages too with ``verbose``."""
  logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
  logging.getLogger("mla_jax").setLevel(logging.INFO if verbose else logging.WARNING)


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  configure_logging(args.verbose)
  if args.command == "generate" and args.dtype == "fp8" and not args.checkpoint:
    raise SystemExit("error: --dtype fp8 keeps a checkpoint's float8 weights; it needs "
                     "--checkpoint (the presets have none)")
  if args.command == "generate" and args.compute_dtype and args.dtype != "fp8":
    raise SystemExit("error: --compute-dtype applies to --dtype fp8 (otherwise the model "
                     "computes in its --dtype)")
  try:
    return args.func(args)
  except (ValueError, TypeError, OSError, BackendUnavailable) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
