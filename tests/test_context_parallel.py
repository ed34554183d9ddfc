"""Context parallelism: an engine's page pools split over a mesh's ``context`` axis.

The ops against float64 NumPy on fresh inputs; the pool layout; the indexer's exact mode equal
to one device and its union mode a superset of it; the engine equal to one device (greedy
tokens identical, log-probabilities to float32 rounding) under chunked prefill, multi-step
decode, preemption, prefix hits and speculative decoding, with the routing contract walked on
every program; named errors for what is not supported.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from mla_jax import cli, context_parallel, sharding, traces
from mla_jax.backends import XlaBackend
from mla_jax.backends.on_mesh import MeshOps
from mla_jax.indexer import Indexer, KeyBlocks
from mla_jax.models.config import tiny_lm, tiny_moe_lm
from mla_jax.models.lm import CausalLM
from mla_jax.paged_cache import PagedLayerCache
from mla_jax.serving import Engine, SamplingParams
from mla_jax.step_plan import StepPlan
from mla_jax.routing import PrefillRoute
from tests.helpers import two_process_engine
from tests.test_engine import _mqa_only_contract

TOPK = tiny_moe_lm().mla.indexer.topk  # 16
PROMPT_LENS = (5, TOPK, TOPK + 1, 16 * TOPK)  # shorter than top-k, around it, 16x it
NEW = 32
SETTINGS = dict(num_pages=64, page_size=8, max_num_seqs=4, max_step_tokens=64,
                log_interval=None)


def _mesh(spec: str):
  sizes = sharding.parse_mesh_spec(spec)
  return sharding.make_mesh(sizes, jax.devices()[:math.prod(sizes.values())])


def _model(mesh=None, config=None):
  return CausalLM(config or tiny_moe_lm(), rngs=nnx.Rngs(0), backend="xla", mesh=mesh)


def _prompts(lens=PROMPT_LENS, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, n).tolist() for n in lens]


# Two of four requests ask for log-probabilities (one step a dispatch) over their first 8
# tokens; the others then decode in multi-step dispatches.
PARAMS = [SamplingParams(max_tokens=8, logprobs=2) if i % 2 else SamplingParams(max_tokens=NEW)
          for i in range(4)]


@pytest.fixture(scope="module")
def reference():
  """One device's outputs of ``PARAMS`` over ``_prompts()``."""
  return Engine(_model(), **SETTINGS).generate(_prompts(), PARAMS)


def _same_outputs(got, want):
  assert [list(o.tokens) for o in got] == [list(o.tokens) for o in want]
  for g, w in zip(got, want):
    if w.logprobs is None:
      continue
    assert len(g.logprobs) == len(w.logprobs) == len(w.tokens)
    for a, b in zip(g.logprobs, w.logprobs):
      assert [t for t, _ in a.top] == [t for t, _ in b.top]
      np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], rtol=1e-5,
                                 atol=1e-6)


# ---- the ops against float64 ------------------------------------------------------------


def _attention64(q, pool, rows, valid, sm_scale, d_v):
  """float64 softmax attention of each query over its valid slots (duplicates count twice):
  ``(out, lse)``; a query without any gives out 0 and LSE +inf."""
  q, pool = np.asarray(q, np.float64), np.asarray(pool, np.float64)
  b, t, h, _ = q.shape
  out, lse = np.zeros((b, t, h, d_v)), np.full((b, t, h), np.inf)
  for i, j in np.ndindex(b, t):
    picked = pool[rows[i, j][valid[i, j]]]
    if not len(picked):
      continue
    logits = q[i, j] @ picked.T * sm_scale
    top = logits.max(-1, keepdims=True)
    weights = np.exp(logits - top)
    lse[i, j] = (top[:, 0] + np.log(weights.sum(-1)))
    out[i, j] = weights @ picked[:, :d_v] / weights.sum(-1, keepdims=True)
  return out, lse


@pytest.mark.parametrize("split_rows, dtype", [(False, jnp.float32), (True, jnp.float32),
                                               (False, jnp.bfloat16)],
                         ids=["exact", "union", "exact-bf16"])
