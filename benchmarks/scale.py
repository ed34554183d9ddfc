"""Scale-out measurements on CPU: compile time against depth, MoE time against experts, decode
on 1 vs 8 host devices, the meshes of one 8-device node with the weights over tensor x
context (pools, and the bytes a decode step's collectives move, from the compiled programs)
and what each costs at DeepSeek-V3.2 sizes on 8 x H200 on paper. Every table of a group is
measured side by side in one run.

  python benchmarks/scale.py [--quick] [--only compile|moe|decode|context]

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
os.environ.setdefault("PJRT_NPROC", "32")  # see docs/scaling.md: collectives need threads
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import timing  # noqa: E402
import collections  # noqa: E402

from mla_jax import sharding, traces  # noqa: E402
from mla_jax.config import IndexerConfig, MLAConfig, RopeConfig  # noqa: E402
from mla_jax.generation import generate  # noqa: E402
from mla_jax.models.config import ModelConfig, MoEConfig, small_lm, tiny_moe_lm  # noqa: E402
from mla_jax.models.lm import CausalLM  # noqa: E402
from mla_jax.models.moe import MoE, tile_plan  # noqa: E402
from mla_jax.serving import Engine  # noqa: E402
from mla_jax.decoding.logits import Sampler  # noqa: E402
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


# The meshes of one 8-GPU node: the weights 8 ways over tensor x context on each.
NODE_MESHES = ("tensor=8", "tensor=4,context=2", "tensor=2,context=4", "context=8")


def _device_bytes(tree) -> int:
  """Bytes of ``tree``'s arrays on the first device."""
  device = jax.devices()[0]
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
             for shard in leaf.addressable_shards if shard.device == device)


def _role(collective: traces.Collective) -> str:
  """What a decode step's collective exchanges, from the scopes the program made it in."""
  name = collective.op_name
  if "sparse_mqa/shard_map" in name:  # context_parallel: queries, LSEs, partial outputs
    return {"all-gather": "q+lse", "reduce-scatter": "out"}.get(collective.kind, "other")
  if "indexer_score/shard_map" in name:
    return "candidates"
  return collective.kind  # XLA's, around the weights split over tensor x context


