"""Scale-out measurements on CPU: compile time against depth, MoE time against experts, decode
on 1 vs 8 host devices, an engine's pools over a context axis (capacity and the bytes its
exchanges move, from the compiled programs) and what that costs at DeepSeek-V3.2 sizes on
paper. Every table is measured side by side in one run.

  python benchmarks/scale.py [--quick]

The script gives itself 8 CPU host devices (XLA_FLAGS, set before jax is imported). They
share this machine's cores, so the multi-device rows measure the cost of partitioning and
collectives, not a speed-up; see docs/scaling.md.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import timing  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402

from mla_jax import sharding, traces  # noqa: E402
from mla_jax.config import IndexerConfig, MLAConfig, RopeConfig  # noqa: E402
from mla_jax.generation import generate  # noqa: E402
from mla_jax.models.config import ModelConfig, MoEConfig, small_lm, tiny_lm  # noqa: E402
from mla_jax.models.lm import CausalLM  # noqa: E402
from mla_jax.models.moe import MoE, tile_plan  # noqa: E402
from mla_jax.serving import Engine  # noqa: E402
from mla_jax.serving.step_inputs import StepShape  # noqa: E402


def narrow_config(num_layers: int) -> ModelConfig:
  """A narrow DeepSeek-shaped model: 3 dense-MLP layers, then MoE layers."""
  mla = MLAConfig(hidden_size=64, num_heads=2, q_lora_rank=32, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                  rope=RopeConfig(), max_position_embeddings=1024,
                  indexer=IndexerConfig(num_heads=2, head_dim=32, topk=16))
  return ModelConfig(mla=mla, vocab_size=264, num_layers=num_layers, intermediate_size=128,
                     moe=MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=1,
                                   topk_group=1, moe_intermediate_size=32),
                     first_k_dense_replace=3)


def compile_seconds(num_layers: int, scan: bool) -> float:
  config = narrow_config(num_layers)
  model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0), backend="xla",
                                          scan_layers=scan))
  graphdef, state = nnx.split(model)
  caches = jax.eval_shape(lambda: model.init_cache(1, 64))
  ids = jax.ShapeDtypeStruct((1, 32), jnp.int32)
  fn = jax.jit(lambda s, i, c: nnx.merge(graphdef, s)(i, c, num_cached_tokens=0))
  return timing.once(lambda: fn.lower(state, ids, caches).compile(), sync=None)[1]


def table_compile(depths) -> None:
  print("\n### Compile time of a prefill step against depth (narrow config, seconds)\n")
  print("| layers | scanned groups | scanned s | unrolled s | unrolled / scanned |")
  print("|---|---|---|---|---|")
  for depth in depths:
    scanned, unrolled = compile_seconds(depth, True), compile_seconds(depth, False)
    groups = len(CausalLM(narrow_config(depth), rngs=nnx.Rngs(0), backend="xla").layer_groups) \
        if depth <= 16 else 2
    print(f"| {depth} | {groups} | {scanned:.2f} | {unrolled:.2f} | {unrolled / scanned:.1f} |")




def _all_experts(moe: MoE, x_BTD):
  """What the model did before the grouped matmul: every expert on every token."""
  x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
  idx_TK, weights_TK = moe.gate(x_TD)
  combine_TE = jnp.zeros((x_TD.shape[0], moe.experts.gate_proj.shape[0]), jnp.float32)
  combine_TE = combine_TE.at[jnp.arange(x_TD.shape[0])[:, None], idx_TK].set(weights_TK)
  gate = jnp.einsum("td,efd->tef", x_TD, moe.experts.gate_proj[...])
  up = jnp.einsum("td,efd->tef", x_TD, moe.experts.up_proj[...])
  h = jax.nn.silu(gate) * up * combine_TE[:, :, None]
  return jnp.einsum("tef,edf->td", h, moe.experts.down_proj[...])


def table_moe(expert_counts, token_counts, repeats: int) -> None:
  hidden, ffn, top = 256, 128, 8
  print(f"\n### MoE layer against the number of experts (top-{top}, D {hidden}, F {ffn}; "
        f"median ms of {repeats} warm runs). Rows multiplied per expert matmul: tiled = its "
        "padded tiles; ragged_dot on XLA:CPU = every routed row by every expert; all experts "
        "= every token by every expert\n")
  print("| tokens | experts | tiled ms | ragged_dot ms | all experts ms | tiled rows | "
        "ragged_dot rows | all-experts rows |")
  print("|---|---|---|---|---|---|---|---|")
  for tokens in token_counts:
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, tokens, hidden)), jnp.float32)
    for num_experts in expert_counts:
      _moe_row(x, num_experts, ffn, top, repeats)


def _moe_row(x, num_experts, ffn, top, repeats):
  """One row: the grouped matmuls and the former all-experts computation, side by side."""
  hidden, tokens = x.shape[-1], x.shape[1]
  cfg = MoEConfig(num_experts=num_experts, num_experts_per_tok=top, n_group=1, topk_group=1,
                  n_shared_experts=0, moe_intermediate_size=ffn)
  times = []
  for impl in ("tiled", "ragged_dot", "all"):
    graphdef, state = nnx.split(MoE(hidden, cfg, rngs=nnx.Rngs(0),
                                    grouped_matmul="tiled" if impl == "all" else impl))
    if impl == "all":
      fn = jax.jit(lambda s, x: _all_experts(nnx.merge(graphdef, s), x))
    else:
      fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    times.append(timing.timed(lambda: fn(state, x), repeats) * 1e3)
  pairs = tokens * top
  tile, num_tiles = tile_plan(pairs, num_experts)
  print(f"| {tokens} | {num_experts} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | "
        f"{tile * num_tiles} | {pairs * num_experts} | {tokens * num_experts} |")


def table_decode(new_tokens: int) -> None:
  batch = 8
  print(f"\n### Decode on 1 vs 8 CPU host devices (small preset, batch {batch}, "
        f"{new_tokens} new tokens; the 8 devices share the same 2 cores)\n")
  print("| mesh | devices | decode tok/s | vs 1 device |")
  print("|---|---|---|---|")
  prompts = np.random.default_rng(0).integers(0, 256, (batch, 32)).tolist()
  base = None
  for spec in (None, "data=8,tensor=1,expert=1", "data=1,tensor=8,expert=1",
               "data=2,tensor=2,expert=2"):
    mesh = sharding.make_mesh(spec) if spec else None
    model = CausalLM(small_lm(), rngs=nnx.Rngs(0), backend="xla", mesh=mesh)
    generate(model, prompts, new_tokens)  # compile
    rates = [generate(model, prompts, new_tokens).decode_tokens_per_s for _ in range(2)]
    rate = max(rates)
    base = base or rate
    print(f"| {spec or 'none'} | {1 if mesh is None else 8} | {rate:.0f} | {rate / base:.2f} |")


@contextlib.contextmanager
def compiled_texts():
  """The text of every program compiled inside the block (``Compiled.as_text()``)."""
  texts, compile_ = [], jax.stages.Lowered.compile
  jax.stages.Lowered.compile = lambda self, *a, **k: texts.append(
      compile_(self, *a, **k)) or texts[-1]
  try:
    yield texts
  finally:
    jax.stages.Lowered.compile = compile_


def _device_bytes(tree) -> int:
  """Bytes of ``tree``'s arrays on the first device."""
  device = jax.devices()[0]
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
             for shard in leaf.addressable_shards if shard.device == device)


