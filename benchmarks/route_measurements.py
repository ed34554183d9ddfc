"""Measurements shared by ``benchmarks/routes.py`` and ``notebooks/compare_routes.ipynb``.

Three prefill routes of one MLA layer with the same weights:

* ``dense_mha``  - ``MLAAttention``: decompress per-head K/V, causal attention (docs/design.md §2).
  The library takes this route only while ``length <= index_topk`` (there it is exact). Past
  top-k we measure the same module built without an indexer (dense causal MLA, DeepSeek-V3
  style), which is what "dense attention" costs at that length;
* ``masked_mha`` - ``MLAAttention`` past top-k: indexer top-k, then the MHA form over the causal
  keys, each query masked to its top-k set (§6). Its backend's ``masked_mha_max_tokens`` is
  opened to every length here, so the masked route is measured past its own threshold too
  (that is how the threshold is found); at ``length <= index_topk`` it does not exist;
* ``sparse_mqa`` - ``DeepseekV32Attention``: indexer top-k, absorbed MQA over those rows (5.2).

``route_program`` checks the traced scopes, so a row is never labelled with a route it did not
run. Everything here is a plain function of (config, length); nothing is cached across calls
except the jitted programs that ``layer_program`` builds.
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

ROUTES = ("dense_mha", "masked_mha", "sparse_mqa")
_ROUTE_SCOPES = {route: PrefillRoute(route).scope for route in ROUTES}
_OPEN_WINDOW = 1 << 30  # masked_mha_max_tokens above any measured length


# ---- the layers ---------------------------------------------------------------------------

@dataclasses.dataclass
class RouteLayers:
  """Three modules sharing one set of random weights (the indexer-free one lacks the indexer)."""

  config: m.MLAConfig
  dense: m.MLAAttention               # dense-capable: DENSE_MHA while length <= topk, then
                                      # MASKED_MHA (its backend's masked window is open)
  sparse: m.DeepseekV32Attention      # MQA-only: always indexer + SPARSE_MQA
  dense_causal: m.MLAAttention        # no indexer: DENSE_MHA at every length

  def has_route(self, route: str, length: int) -> bool:
    """Whether a fresh prefill of ``length`` tokens can take ``route`` (masked: past top-k)."""
    if route not in ROUTES:
      raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    return route != "masked_mha" or length > self.config.indexer.topk

  def for_route(self, route: str, length: int):
    """The module that runs ``route`` for a fresh prefill of ``length`` tokens."""
    if not self.has_route(route, length):
      raise ValueError(f"no masked route at length {length} <= top-k {self.config.indexer.topk}")
    if route == "sparse_mqa":
      return self.sparse
    if route == "masked_mha" or length <= self.config.indexer.topk:
      return self.dense
    return self.dense_causal


def without_indexer(layer: m.MLAAttention) -> m.MLAAttention:
  """An indexer-free ``MLAAttention`` with ``layer``'s other weights: dense causal MLA."""
  config = dataclasses.replace(layer.config, indexer=None)
  copy = m.MLAAttention(config, rngs=nnx.Rngs(0), backend=layer.backend)
  set_flat_params(copy, {k: v for k, v in flat_params(layer).items()
                         if not k.startswith("indexer.")})
  return copy


def build_route_layers(config: m.MLAConfig, backend=None, seed: int = 0) -> RouteLayers:
  """``MLAAttention``, ``DeepseekV32Attention`` and an indexer-free ``MLAAttention``, same weights.

  ``backend`` (default ``XlaBackend()``) gets its masked window opened to every length.
  """
  if config.indexer is None:
    raise ValueError("route comparisons need a config with an indexer")
  backend = dataclasses.replace(backend or m.XlaBackend(), masked_mha_max_tokens=_OPEN_WINDOW)
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
  traced = {r for r, scope in _ROUTE_SCOPES.items() if scope in summarize(fn, *args).scopes}
  if traced != {route}:
    raise AssertionError(f"{type(layer).__name__} at length {length} traced {sorted(traced)}, "
                         f"not {route}")
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


def _causal_pairs(length):
  return length * (length + 1) // 2


def _topk_pairs(length, topk: int):
  """sum over t < length of min(t + 1, topk) (scalars or NumPy arrays)."""
  return np.where(length <= topk, _causal_pairs(length),
                  _causal_pairs(topk) + (length - topk) * topk)


def _analytic(config: m.MLAConfig, length, route: str, include_absorption: bool):
  """The cost model of :func:`analytic_flops`, on a scalar or an array of lengths."""
  c = config
  h, n, r, v, a = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                   c.kv_lora_rank)
  up_projection = 2 * a * h * (n + v)
  mha = _causal_pairs(length) * 2 * h * (n + r + v) + length * up_projection
  if route == "dense_mha":
    return mha
  if route not in ROUTES:
    raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
  ic = c.indexer
  if ic is None:
    raise ValueError(f"{route} needs a config with an indexer")
  scores = _causal_pairs(length) * 2 * ic.num_heads * ic.head_dim
  if route == "masked_mha":
    return mha + scores
  sparse = _topk_pairs(length, ic.topk) * 2 * h * ((a + r) + a) + scores
  return sparse + length * up_projection if include_absorption else sparse