def table_context(pages_per_device: int, page_size: int, batch: int, context: int) -> None:
  """Each mesh of one 8-device node (tiny MoE preset, 8 heads, unrolled layers so that each
  layer's collectives appear once in the compiled text): the pool per device, and one decode
  step's exchanges by what they carry, from the compiled programs."""
  config = tiny_moe_lm()
  layers, topk, heads = config.num_layers, config.mla.indexer.topk, config.mla.num_heads
  print(f"\n### One 8-device node's meshes (tiny MoE preset: {layers} layers, {heads} heads, "
        f"top-k {topk}; {pages_per_device} pages of {page_size} tokens per device; one decode "
        f"step of {batch} sequences at {context} tokens; bytes a device receives as the "
        "compiled program's collective results state them)\n")
  print("| mesh | mode | pool pages | pool KiB / device | attention all-gathers (queries, LSEs)"
        " B / layer | partial outputs reduce-scatter B / layer | candidates all-gather B / "
        "layer | weights' all-reduce B / step | weights' all-gather B / step | collectives / "
        "step |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for spec in NODE_MESHES:
    mesh = sharding.make_mesh(spec)
    ranks = mesh.shape[sharding.CONTEXT]
    model = CausalLM(config, rngs=nnx.Rngs(0), backend="xla", mesh=mesh, scan_layers=False)
    pages = ranks * pages_per_device
    for mode in ("exact", "union") if ranks > 1 else ("exact",):
      engine = Engine(model, num_pages=pages, page_size=page_size, max_num_seqs=batch,
                      max_step_tokens=batch, log_interval=None, context_topk=mode)
      shape = StepShape(batch, batch, context // page_size,
                        batch * -(-context // model.backend.key_chunk), sampler=Sampler.GREEDY)
      found = traces.collectives(engine.trace_step(shape)[1].lower().compile().as_text())
      moved = collections.Counter()
      for c in found:
        moved[_role(c)] += c.nbytes
      per_layer = lambda role: f"{moved[role] // layers:,}"
      print(f"| {spec} | {mode if ranks > 1 else '-'} | {pages} | "
            f"{_device_bytes(engine.runner.pools) / 1024:,.0f} | "
            f"{per_layer('q+lse')} | {per_layer('out')} | {per_layer('candidates')} | "
            f"{moved['all-reduce']:,} | {moved['all-gather']:,} | {len(found)} |")


def table_merge_precision(ranks: int = 8, heads: int = 16, topk: int = 512) -> None:
  """The LSE merge of a bf16 model's partial outputs against float64: what one device's bf16
  op gives, the merge with float32 on the wire and with bf16 (what it sends), over the same
  bf16-rounded queries and rows (V3.2's widths: rows of 576, values of 512)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from mla_jax import context_parallel
  from mla_jax.backends import XlaBackend

  rng = np.random.default_rng(0)
  batch, width, d_v, rows = 4, 576, 512, 256 * ranks
  scale = width**-0.5
  q = jnp.asarray(rng.standard_normal((batch, 1, heads, width)), jnp.bfloat16)
  pool = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
  picked = rng.integers(0, rows, (batch, 1, topk)).astype(np.int32)
  q64, pool64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (q, pool))
  kv = pool64[picked[:, 0]]                                        # [B, K, L]
  logits = np.einsum("bhl,bkl->bhk", q64[:, 0], kv) * scale
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("bhk,bkv->bhv", weights / weights.sum(-1, keepdims=True), kv[..., :d_v])
  backend, mesh = XlaBackend(), sharding.make_mesh(f"context={ranks}")
  op = lambda q, kv, r: backend.sparse_mqa(q, kv, r, sm_scale=scale, d_v=d_v, batched_rows=False)

  def merged(wire):
    def partial(q, kv, r):
      r = context_parallel.local_rows(r, kv.shape[0])
      out, lse = op(q, kv, r)
      out, _ = context_parallel.merge_partials(out, lse, (r >= 0).any(-1), wire)
      return jax.lax.all_gather(out, sharding.CONTEXT, axis=2, tiled=True)
    placed = jax.device_put(pool, NamedSharding(mesh, sharding.POOL_SPEC))
    return jax.jit(sharding.shard_map(partial, mesh, (P(), sharding.POOL_SPEC, P()), P()))(
        q, placed, picked)

  def ring_in_bf16():
    """The merge as a ring reduce-scatter in bf16 adds it: each hop's sum rounded to bf16
    (XLA:CPU reduces a bf16 collective in float32, so this one is summed on the host)."""
    def partial(q, kv, r):
      r = context_parallel.local_rows(r, kv.shape[0])
      out, lse = op(q, kv, r)
      lse = jnp.where((r >= 0).any(-1)[..., None], lse, -jnp.inf)
      return tuple(jax.lax.all_gather(a, sharding.CONTEXT) for a in (out, lse))
    placed = jax.device_put(pool, NamedSharding(mesh, sharding.POOL_SPEC))
    outs, lses = (np.asarray(a.astype(jnp.float32), np.float64) for a in jax.jit(
        sharding.shard_map(partial, mesh, (P(), sharding.POOL_SPEC, P()), P()))(q, placed,
                                                                                 picked))
    top = lses.max(0)
    total = np.log(np.exp(lses - top).sum(0)) + top
    bf16 = lambda a: np.asarray(a, jnp.bfloat16).astype(np.float64)
    parts = bf16(np.exp(lses - total)[..., None] * outs)
    acc = parts[0]
    for part in parts[1:]:
      acc = bf16(acc + part)
    return acc

  print(f"\n### The partial outputs' merge in bf16 against float64 ({ranks} context ranks, "
        f"{heads} heads, top-{topk} rows of {width}, values of {d_v}; bf16 queries and rows)\n")
  print("| computed | max abs error | RMS error / RMS value |")
  print("|---|---|---|")
  for name, got in (("one device, bf16 op", jax.jit(op)(q, pool, picked)[0]),
                    ("merged, float32 on the wire", merged(jnp.float32)),
                    ("merged, bf16 on the wire (sent), summed in float32 (XLA:CPU)",
                     merged(jnp.bfloat16)),
                    ("merged, bf16 on the wire, each ring hop rounded to bf16",
                     ring_in_bf16())):
    err = np.asarray(jnp.asarray(got, jnp.float32), np.float64)[:, 0] - want
    print(f"| {name} | {np.abs(err).max():.2e} | "
          f"{np.sqrt((err**2).mean() / (want**2).mean()):.2e} |")


# DeepSeek-V3.2 on 8 x H200, for the figures on paper (assumptions, not measurements): its
# sizes, the bytes a decode token moves per layer, and the hardware.
V32 = dict(layers=61, moe_layers=58, topk=2048, heads=128, latent=576, kv_lora=512,
           hidden=7168, latent_row=656, key_row=132, experts=256, experts_per_token=8,
           expert_bytes=3 * 7168 * 2048)  # one routed expert, fp8 (scales ignored)
HBM_BYTES_PER_S = 4.8e12    # H200 HBM3e
LINK_BYTES_PER_S = 450e9    # NVLink 4, one direction, per GPU
COLLECTIVE_LATENCY_S = 10e-6  # per collective, a rough figure for an 8-GPU NVLink domain
RANKS = 8


def _ring(nbytes: float, ranks: int) -> float:
  """Bytes a rank sends in a ring collective over ``ranks``: an all-gather's result, or a
  reduce-scatter's input (an all-reduce is both: twice)."""
  return (ranks - 1) / ranks * nbytes


def _paper_mesh(spec: str, batch: int, context: int, mode: str, other_bytes: float) -> dict:
  """One decode step of ``batch`` sequences of ``context`` tokens on ``spec`` (8 ranks, the
  weights 8 ways on each), per device: HBM bytes (the non-expert weights ``other_bytes``, the
  experts the batch routes to, the indexer keys and attended latent rows a rank holds), link
  bytes a ring moves, and collectives."""
  v, ranks = V32, sharding.parse_mesh_spec(spec)[sharding.CONTEXT]
  group = v["heads"] * ranks // RANKS  # a tensor group's heads (all-gathered over context)
  touched = 1 - (1 - v["experts_per_token"] / v["experts"]) ** batch
  experts = v["moe_layers"] * v["experts"] * touched * v["expert_bytes"] / RANKS
  attended = v["topk"] / ranks if mode == "exact" else v["topk"]  # rows a rank reads
  kv = v["layers"] * (context * v["key_row"] / ranks + attended * v["latent_row"])
  # Per token and layer: XLA's reductions after o_proj, the shared experts (bf16) and the
  # routed experts' float32 sum, twice over a ring; then the context ranks' exchanges (bf16
  # queries and partial outputs, float32 LSEs, ids + scores of every rank's top-k in exact).
  tp = 2 * _ring(v["hidden"] * (2 + 2 + 4), RANKS)
  cp = 0.0
  collectives = 2
  if ranks > 1:
    cp = (_ring(group * v["latent"] * 2, ranks) + _ring(ranks * group * 4, ranks)
          + _ring(group * v["kv_lora"] * 2, ranks))
    collectives += 3
    if mode == "exact":  # one all-gather of ids and scores
      cp += _ring(ranks * v["topk"] * 8, ranks)
      collectives += 1
  hbm_s = (other_bytes + experts + batch * kv) / HBM_BYTES_PER_S
  link_s = batch * v["layers"] * (tp + cp) / LINK_BYTES_PER_S
  latency_s = v["layers"] * collectives * COLLECTIVE_LATENCY_S
  return dict(hbm=hbm_s, link=link_s, latency=latency_s, cp_bytes=cp, tp_bytes=tp,
              collectives=collectives)


def table_context_on_paper(other_bytes: float, pages_per_device: int) -> None:
  """Step time of each node mesh on 8 x H200 at 128K, from its HBM reads, link bytes and
  collective latency; and from how many sequences a step each mesh beats tensor=8."""
  v = V32
  print(f"\n### On paper: DeepSeek-V3.2 decode on 8 x H200 (fp8 weights and caches, "
        f"{v['layers']} layers, top-k {v['topk']}; HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s, "
        f"link {LINK_BYTES_PER_S / 1e9:.0f} GB/s a direction, "
        f"{COLLECTIVE_LATENCY_S * 1e6:.0f} us a collective; non-expert weights "
        f"{other_bytes / 2**30:.1f} GiB a device, experts read as the batch routes to them)\n")
  old = (_ring(RANKS * v["topk"] * 8, RANKS)
         + 2 * _ring(v["heads"] * (v["kv_lora"] + 2) * 4, RANKS))
  new = _paper_mesh("context=8", 1, 131072, "exact", other_bytes)["cp_bytes"]
  print(f"Per token and layer a context rank of context=8 sends {new / 1024:,.0f} KiB in exact "
        f"mode (queries, LSEs, the partial outputs' reduce-scatter in bf16, candidates), where "
        f"the context axis before issue 50 (weights replicated over it, float32 partial "
        f"outputs all-reduced) sent {old / 1024:,.0f} KiB.\n")
  print("| mesh | mode | exchanged / token / layer: weights' reductions + context ranks | "
        "collectives / layer | step at 7 x 128K: HBM + link + latency | 128K sequences it "
        "holds (plan) | step at those | ms / token there | faster than tensor=8 from (sequences "
        "a step) |")
  print("|---|---|---|---|---|---|---|---|---|")
  step = lambda spec, b, mode: _paper_step(_paper_mesh(spec, b, 131072, mode, other_bytes))
  fmt = lambda r: (f"{_paper_step(r) * 1e3:.1f} ms ({r['hbm'] * 1e3:.1f} + "
                   f"{r['link'] * 1e3:.2f} + {r['latency'] * 1e3:.2f})")
  for spec in NODE_MESHES:
    ranks = sharding.parse_mesh_spec(spec)[sharding.CONTEXT]
    most = ranks * pages_per_device // (131072 // 64)  # 128K sequences its pool holds
    for mode in ("exact", "union") if ranks > 1 else ("exact",):
      seven = _paper_mesh(spec, 7, 131072, mode, other_bytes)
      full = _paper_mesh(spec, most, 131072, mode, other_bytes)
      # Whatever tensor=8 could hold: the batch from which this mesh's step is the shorter.
      pays = next((b for b in range(1, 1025) if step(spec, b, mode) < step("tensor=8", b, mode)),
                  None) if ranks > 1 else None
      print(f"| {spec} | {mode if ranks > 1 else '-'} | {seven['tp_bytes'] / 1024:,.0f} + "
            f"{seven['cp_bytes'] / 1024:,.0f} KiB | {seven['collectives']} | {fmt(seven)} | "
            f"{most} | {fmt(full)} | {_paper_step(full) / most * 1e3:.2f} | "
            f"{'-' if pays is None else pays} |")


def _paper_step(r: dict) -> float:
  return r["hbm"] + r["link"] + r["latency"]


def _v32_on_a_node() -> tuple[float, int]:
  """DeepSeek-V3.2's fp8 weights a device holds on 8 GPUs, less its routed experts; and the
  pages of 64 tokens (fp8 caches) an H200 holds beside them (``mla-jax plan``)."""
  from mla_jax import plan

  p = plan.make_plan("deepseek_v32", "tensor=8", "fp8", cache_dtype="fp8")
  v = V32
  experts = v["moe_layers"] * v["experts"] * v["expert_bytes"] / RANKS
  return p.param_bytes - experts, plan.page_capacity(p, "H200 141GB", 64).pages_per_device


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
  parser.add_argument("--only", choices=("compile", "moe", "decode", "context"),
                      help="one group of tables")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.device_count()} host devices, "
        f"{os.cpu_count()} CPU cores")
  quick, wanted = args.quick, lambda group: args.only in (None, group)
  if wanted("compile"):
    table_compile((4, 8) if quick else (4, 16, 61))
  if wanted("moe"):
    table_moe((8, 64), (8, 64), repeats=3) if quick else table_moe((8, 64, 256), (8, 512), 10)
  if wanted("decode"):
    table_decode(new_tokens=8 if quick else 32)
  if wanted("context"):
    if quick:
      table_context(pages_per_device=16, page_size=16, batch=4, context=128)
    else:
      table_context(pages_per_device=64, page_size=16, batch=8, context=512)
    table_merge_precision()
    table_context_on_paper(*_v32_on_a_node())


if __name__ == "__main__":
  main()