def table_context(pages_per_device: int, page_size: int, batch: int) -> None:
  """Pools over ``context`` (tiny preset, unrolled layers so each layer's collectives appear
  once in the compiled text): capacity per device, and one decode step's exchanges."""
  config = tiny_lm("mqa-only")
  topk, layers = config.mla.indexer.topk, config.num_layers
  print(f"\n### Page pools over a context axis (tiny preset: {layers} layers, top-k {topk}; "
        f"{pages_per_device} pages of {page_size} tokens per device; one decode step of "
        f"{batch} sequences)\n")
  print("| context | pages | pool KiB / device | longest context | exact: all-gather B | "
        "exact: all-reduce B | union: all-gather B | union: all-reduce B | rows read / token"
        " / layer, exact vs union |")
  print("|---|---|---|---|---|---|---|---|---|")
  for ranks in (1, 2, 4, 8):
    sizes = sharding.parse_mesh_spec(f"context={ranks}")
    mesh = sharding.make_mesh(sizes, jax.devices()[:math.prod(sizes.values())])
    model = CausalLM(config, rngs=nnx.Rngs(0), backend="xla", mesh=mesh, scan_layers=False)
    pages = ranks * pages_per_device
    moved = {}
    for mode in ("exact", "union"):
      engine = Engine(model, num_pages=pages, page_size=page_size, max_num_seqs=batch,
                      max_step_tokens=batch, log_interval=None, context_topk=mode)
      with compiled_texts() as texts:
        engine._program(StepShape(batch, batch, pages // batch))
      moved[mode] = traces.collective_bytes(texts[-1].as_text())
    per_device = _device_bytes(engine._pools)
    cell = lambda mode, kind: f"{moved[mode].get(kind, 0) // layers:,} x {layers}"
    print(f"| {ranks} | {pages} | {per_device / 1024:,.0f} | {pages * page_size:,} | "
          f"{cell('exact', 'all-gather')} | {cell('exact', 'all-reduce')} | "
          f"{cell('union', 'all-gather')} | {cell('union', 'all-reduce')} | "
          f"{topk} vs {ranks * topk} |")


# DeepSeek-V3.2 on H200s, for the figures on paper (assumptions, not measurements).
V32 = dict(layers=61, topk=2048, heads=128, kv_lora=512, latent_row=656, key_row=132)
HBM_BYTES_PER_S = 4.8e12    # H200 HBM3e
LINK_BYTES_PER_S = 450e9    # NVLink 4, one direction
COLLECTIVE_LATENCY_S = 10e-6  # per collective, a rough figure for an 8-GPU NVLink domain


def table_context_on_paper(ranks: int = 8) -> None:
  """Per decode token and per step, what context parallelism adds and saves at V3.2 sizes."""
  v = V32
  gather = ranks * v["topk"] * 8                        # ids + scores of every rank's top-k
  reduce = v["heads"] * v["kv_lora"] * 4 + 2 * v["heads"] * 4  # weighted outputs, weights, max
  wire = lambda nbytes, factor: factor * (ranks - 1) / ranks * nbytes / LINK_BYTES_PER_S
  exact_link = v["layers"] * (wire(gather, 1) + wire(reduce, 2))
  union_link = v["layers"] * wire(reduce, 2)
  latency = lambda collectives: v["layers"] * collectives * COLLECTIVE_LATENCY_S
  print(f"\n### On paper: DeepSeek-V3.2 decode over context={ranks} (fp8 caches, "
        f"{v['layers']} layers, top-k {v['topk']}; HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s, "
        f"link {LINK_BYTES_PER_S / 1e9:.0f} GB/s a direction, "
        f"{COLLECTIVE_LATENCY_S * 1e6:.0f} us a collective)\n")
  print(f"Per token per layer: exact all-gathers {gather:,} B of candidates; both modes "
        f"all-reduce {reduce:,} B of partial outputs (twice over the wire in a ring).\n")
  print("| context tokens | indexer keys read / token, 1 GPU | per rank | scoring saved / token "
        "| sparse rows read / token per rank: exact / union | exchanges / token: exact / union "
        "| collective latency / step: exact / union |")
  print("|---|---|---|---|---|---|---|")
  for tokens in (131072, 1048576):
    keys = tokens * v["key_row"]
    saved = v["layers"] * (keys - keys / ranks) / HBM_BYTES_PER_S
    rows = v["topk"] * v["latent_row"]
    print(f"| {tokens // 1024}K | {keys / 2**20:,.1f} MiB x {v['layers']} | "
          f"{keys / ranks / 2**20:,.1f} MiB x {v['layers']} | {saved * 1e3:.2f} ms | "
          f"{rows / ranks / 2**10:,.0f} / {rows / 2**10:,.0f} KiB x {v['layers']} | "
          f"{exact_link * 1e6:.0f} / {union_link * 1e6:.0f} us | "
          f"{latency(3) * 1e3:.2f} / {latency(2) * 1e3:.2f} ms |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.device_count()} host devices, "
        f"{os.cpu_count()} CPU cores")
  if args.quick:
    table_compile((4, 8))
    table_moe((8, 64), (8, 64), repeats=3)
    table_decode(new_tokens=8)
    table_context(pages_per_device=16, page_size=8, batch=4)
  else:
    table_compile((4, 16, 61))
    table_moe((8, 64, 256), (8, 512), repeats=10)
    table_decode(new_tokens=32)
    table_context(pages_per_device=64, page_size=16, batch=8)
  table_context_on_paper()


if __name__ == "__main__":
  main()