def analytic_flops(config: m.MLAConfig, length: int, route: str, *,
                   include_absorption: bool = False) -> float:
  """Attention FLOPs of a fresh causal prefill of ``length`` tokens (docs/design.md §2 cost model).

  dense_mha:  L(L+1)/2 pairs x 2H(N+R+V)  +  L x 2AH(N+V) (K/V up-projection per key)
  masked_mha: dense_mha  +  L(L+1)/2 x 2GI (indexer scores): every causal pair is computed
              and the unselected ones masked out
  sparse_mqa: sum_t min(t+1, K) pairs x 2H((A+R) + A)  +  L(L+1)/2 x 2GI (indexer scores)

  That model leaves out the MQA form's absorption (W_UK into q, W_UV on the output),
  2AH(N+V) per *query* token, which in a prefill equals the dense up-projection per *key*.
  ``include_absorption=True`` adds it to the sparse route.
  """
  return float(_analytic(config, length, route, include_absorption))


def analytic_crossover(config: m.MLAConfig, *, mha_route: str = "dense_mha",
                       include_absorption: bool = False, max_length: int = 1 << 22) -> int | None:
  """The shortest prompt from which on sparse MQA needs fewer analytic FLOPs than ``mha_route``.

  Scans every length up to ``max_length`` (vectorized) and returns the first L such that
  sparse < mha for L and every longer length scanned; None if sparse never wins. For
  ``masked_mha`` only lengths past top-k count (the route does not exist below it), and the
  indexer's scores cancel: both routes score every causal pair.
  """
  if config.indexer is None:
    raise ValueError("a crossover with sparse MQA needs a config with an indexer")
  first = config.indexer.topk + 1 if mha_route == "masked_mha" else 1
  lengths = np.arange(first, max_length + 1, dtype=np.float64)
  sparse = _analytic(config, lengths, "sparse_mqa", include_absorption)
  mha_wins = np.flatnonzero(sparse >= _analytic(config, lengths, mha_route, include_absorption))
  if mha_wins.size == 0:
    return first
  last = int(mha_wins[-1])  # index of the last length where the MHA form is not costlier
  return int(lengths[last + 1]) if last + 1 < lengths.size else None


def kernel_estimate_crossover(config: m.MLAConfig) -> int:
  """The shortest fresh prefill from which sparse MQA's declared kernel FLOPs fall below the
  masked kernel's: ``sparse_mqa_attention`` declares T*K slots at 2H(L + A), ``masked_mha_prefill``
  every causal pair at 2H(Q + V) (the indexer kernel is the same on both routes), so sparse is
  cheaper once T + 1 > 2K(L + A)/(Q + V). ``PallasTritonBackend.masked_mha_max_tokens`` comes
  from this (docs/design.md §6)."""
  c = config
  per_slot, per_pair = c.latent_dim + c.kv_lora_rank, c.qk_head_dim + c.v_head_dim
  return 2 * c.indexer.topk * per_slot // per_pair


def measured_crossover(lengths: Sequence[int], mha: Sequence[float], sparse: Sequence[float],
                       mha_label: str = "dense") -> str:
  """A human-readable bracket of where a measured sparse/MHA curve crosses (NaN: no point)."""
  points = [(n, s < d) for n, d, s in zip(lengths, mha, sparse)
            if not (math.isnan(d) or math.isnan(s))]
  if not points:
    return "no measured length has both routes"
  lengths, cheaper = [n for n, _ in points], [c for _, c in points]
  if all(cheaper):
    return f"sparse cheaper at every measured length (>= {lengths[0]})"
  if not any(cheaper):
    return f"{mha_label} cheaper at every measured length (<= {lengths[-1]})"
  last_mha = max(i for i, c in enumerate(cheaper) if not c)
  if last_mha + 1 < len(lengths) and all(cheaper[last_mha + 1:]):
    return f"between {lengths[last_mha]} and {lengths[last_mha + 1]}"
  return "no single crossover: " + ", ".join(
      f"{n}:{'sparse' if c else mha_label}" for n, c in zip(lengths, cheaper))


# ---- one table row per length -------------------------------------------------------------

def measure_routes(layers: RouteLayers, lengths: Sequence[int], *, repeats: int = 5,
                   seed: int = 0, timing: bool = True) -> list[dict]:
  """Per length: XLA cost, analytic FLOPs and (optionally) median time of every route that
  exists at that length; a route that does not (masked at L <= top-k) gets NaN and module None."""
  rows = []
  for length in lengths:
    routes = [r for r in ROUTES if layers.has_route(r, length)]
    programs = {route: route_program(layers, route, length, seed=seed) for route in routes}
    row = {"length": int(length)}
    for route in ROUTES:
      for key in ("flops", "bytes", "analytic", "s"):
        row[f"{route}_{key}"] = math.nan
      row[f"{route}_module"] = None
    for route, (fn, args) in programs.items():
      cost = cost_of(fn, *args)
      layer = layers.for_route(route, length)
      row[f"{route}_flops"] = cost["flops"]
      row[f"{route}_bytes"] = cost["bytes"]
      row[f"{route}_analytic"] = analytic_flops(layers.config, length, route)
      row[f"{route}_module"] = type(layer).__name__ + ("" if layer.config.indexer else
                                                      " (no indexer)")
    if timing:
      times = side_by_side({r: p[0] for r, p in programs.items()}, repeats,
                           setup={r: (lambda args=p[1]: args) for r, p in programs.items()})
      for route, seconds in times.items():
        row[f"{route}_s"] = seconds
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
