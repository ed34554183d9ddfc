"""Measurements shared by ``benchmarks/routes.py`` and ``notebooks/compare_routes.ipynb``.

Two prefill routes of one MLA layer with the same weights:

* ``dense_mha``  - ``MLAAttention``: decompress per-head K/V, causal attention (docs/design.md §2).
  The library takes this route only while ``length <= index_topk`` (there it is exact). Past
  top-k we measure the same module built without an indexer (dense causal MLA, DeepSeek-V3
  style), which is what "dense attention" costs at that length; ``route_program`` checks the
  traced scopes so a row is never labelled with a route it did not run.
* ``sparse_mqa`` - ``DeepseekV32Attention``: indexer top-k, absorbed MQA over those rows (5.2).

Everything here is a plain function of (config, length); nothing is cached across calls except
the jitted programs that ``RoutePrograms`` builds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mla_jax as m
from benchmarks.timing import side_by_side
from mla_jax import testing as mt
from mla_jax.params import flat_params, set_flat_params
from mla_jax.routing import PrefillRoute
from mla_jax.traces import summarize

ROUTES = ("dense_mha", "sparse_mqa")
_ROUTE_SCOPES = {"dense_mha": PrefillRoute.DENSE_MHA.scope,
                 "sparse_mqa": PrefillRoute.SPARSE_MQA.scope}


# ---- the layers ---------------------------------------------------------------------------

@dataclasses.dataclass
class RouteLayers:
  """Three modules sharing one set of random weights (the indexer-free one lacks the indexer)."""

  config: m.MLAConfig
  dense: m.MLAAttention               # dense-capable: DENSE_MHA while length <= topk
  sparse: m.DeepseekV32Attention      # MQA-only: always indexer + SPARSE_MQA
  dense_causal: m.MLAAttention        # no indexer: DENSE_MHA at every length

  def for_route(self, route: str, length: int):
    """The module that runs ``route`` for a fresh prefill of ``length`` tokens."""
    if route == "sparse_mqa":
      return self.sparse
    if route == "dense_mha":
      return self.dense if length <= self.config.indexer.topk else self.dense_causal
    raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def without_indexer(layer: m.MLAAttention) -> m.MLAAttention:
  """An indexer-free ``MLAAttention`` with ``layer``'s other weights: dense causal MLA."""
  config = dataclasses.replace(layer.config, indexer=None)
  copy = m.MLAAttention(config, rngs=nnx.Rngs(0), backend=layer.backend)
  set_flat_params(copy, {k: v for k, v in flat_params(layer).items()
                         if not k.startswith("indexer.")})
  return copy


def build_route_layers(config: m.MLAConfig, backend=None, seed: int = 0) -> RouteLayers:
  """``MLAAttention``, ``DeepseekV32Attention`` and an indexer-free ``MLAAttention``, same weights."""
  if config.indexer is None:
    raise ValueError("route comparisons need a config with an indexer")
  backend = backend or m.XlaBackend()
  dense = m.MLAAttention(config, rngs=nnx.Rngs(seed), backend=backend)
  mt.randomize_params(dense, seed + 1)
  sparse = m.DeepseekV32Attention(config, rngs=nnx.Rngs(seed), backend=backend)
  nnx.update(sparse, nnx.state(dense, nnx.Param))
  return RouteLayers(config, dense, sparse, without_indexer(dense))


def prefill_inputs(config: m.MLAConfig, length: int, *, seed: int = 0, batch: int = 1,
                   dtype=jnp.float32, index_keys: bool = True):
  """Random hidden states [batch, length, D] and an empty cache of capacity ``length``."""
  x = mt.random_hidden(seed, (batch, length, config.hidden_size), dtype)
  cache = m.init_layer_cache(config, batch, length, dtype, index_keys=index_keys)
  return x, cache


def layer_program(layer, *, force_mqa: bool = False, with_topk: bool = False):
  """A jitted pure function ``f(state, x, cache) -> out_BTD`` (and top-k) and the layer state.

  The prefill is fresh (``num_cached_tokens=0``), so the route is resolved while tracing.
  """
  graphdef, state = nnx.split(layer)

  def prefill(state, x_BTD, cache):
    out = nnx.merge(graphdef, state)(x_BTD, cache, num_cached_tokens=0, force_mqa=force_mqa)
    return (out.out_BTD, out.topk_BTK) if with_topk else out.out_BTD

  return jax.jit(prefill), state


