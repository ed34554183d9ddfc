"""MoE router, experts and dense MLP vs an independent float64 NumPy reference (docs/design.md §9).

The reference below is written from docs/design.md §9, one token at a time, and shares no
code with ``mla_jax.models.moe``. Inputs are fresh random normals, so selections are free of
ties; one constructed case checks the lower-index tie rule on its own.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from flax import nnx

from mla_jax.models.config import MoEConfig, tiny_lm
from mla_jax.models.mlp import MLP
from mla_jax.models.moe import MoE, route_tokens, routed_experts, tile_plan
from mla_jax.params import dotted_name

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# Eager dispatch compiles every op per shape, so only the first cases of each dict also run
# without jit; the rest run jitted to keep the file fast.
ROUTER_CASES = dict(
    dsv32=MoEConfig(num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4),
    glm5=MoEConfig(num_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1),
)
MORE_ROUTER_CASES = dict(
    tiny=tiny_lm().moe,
    one_expert_per_group=MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=8,
                                   topk_group=3),
    unnormalized=MoEConfig(num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           norm_topk_prob=False, routed_scaling_factor=1.5),
)

MOE_CASES = dict(tiny=tiny_lm().moe)
MORE_MOE_CASES = dict(
    glm_like=MoEConfig(num_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
                       n_shared_experts=2, moe_intermediate_size=32),
    no_shared=MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                        n_shared_experts=0, moe_intermediate_size=32),
)

HIDDEN = 64


# ---------------------------------------------------------------- NumPy float64 reference

def ref_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def ref_silu(x):
  return x * ref_sigmoid(x)


def ref_route(logits, bias, cfg: MoEConfig):
  """The router of docs/design.md §9 for each token: (expert ids, weights), best first."""
  logits = np.asarray(logits, np.float64)
  bias = np.asarray(bias, np.float64)
  num_tokens, num_experts = logits.shape
  per_group = num_experts // cfg.n_group
  idx = np.zeros((num_tokens, cfg.num_experts_per_tok), np.int64)
  weights = np.zeros((num_tokens, cfg.num_experts_per_tok))
  for t in range(num_tokens):
    scores = ref_sigmoid(logits[t])
    select = scores + bias
    groups = np.sort(select.reshape(cfg.n_group, per_group), axis=1)[:, ::-1]
    group_score = groups[:, :2].sum(axis=1)
    kept = np.argsort(-group_score, kind="stable")[:cfg.topk_group]
    select = np.where(np.isin(np.arange(num_experts) // per_group, kept), select, -np.inf)
    idx[t] = np.argsort(-select, kind="stable")[:cfg.num_experts_per_tok]
    w = scores[idx[t]]
    if cfg.norm_topk_prob:
      w = w / (w.sum() + 1e-20)
    weights[t] = w * cfg.routed_scaling_factor
  return idx, weights


def ref_mlp(x, params, prefix):
  gate = x @ params[f"{prefix}gate_proj.weight"].T
  up = x @ params[f"{prefix}up_proj.weight"].T
  return (ref_silu(gate) * up) @ params[f"{prefix}down_proj.weight"].T


def ref_moe(x, params, cfg: MoEConfig):
  """out_t = sum_k w_tk * expert_{idx_tk}(x_t) + shared(x_t) (docs/design.md §9)."""
  x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
  idx, weights = ref_route(x @ params["gate.weight"].T, params["gate.e_score_correction_bias"],
                           cfg)
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for e, w in zip(idx[t], weights[t]):
      out[t] += w * ref_mlp(x[t], params, f"experts.{e}.")
  if cfg.n_shared_experts:
    out += ref_mlp(x, params, "shared_experts.")
  return out


# ---------------------------------------------------------------- helpers

def hf_params(module):
  """{HF name: value} from the module's NNX state (ShapeDtypeStruct if abstract).

  The stacked experts ``experts.gate_proj`` [E, F, D] are split into HF's per-expert
  ``experts.{e}.gate_proj.weight`` here, independently of ``mla_jax.models.hf_layout``.
  """
  out = {}
  for path, v in nnx.to_flat_state(nnx.state(module)):
    name, value = dotted_name(path), v.get_value()
    if name.startswith("experts."):
      for e in range(value.shape[0]):
        out[f"experts.{e}.{name.split('.')[1]}.weight"] = (
            jax.ShapeDtypeStruct(value.shape[1:], value.dtype)
            if isinstance(value, jax.ShapeDtypeStruct) else value[e])
    else:
      out[name] = value
  return out


def float64_params(module):
  return {k: np.asarray(v, np.float64) for k, v in hf_params(module).items()}


def rel_err(actual, expected):
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def sorted_by_expert(idx, weights):
  """Rows sorted by expert id, so selections compare as sets with their weights attached."""
  idx = np.asarray(idx)
  order = np.argsort(idx, axis=1)
  return (np.take_along_axis(idx, order, axis=1),
          np.take_along_axis(np.asarray(weights, np.float64), order, axis=1))


def assert_routes_match(idx, weights, ref_idx, ref_weights, tol=1e-5):
  chex.assert_type(idx, jnp.int32)
  chex.assert_type(weights, jnp.float32)
  idx, weights = sorted_by_expert(idx, weights)
  ref_idx, ref_weights = sorted_by_expert(ref_idx, ref_weights)
  np.testing.assert_array_equal(idx, ref_idx)
  err = rel_err(weights, ref_weights)
  assert err < tol, err


def random_router_inputs(cfg: MoEConfig, num_tokens=32, seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(0.0, 2.0, (num_tokens, cfg.num_experts)).astype(np.float32)
  bias = rng.normal(0.0, 0.5, (cfg.num_experts,)).astype(np.float32)
  return logits, bias


def random_module(make, seed=0):
  """``make()`` with every parameter drawn from a seeded normal (std 1/sqrt(fan-in)).

  Built abstractly and filled from NumPy: skips compiling jax.random for every shape, and
  gives the router bias nonzero values, as a trained checkpoint would have.
  """
  module = nnx.eval_shape(make)
  rng = np.random.default_rng(seed)
  nnx.update(module, jax.tree.map(
      lambda p: jnp.asarray(rng.normal(0.0, p.shape[-1]**-0.5, p.shape), p.dtype),
      nnx.state(module)))
  return module


def make_moe(cfg: MoEConfig, dtype=jnp.float32, seed=0, impl="tiled", tokens=8):
  moe = random_module(lambda: MoE(HIDDEN, cfg, rngs=nnx.Rngs(0), grouped_matmul=impl,
                                  param_dtype=dtype), seed)
  x = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(2, tokens, HIDDEN)), dtype)
  return moe, x


def apply(graphdef, state, x):
  return nnx.merge(graphdef, state)(x)


# Static graphdef: one compile per module structure and input shape, shared across tests.
jit_apply = jax.jit(apply, static_argnums=0)


def run_module(module, x, fn=jit_apply):
  return fn(*nnx.split(module), x)


# One compile per config instead of one per eager op keeps the single-shot tests fast.
route = jax.jit(route_tokens, static_argnames="config")


# ---------------------------------------------------------------- tests

class RouterTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*ROUTER_CASES.items())
  def test_matches_reference(self, cfg):
    logits, bias = random_router_inputs(cfg)
    idx, weights = self.variant(functools.partial(route_tokens, config=cfg))(logits, bias)
    chex.assert_shape([idx, weights], (logits.shape[0], cfg.num_experts_per_tok))
    assert_routes_match(idx, weights, *ref_route(logits, bias, cfg))

  @parameterized.named_parameters(*MORE_ROUTER_CASES.items())
  def test_matches_reference_jit(self, cfg):
    logits, bias = random_router_inputs(cfg)
    assert_routes_match(*route(logits, bias, config=cfg), *ref_route(logits, bias, cfg))

  def test_best_expert_in_dropped_group_is_not_chosen(self):
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                    routed_scaling_factor=1.0)
    # Expert 0 has the top score, but its group's top-2 sum (~1.0) ranks third behind
    # groups 1 (~1.70) and 2 (~1.63).
    logits = np.array([[4.0, -4.0, 2.0, 1.5, 1.8, 1.2, -1.0, -2.0]], np.float32)
    bias = np.random.default_rng(1).normal(0.0, 0.01, (8,)).astype(np.float32)
    idx, weights = route(logits, bias, config=cfg)
    self.assertNotIn(0, np.asarray(idx[0]).tolist())
    self.assertEqual(sorted(np.asarray(idx[0]).tolist()), [2, 4])
    assert_routes_match(idx, weights, *ref_route(logits, bias, cfg))

  def test_dropped_groups_masked_with_minus_inf(self):
    # Biased scores all negative: a 0.0 fill (HF) would let dropped experts win.
    cfg = MoEConfig(num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    logits, bias = random_router_inputs(cfg, seed=2)
    bias = bias * 0.01 - 1.5
    idx, weights = route(logits, bias, config=cfg)
    select = ref_sigmoid(logits.astype(np.float64)) + bias
    group_score = np.sort(select.reshape(-1, 4, 4), axis=-1)[..., -2:].sum(-1)
    kept = np.argsort(-group_score, axis=1, kind="stable")[:, :2]
    for t in range(logits.shape[0]):
      self.assertTrue(np.isin(np.asarray(idx[t]) // 4, kept[t]).all())
    assert_routes_match(idx, weights, *ref_route(logits, bias, cfg))

  def test_bias_selects_but_does_not_weight(self):
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                    norm_topk_prob=False, routed_scaling_factor=1.0)
    logits, _ = random_router_inputs(cfg, num_tokens=1, seed=3)
    weakest = int(np.argmin(logits[0]))
    bias = np.random.default_rng(4).normal(0.0, 0.01, (8,)).astype(np.float32)
    bias[weakest] = 10.0
    idx, weights = route(logits, bias, config=cfg)
    self.assertEqual(int(idx[0, 0]), weakest)
    expected = ref_sigmoid(logits[0].astype(np.float64))[np.asarray(idx[0])]
    np.testing.assert_allclose(np.asarray(weights[0]), expected, rtol=1e-6)

  def test_single_group_equals_plain_topk(self):
    cfg = MoEConfig(num_experts=32, num_experts_per_tok=4, n_group=1, topk_group=1)
    logits, bias = random_router_inputs(cfg, seed=5)
    idx, _ = route(logits, bias, config=cfg)
    select = ref_sigmoid(logits.astype(np.float64)) + bias
    np.testing.assert_array_equal(np.sort(np.asarray(idx), axis=1),
                                  np.sort(np.argsort(-select, axis=1)[:, :4], axis=1))

  @parameterized.parameters((True, 2.5), (False, 1.5))
  def test_normalization_and_scaling(self, norm_topk_prob, routed_scaling_factor):
    cfg = MoEConfig(num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                    norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    logits, bias = random_router_inputs(cfg, seed=6)
    idx, weights = route(logits, bias, config=cfg)
    scores = ref_sigmoid(logits.astype(np.float64))
    chosen = np.take_along_axis(scores, np.asarray(idx), axis=1)
    if norm_topk_prob:
      np.testing.assert_allclose(np.asarray(weights).sum(1), routed_scaling_factor, rtol=1e-6)
      chosen = chosen / chosen.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights), chosen * routed_scaling_factor, rtol=1e-6)

  def test_ties_go_to_lower_index(self):
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2)
    idx, weights = route(np.zeros((2, 8), np.float32), np.zeros(8, np.float32), config=cfg)
    np.testing.assert_array_equal(np.asarray(idx), [[0, 1, 2]] * 2)
    np.testing.assert_allclose(np.asarray(weights), cfg.routed_scaling_factor / 3, rtol=1e-6)

  def test_deterministic(self):
    cfg = ROUTER_CASES["dsv32"]
    logits, bias = random_router_inputs(cfg, seed=7)
    chex.assert_trees_all_equal(route(logits, bias, config=cfg), route(logits, bias, config=cfg))


IMPLS = ("tiled", "ragged_dot")


class MoETest(chex.TestCase):

  def check_against_reference(self, cfg, dtype, fn=jit_apply, impl="tiled", moe_x=None):
    moe, x = moe_x or make_moe(cfg, dtype, impl=impl)
    out = run_module(moe, x, fn)
    chex.assert_shape(out, x.shape)
    chex.assert_type(out, dtype)
    chex.assert_tree_all_finite(out)
    params = float64_params(moe)
    expected = ref_moe(np.asarray(x.astype(jnp.float32)), params, cfg)
    err = rel_err(np.asarray(out.astype(jnp.float32)).reshape(expected.shape), expected)
    assert err < TOLERANCE[dtype], err

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*MOE_CASES.items())
  def test_matches_reference_float32(self, cfg):
    self.check_against_reference(cfg, jnp.float32, self.variant(apply, static_argnums=0))

  @parameterized.named_parameters(
      (f"{name}_{jnp.dtype(dtype).name}_{impl}", cfg, dtype, impl)
      for name, cfg in {**MOE_CASES, **MORE_MOE_CASES}.items()
      for dtype in (jnp.float32, jnp.bfloat16) for impl in IMPLS)
  def test_matches_reference_jit(self, cfg, dtype, impl):
    self.check_against_reference(cfg, dtype, impl=impl)

  @parameterized.named_parameters(*((impl, impl) for impl in IMPLS))
  def test_crowded_and_empty_experts(self, impl):
    """Every token routed to experts 0 and 1 (bias drives selection): two large groups,
    six experts with no token at all; the weights stay the unbiased scores."""
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                    n_shared_experts=1, moe_intermediate_size=32)
    moe, x = make_moe(cfg, impl=impl, tokens=16)
    moe.gate.e_score_correction_bias[...] = jnp.array([50.0, 40.0] + [0.0] * 6)
    idx, _ = moe.gate(x.reshape(-1, HIDDEN))
    assert set(np.unique(np.asarray(idx))) == {0, 1}
    self.check_against_reference(cfg, jnp.float32, moe_x=(moe, x))

  @parameterized.named_parameters(*((impl, impl) for impl in IMPLS))
  def test_expert_shards_add_up_to_the_whole(self, impl):
    """What each expert-parallel shard computes (its own experts only) sums to the whole."""
    rng = np.random.default_rng(3)
    num_experts, tokens, top, ffn = 8, 12, 3, 16
    x = jnp.asarray(rng.normal(size=(tokens, HIDDEN)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(num_experts, top, replace=False)
                                for _ in range(tokens)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, top)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(num_experts, ffn, HIDDEN)) / 8, jnp.float32)
                for _ in range(2))
    down = jnp.asarray(rng.normal(size=(num_experts, HIDDEN, ffn)) / 4, jnp.float32)
    # Jitted, first_expert traced as under shard_map: one program for the four shards.
    experts = jax.jit(routed_experts, static_argnames="impl")
    whole = experts(x, idx, w, gate, up, down, impl=impl)
    parts = sum(experts(x, idx, w, gate[s:s + 2], up[s:s + 2], down[s:s + 2],
                        first_expert=s, impl=impl) for s in range(0, num_experts, 2))
    params = {f"experts.{e}.{n}_proj.weight": np.asarray(v[e], np.float64)
              for e in range(num_experts) for n, v in (("gate", gate), ("up", up),
                                                       ("down", down))}
    expected = np.zeros((tokens, HIDDEN))
    for t in range(tokens):
      for e, weight in zip(np.asarray(idx[t]), np.asarray(w[t], np.float64)):
        expected[t] += weight * ref_mlp(np.asarray(x[t], np.float64), params, f"experts.{e}.")
    assert rel_err(whole, expected) < 1e-5
    assert rel_err(parts, expected) < 1e-5

  @parameterized.parameters(1, 7, 64, 512, 4096)
  def test_tiled_work_is_bounded_by_routed_rows(self, rows):
    """Whatever the number of experts, the tiled matmul multiplies at most 2x the routed
    rows and reads at most 2x min(experts, rows) weight matrices (static shapes), and its
    tiles hold every way the rows can fall into groups (else rows would be dropped)."""
    rng = np.random.default_rng(rows)
    for num_experts in (1, 8, 64, 256, 4096):
      tile, num_tiles = tile_plan(rows, num_experts)
      assert tile * num_tiles <= 2 * rows, (rows, num_experts)
      assert num_tiles <= 2 * min(num_experts, rows), (rows, num_experts)
      used = min(num_experts, rows)
      worst = [1] * (used - 1) + [rows - used + 1]  # every used group with a ragged tile
      splits = [worst] + [np.bincount(rng.integers(0, num_experts, rows)) for _ in range(5)]
      for sizes in splits:
        assert sum(-(-int(n) // tile) for n in sizes) <= num_tiles, (rows, num_experts)

  def test_tiled_cost_follows_routed_rows_not_experts(self):
    """XLA's cost analysis of the MoE layer: ~flat from 8 to 64 experts, ~linear in top-k."""

    def flops(num_experts, top):
      cfg = MoEConfig(num_experts=num_experts, num_experts_per_tok=top, n_group=1,
                      topk_group=1, n_shared_experts=0, moe_intermediate_size=64)
      moe = nnx.eval_shape(lambda: MoE(HIDDEN, cfg, rngs=nnx.Rngs(0), grouped_matmul="tiled"))
      graphdef, state = nnx.split(moe)
      x = jax.ShapeDtypeStruct((1, 64, HIDDEN), jnp.float32)
      cost = jit_apply.lower(graphdef, state, x).compile().cost_analysis()
      return (cost[0] if isinstance(cost, list) else cost)["flops"]

    base = flops(8, 2)
    assert flops(64, 2) < 1.5 * base
    assert flops(8, 4) > 1.7 * base

  def test_deterministic(self):
    moe, x = make_moe(MOE_CASES["tiny"])
    chex.assert_trees_all_equal(run_module(moe, x), run_module(moe, x))

  @parameterized.named_parameters(("float32", jnp.float32), ("bfloat16", jnp.bfloat16))
  def test_parameter_names_and_shapes_match_hf(self, dtype):
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                    n_shared_experts=2, moe_intermediate_size=16)
    # eval_shape: names, shapes and dtypes without running any initializer.
    moe = nnx.eval_shape(lambda: MoE(HIDDEN, cfg, rngs=nnx.Rngs(0),
                                     param_dtype=dtype))
    stacked = {dotted_name(p): v.shape for p, v in nnx.to_flat_state(nnx.state(moe))
               if dotted_name(p).startswith("experts.")}
    self.assertEqual(stacked, {"experts.gate_proj": (4, 16, HIDDEN),
                               "experts.up_proj": (4, 16, HIDDEN),
                               "experts.down_proj": (4, HIDDEN, 16)})
    params = hf_params(moe)
    ffn, shared = cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    expected = {"gate.weight": (4, HIDDEN), "gate.e_score_correction_bias": (4,)}
    for prefix, width in [(f"experts.{e}", ffn) for e in range(4)] + [("shared_experts", shared)]:
      expected[f"{prefix}.gate_proj.weight"] = (width, HIDDEN)
      expected[f"{prefix}.up_proj.weight"] = (width, HIDDEN)
      expected[f"{prefix}.down_proj.weight"] = (HIDDEN, width)
    self.assertEqual({k: v.shape for k, v in params.items()}, expected)
    # The router stays fp32 whatever the model dtype (docs/design.md §9).
    self.assertEqual(params["gate.weight"].dtype, np.float32)
    self.assertEqual(params["gate.e_score_correction_bias"].dtype, np.float32)
    self.assertEqual(params["experts.0.gate_proj.weight"].dtype, jnp.dtype(dtype))

  def test_no_shared_experts(self):
    cfg = MORE_MOE_CASES["no_shared"]
    moe = nnx.eval_shape(lambda: MoE(HIDDEN, cfg, rngs=nnx.Rngs(0)))
    self.assertIsNone(moe.shared_experts)
    self.assertFalse(any(k.startswith("shared_experts") for k in hf_params(moe)))


class MLPTest(chex.TestCase):

  @parameterized.named_parameters(("float32", jnp.float32), ("bfloat16", jnp.bfloat16))
  def test_matches_reference(self, dtype):
    mlp = random_module(lambda: MLP(HIDDEN, 96, rngs=nnx.Rngs(0), param_dtype=dtype))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, HIDDEN)), dtype)
    out = run_module(mlp, x)
    chex.assert_shape(out, x.shape)
    chex.assert_type(out, dtype)
    params = float64_params(mlp)
    expected = ref_mlp(np.asarray(x.astype(jnp.float32), np.float64), params, "")
    err = rel_err(np.asarray(out.astype(jnp.float32)), expected)
    assert err < TOLERANCE[dtype], err