def test_split_sparse_mqa_equals_float64_attention(split_rows, dtype):
  """Each rank's partial softmax of its tensor group's heads over the rows it holds, merged
  by LSE into its own heads, is one softmax over all of them (exact: any rank's rows in any
  slot; union: each rank's own columns, where it attends only the rows it holds). Heads over
  tensor x context: the queries are all-gathered over context and the partial outputs
  reduce-scattered (no all-reduce), in the outputs' dtype: bf16 within bf16's rounding of
  float64 over the same (rounded) inputs."""
  ranks, k, num_rows, sm_scale, d_v = 4, 6, 64, 0.3, 16
  mesh = _mesh(f"context={ranks},tensor=2")
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.standard_normal((2, 3, 8, 24)), dtype)  # 8 heads: 1 a rank
  pool = jnp.asarray(rng.standard_normal((num_rows, 24)), dtype)
  width = ranks * k if split_rows else k
  rows = rng.integers(-1, num_rows, (2, 3, width)).astype(np.int32)
  rows[0, 1] = -1  # a query without rows
  rows[1, 2, :2] = rows[1, 2, 2]  # a row selected three times
  valid = rows >= 0
  if split_rows:  # slot j belongs to rank j // k, which attends it only if the row is its own
    valid &= rows // (num_rows // ranks) == np.arange(width) // k
  placed_pool = jax.device_put(pool, NamedSharding(mesh, sharding.POOL_SPEC))
  ops = MeshOps(XlaBackend(), mesh)
  op = jax.jit(lambda q, p, r: ops.sparse_mqa(q, p, r, sm_scale=sm_scale, d_v=d_v,
                                              batched_rows=False, split_rows=split_rows))
  out, lse = op(q, placed_pool, rows)
  wide = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
  want_out, want_lse = _attention64(wide(q), wide(pool), rows, valid, sm_scale, d_v)
  rtol, atol = (1e-5, 1e-6) if dtype == jnp.float32 else (2e-2, 2e-2)
  assert out.dtype == dtype
  np.testing.assert_allclose(wide(out), want_out, rtol=rtol, atol=atol)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5)
  assert np.all(wide(out)[0, 1] == 0) and np.all(np.isinf(np.asarray(lse)[0, 1]))
  lowered = op.lower(q, placed_pool, rows)
  moved = traces.collective_bytes(lowered.compile().as_text())
  assert "all-reduce" not in moved and moved["reduce-scatter"] > 0, moved
  # The program reduce-scatters the partial outputs [2, 3, 1 head, 16] in the op's dtype
  # (XLA:CPU's compiler then promotes a bf16 reduction to float32; GPUs reduce bf16).
  scattered = re.findall(r"stablehlo\.reduce_scatter.*?-> tensor<([^>]*)>", lowered.as_text(),
                         re.DOTALL)
  assert scattered == [f"2x3x1x{d_v}x{jnp.dtype(dtype).name.replace('float', 'f')}"]