def route_program(layers: RouteLayers, route: str, length: int, *, seed: int = 0):
  """``(fn, args)`` for one route at one prompt length; asserts the traced route.

  ``fn(*args)`` returns the layer output [1, length, D].
  """
  layer = layers.for_route(route, length)
  fn, state = layer_program(layer)
  x, cache = prefill_inputs(layer.config, length, seed=seed)
  args = (state, x, cache)
  scopes = summarize(fn, *args).scopes
  other = _ROUTE_SCOPES["sparse_mqa" if route == "dense_mha" else "dense_mha"]
  if _ROUTE_SCOPES[route] not in scopes or other in scopes:
    raise AssertionError(f"{type(layer).__name__} at length {length} did not trace {route}: "
                         f"{sorted(s for s in scopes if s.startswith('mla_'))}")
  return fn, args


# ---- cost: XLA's analysis, the kernels' declared estimates, docs/design.md §2 -------------

def _first_cost_dict(analysis) -> dict:
  """``cost_analysis()`` is a dict in new jax and a list with one dict per program in old."""
  if analysis is None:
    return {}
  if isinstance(analysis, Mapping):
    return dict(analysis)
  if isinstance(analysis, Sequence) and analysis:
    return dict(analysis[0] or {})
  return {}


def cost_of(fn: Callable, *args) -> dict[str, float]:
  """XLA's compiled-program cost: ``{"flops", "bytes", "transcendentals"}`` (floats, NaN if absent).

  ``fn`` may be jitted already; it is compiled, not run.
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  cost = _first_cost_dict(jitted.lower(*args).compile().cost_analysis())
  get = lambda key: float(cost.get(key, math.nan))
  return {"flops": get("flops"), "bytes": get("bytes accessed"),
          "transcendentals": get("transcendentals")}


def _pallas_calls(jaxpr):
  from mla_jax.traces import _sub_jaxprs  # the same walk that ``summarize`` uses
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        yield from _pallas_calls(sub)


def kernel_cost_estimates(fn: Callable, *args) -> list[dict]:
  """The ``pl.CostEstimate`` each Pallas kernel in ``fn``'s jaxpr declares (traced, not run).

  Returns one dict per ``pallas_call``: name, flops, bytes, transcendentals. Under ``vmap`` a
  kernel's estimate is the per-sequence one; the batch here is 1, so it is the whole cost.
  """
  from mla_jax.traces import _kernel_name
  closed = jax.make_jaxpr(fn)(*args)
  rows = []
  for eqn in _pallas_calls(closed.jaxpr):
    est = eqn.params.get("cost_estimate")
    rows.append({"kernel": _kernel_name(eqn),
                 "flops": float(getattr(est, "flops", math.nan)),
                 "bytes": float(getattr(est, "bytes_accessed", math.nan)),
                 "transcendentals": float(getattr(est, "transcendentals", math.nan))})
  return rows


def _causal_pairs(length: int) -> int:
  return length * (length + 1) // 2


def _topk_pairs(length: int, topk: int) -> int:
  """sum over t < length of min(t + 1, topk)."""
  if length <= topk:
    return _causal_pairs(length)
  return _causal_pairs(topk) + (length - topk) * topk


def analytic_flops(config: m.MLAConfig, length: int, route: str, *,
                   include_absorption: bool = False) -> float:
  """Attention FLOPs of a fresh causal prefill of ``length`` tokens (docs/design.md §2 cost model).

  dense_mha:  L(L+1)/2 pairs x 2H(N+R+V)  +  L x 2AH(N+V) (K/V up-projection per key)
  sparse_mqa: sum_t min(t+1, K) pairs x 2H((A+R) + A)  +  L(L+1)/2 x 2GI (indexer scores)

  That model leaves out the MQA form's absorption (W_UK into q, W_UV on the output),
  2AH(N+V) per *query* token, which in a prefill equals the dense up-projection per *key*.
  ``include_absorption=True`` adds it to the sparse route.
  """
  c = config
  h, n, r, v, a = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                   c.kv_lora_rank)
  up_projection = 2 * a * h * (n + v)
  if route == "dense_mha":
    return float(_causal_pairs(length) * 2 * h * (n + r + v) + length * up_projection)
  if route == "sparse_mqa":
    ic = c.indexer
    if ic is None:
      raise ValueError("sparse_mqa needs a config with an indexer")
    flops = (_topk_pairs(length, ic.topk) * 2 * h * ((a + r) + a)
             + _causal_pairs(length) * 2 * ic.num_heads * ic.head_dim)
    if include_absorption:
      flops += length * up_projection
    return float(flops)
  raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def analytic_crossover(config: m.MLAConfig, *, include_absorption: bool = False,
                       max_length: int = 1 << 22) -> int | None:
  """The shortest prompt from which on sparse MQA needs fewer analytic FLOPs than dense MHA.

  Scans every length up to ``max_length`` (vectorized) and returns the first L such that
  sparse < dense for L and every longer length scanned; None if sparse never wins.
  """
  c, ic = config, config.indexer
  h, n, r, v, a = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                   c.kv_lora_rank)
  lengths = np.arange(1, max_length + 1, dtype=np.float64)
  pairs = lengths * (lengths + 1) / 2
  k = float(ic.topk)
  topk_pairs = np.where(lengths <= k, pairs, k * (k + 1) / 2 + (lengths - k) * k)
  up = 2.0 * a * h * (n + v)
  dense = pairs * 2 * h * (n + r + v) + lengths * up
  sparse = topk_pairs * 2 * h * (a + r + a) + pairs * 2 * ic.num_heads * ic.head_dim
  if include_absorption:
    sparse = sparse + lengths * up
  dense_wins = np.flatnonzero(sparse >= dense)
  if dense_wins.size == 0:
    return 1
  last = int(dense_wins[-1])  # index of the last length where dense is not more expensive
  return int(lengths[last + 1]) if last + 1 < max_length else None


def measured_crossover(lengths: Sequence[int], dense: Sequence[float],
                       sparse: Sequence[float]) -> str:
  """A human-readable bracket of where a measured sparse/dense curve crosses."""
  lengths = list(lengths)
  cheaper = [s < d for d, s in zip(dense, sparse)]
  if all(cheaper):
    return f"sparse cheaper at every measured length (>= {lengths[0]})"
  if not any(cheaper):
    return f"dense cheaper at every measured length (<= {lengths[-1]})"
  last_dense = max(i for i, c in enumerate(cheaper) if not c)
  if last_dense + 1 < len(lengths) and all(cheaper[last_dense + 1:]):
    return f"between {lengths[last_dense]} and {lengths[last_dense + 1]}"
  return "no single crossover: " + ", ".join(
      f"{n}:{'sparse' if c else 'dense'}" for n, c in zip(lengths, cheaper))


# ---- one table row per length -------------------------------------------------------------

def measure_routes(layers: RouteLayers, lengths: Sequence[int], *, repeats: int = 5,
                   seed: int = 0, timing: bool = True) -> list[dict]:
  """Per length: XLA cost, analytic FLOPs and (optionally) median time of both routes."""
  rows = []
  for length in lengths:
    programs = {route: route_program(layers, route, length, seed=seed) for route in ROUTES}
    row = {"length": int(length)}
    for route, (fn, args) in programs.items():
      cost = cost_of(fn, *args)
      row[f"{route}_flops"] = cost["flops"]
      row[f"{route}_bytes"] = cost["bytes"]
      row[f"{route}_analytic"] = analytic_flops(layers.config, length, route)
      row[f"{route}_module"] = type(layers.for_route(route, length)).__name__ + (
          "" if layers.for_route(route, length).config.indexer else " (no indexer)")
    if timing:
      times = side_by_side({r: p[0] for r, p in programs.items()}, repeats,
                           setup={r: (lambda args=p[1]: args) for r, p in programs.items()})
      for route in ROUTES:
        row[f"{route}_s"] = times[route]
    rows.append(row)
  return rows


# ---- KV cache ------------------------------------------------------------------------------

def kv_cache_bytes_per_token(config: m.MLAConfig) -> dict[str, int]:
  """Bytes per token per layer of each cache layout (docs/design.md §7).

  mha_bf16:        per-head K [N+R] and V [V] for every head (what dense MHA would keep)
  latent_bf16:     [c_kv (A) | k_pe (R)] in bf16 (1152 B for DeepSeek-V3.2)
  latent_fp8:      ``fp8_ds_mla``: A e4m3 + one fp32 scale per 128 + R bf16 (656 B)
  indexer_bf16:    the indexer key, I bf16 values
  indexer_fp8:     I e4m3 + one fp32 scale (132 B for I = 128)
  """
  c = config
  out = {
      "mha_bf16": 2 * c.num_heads * (c.qk_head_dim + c.v_head_dim),
      "latent_bf16": 2 * c.latent_dim,
      "latent_fp8": c.kv_lora_rank + 4 * math.ceil(c.kv_lora_rank / 128) + 2 * c.qk_rope_head_dim,
  }
  if c.indexer is not None:
    out["indexer_bf16"] = 2 * c.indexer.head_dim
    out["indexer_fp8"] = c.indexer.head_dim + 4 * math.ceil(c.indexer.head_dim / 128)
  return out


def format_si(value: float, unit: str = "") -> str:
  """1.23e9 -> '1.23 G' (for tables)."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return "n/a"
  for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(value) >= factor:
      return f"{value / factor:.3g} {prefix}{unit}"
  return f"{value:.3g} {unit}".rstrip()