def test_pool_layout_puts_page_p_in_block_p_mod_context():
  """Every (layer, page, slot) has its own row, in the block of rank ``page % context``, the
  pages of a rank in order within each layer's part of its block."""
  reps, pages, page, ranks = 3, 8, 4, 4
  cache = PagedLayerCache(jnp.zeros((reps * pages * page, 2)), None, jnp.zeros((1, 1), jnp.int32),
                          jnp.zeros((reps, 1), jnp.int32), page, reps=reps, context=ranks)
  rows = jnp.arange(pages * page)
  flat = np.stack([np.asarray(cache.layer_view(i)._flat_rows(rows)) for i in range(reps)])
  assert sorted(flat.ravel().tolist()) == list(range(reps * pages * page))
  block = reps * pages * page // ranks
  page_of = np.asarray(rows) // page
  assert np.all(flat // block == page_of % ranks)
  # within a block: layer i's part, then the rank's pages in order, then the slot
  within = flat % block
  assert np.all(within // (pages // ranks * page) == np.arange(reps)[:, None])
  assert np.all(within % (pages // ranks * page) == (page_of // ranks) * page + np.asarray(rows) % page)


def _paged_keys(ranks: int, keys_BSI, table_BN, page: int):
  """A key pool of ``PagedLayerCache`` layout over ``ranks`` holding each sequence's keys at
  its pages, and the layer view that reads it."""
  b, s, _ = keys_BSI.shape
  num_pages = 48
  stacked = PagedLayerCache(jnp.zeros((num_pages * page, 2)), jnp.zeros((num_pages * page,
                                                                          keys_BSI.shape[-1])),
                            table_BN, jnp.zeros((1, b), jnp.int32), page, context=ranks)
  view = stacked.layer_view(0)
  rows = view._flat_rows(view.physical_rows(jnp.broadcast_to(jnp.arange(s), (b, s))))
  return stacked.index_keys_RI.at[rows].set(keys_BSI), view


@pytest.mark.parametrize("ranks", [2, 8])
def test_exact_top_k_equals_one_device_and_union_holds_it(ranks):
  """Over keys spread on the ranks by a random block table (sequences shorter than top-k,
  around it and 3x it, two queries each), exact mode selects one device's indices in one
  device's order; union mode every rank's own top-k, which holds all of them."""
  config = tiny_lm("mqa-only").mla
  indexer = Indexer(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(ranks)
  lens, page = np.array([5, TOPK + 1, 3 * TOPK]), 4
  b, s = len(lens), int(lens.max())
  table = rng.permutation(48)[:b * (s // page)].reshape(b, s // page).astype(np.int32)
  keys = jnp.asarray(rng.standard_normal((b, s, config.indexer.head_dim)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((b, 2, config.hidden_size)), jnp.float32)
  q_resid = jnp.asarray(rng.standard_normal((b, 2, config.q_lora_rank)), jnp.float32)
  positions = jnp.asarray(np.stack([lens - 2, lens - 1], 1), jnp.int32)
  mesh = _mesh(f"context={ranks}")

  # One token a row (a flat step's layout): row r is query r % 2 of sequence r // 2.
  seq_R = np.repeat(np.arange(b), 2)
  blocks = KeyBlocks.for_reaches(np.asarray(positions).reshape(-1) + 1, 8, 32)

  def select(ranks, ops, mode):
    pool, view = _paged_keys(ranks, keys, jnp.asarray(table), page)
    if ranks > 1:
      pool = jax.device_put(pool, NamedSharding(mesh, sharding.POOL_SPEC))
    rows_of = lambda rows_N, positions_NC: view._flat_rows(
        view.physical_rows(positions_NC, jnp.asarray(table)[seq_R][rows_N]))
    flat = lambda a: a.reshape(2 * b, 1, *a.shape[2:])
    return np.asarray(jax.jit(lambda pool: indexer.select_in_blocks(
        flat(x), flat(q_resid), flat(positions), pool, rows_of, ops, blocks=blocks,
        key_chunk=8, context_topk=mode))(pool)).reshape(b, 2, -1)

  one = select(1, MeshOps(XlaBackend()), "exact")
  assert (one >= 0).sum(-1).tolist() == np.minimum(positions + 1, TOPK).tolist()
  ops = MeshOps(XlaBackend(), mesh)
  np.testing.assert_array_equal(select(ranks, ops, "exact"), one)
  union = select(ranks, ops, "union")
  assert union.shape == (b, 2, ranks * TOPK)
  for u, e in zip(union.reshape(-1, ranks * TOPK), one.reshape(-1, TOPK)):
    assert set(e[e >= 0]) <= set(u[u >= 0])
    assert len(set(u[u >= 0])) == (u >= 0).sum()  # no key twice


# ---- the engine -------------------------------------------------------------------------


def _check_engine(engine):
  engine.pages.check()
  assert engine.pages.num_free == engine.num_pages
  _mqa_only_contract(engine.programs)


# The meshes of one 8-GPU node: the weights 8 ways over tensor x context, as on tensor=8.
MESHES = ("tensor=4,context=2", "tensor=2,context=4", "context=8")


@functools.lru_cache(maxsize=None)
def _mesh_model(spec: str, config=None):
  """One model per mesh for the module: engines over it share compiled programs."""
  return _model(_mesh(spec), config)


@pytest.mark.parametrize("spec", MESHES)
def test_exact_mode_equals_one_device(spec, reference):
  """Greedy tokens identical to one device over 32 new tokens, log-probabilities within
  float32 rounding, with a 16x top-k prompt prefilled in chunks whose keys lie on every rank
  and decodes run several steps a dispatch; the MQA-only contract holds on every program."""
  engine = Engine(_mesh_model(spec), **SETTINGS)
  _same_outputs(engine.generate(_prompts(), PARAMS), reference)
  assert any(c.shape.decode_steps > 1 for c in engine.programs)
  assert all(c.plan.context_topk == "exact" for c in engine.programs)
  _check_engine(engine)


def test_union_mode_equals_exact_while_every_key_fits_in_each_rank_top_k(reference):
  """Union mode attends over each rank's own top-k: while a sequence has at most top-k keys,
  every rank's holds all of its keys, so union selects what exact does (the prompts shorter
  than and equal to top-k, decoded while they stay within it). An exact engine over the same
  model compiles the same shapes first: the union engine shares none of its programs."""
  model = _mesh_model("tensor=2,context=4")
  prompts, params = _prompts()[:2], PARAMS[:2]
  short = [dataclasses.replace(p, max_tokens=1) for p in params]
  exact = Engine(model, **SETTINGS)
  want = exact.generate(prompts, short)
  engine = Engine(model, **SETTINGS, context_topk="union")
  _same_outputs(engine.generate(prompts, short), want)
  assert {c.shape for c in engine.programs} == {c.shape for c in exact.programs}
  assert all(c.plan.context_topk == "union" for c in engine.programs)
  _check_engine(engine)


_RNG = np.random.default_rng(3)
TIGHT_PROMPTS = [_RNG.integers(0, 256, size=24).tolist() for _ in range(4)]
FAMILY = [TIGHT_PROMPTS[3][:16] + p[:n] for p, n in zip(TIGHT_PROMPTS, (4, 9, 1))]
TIGHT = dict(SETTINGS, num_pages=16, max_step_tokens=32)


def _preempt_and_hit(engine):
  """Outputs of prompts that preempt each other in ``TIGHT`` pools, then of a family of
  prompts whose first 16 tokens (2 pages) the first of them leaves cached."""
  got = engine.generate(TIGHT_PROMPTS, max_tokens=12)
  assert engine.scheduler.num_preemptions > 0
  engine.generate(FAMILY[:1], max_tokens=6)
  hits = engine.generate(FAMILY[1:], max_tokens=6)
  assert all(o.num_cached_prompt_tokens == 16 for o in hits)
  return got, hits


@pytest.fixture(scope="module")
def tight_reference():
  return _preempt_and_hit(Engine(_model(), **TIGHT))


@pytest.mark.parametrize("spec", MESHES)
def test_preemption_and_prefix_hits_over_the_context_axis(spec, tight_reference):
  """A preempted sequence recomputes onto pages of any rank, and a prefix hit reads pages
  another request wrote: both give one device's tokens."""
  engine = Engine(_mesh_model(spec), **TIGHT)
  for got, want in zip(_preempt_and_hit(engine), tight_reference):
    _same_outputs(got, want)
  _check_engine(engine)


def test_speculative_decoding_over_the_context_axis():
  """Accepted drafts and rollbacks on split pools (the anchors' MTP x DCP bug): per-request
  drafts (k = 0, 1, 2) give one device's greedy tokens (and log-probabilities, asked by the
  request drafting 2), the MTP layer's weights split 8 ways over the context ranks like the
  model's."""
  config = dataclasses.replace(tiny_moe_lm(), num_mtp_layers=1)
  params = [SamplingParams(max_tokens=8, speculative_tokens=k, logprobs=2 if k == 2 else None)
            for k in (0, 1, 2)]
  prompts = _prompts((5, 30, 12))
  settings = dict(SETTINGS, num_pages=16, max_speculative_tokens=2)
  want = Engine(_model(config=config), **settings).generate(prompts, params)
  model = _model(_mesh("context=8"), config)
  q_b = model.mtp[0].block.self_attn.q_b_proj.weight[...]
  assert q_b.addressable_shards[0].data.size * 8 == q_b.size
  engine = Engine(model, **settings)
  _same_outputs(engine.generate(prompts, params), want)
  assert engine.stats.draft_tokens > 0 and engine.stats.accepted_tokens > 0
  engine.pages.check()


def test_two_process_engine_over_the_context_axis_equals_one_process(tmp_path):
  """Two processes (gloo) of two devices each, the four context ranks split over them (the
  queries' all-gather and the partial outputs' reduce-scatter cross processes), equal one
  process's tokens and log-probabilities (the worker's second request asks for them)."""
  got, prompts = two_process_engine(tmp_path, "context=4")
  one = Engine(_model(config=tiny_moe_lm()), num_pages=16, page_size=8, max_num_seqs=4,
               max_step_tokens=16, log_interval=None)
  params = [SamplingParams(max_tokens=5, logprobs=2 if i == 1 else None)
            for i in range(len(prompts))]
  want = one.generate(prompts, params)
  assert got["tokens"].tolist() == [list(o.tokens) for o in want]
  top = [t.top for t in want[1].logprobs]
  assert got["top_ids"].tolist() == [[i for i, _ in t] for t in top]
  np.testing.assert_allclose(got["top_logprobs"], [[v for _, v in t] for t in top], rtol=1e-5,
                             atol=1e-6)


# ---- what is refused --------------------------------------------------------------------


def test_bad_context_settings_are_named_errors():
  mesh = _mesh("context=4")
  model = _model(mesh)
  with pytest.raises(ValueError, match="num_pages 30 cannot be split over mesh axis 'context'"):
    Engine(model, **{**SETTINGS, "num_pages": 30})
  with pytest.raises(ValueError, match="unknown context top-k mode 'approx'"):
    Engine(model, **SETTINGS, context_topk="approx")
  with pytest.raises(ValueError, match="generate's contiguous caches cannot be split"):
    model.init_cache(1, 16)
  with pytest.raises(ValueError, match="unknown context top-k mode"):
    StepPlan(PrefillRoute.SPARSE_MQA, 1, None, 8, (object,), XlaBackend, context_topk="all")
  with pytest.raises(SystemExit, match="generate's contiguous caches cannot be split"):
    cli.main(["generate", "--preset", "tiny", "--mesh", "context=2"])
  with pytest.raises(SystemExit):  # argparse: invalid choice
    cli.main(["serve", "--dcp-indexer-mode", "approx"])
  with pytest.raises(ValueError, match="mesh data=1,tensor=1,expert=1,context=3 needs 3"):
    sharding.make_mesh("context=3")
  assert context_parallel.check_mode("union") == "union"
