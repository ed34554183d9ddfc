"""DeepSeek mixture of experts: sigmoid router, group-limited top-k, stacked routed experts.

The routed experts are stored stacked (``experts.gate_proj`` / ``up_proj`` [E, F, D],
``experts.down_proj`` [E, D, F]) and computed as a grouped matmul: token-expert pairs are
sorted by expert, each expert multiplies only the rows routed to it, the rows are unsorted
and combined with the router weights. Nothing is dropped, so the result is exact, and the
work grows with tokens x top-k rather than with the number of experts. Checkpoints keep
Hugging Face's per-expert keys (``mlp.experts.{e}.gate_proj.weight``); the mapping lives in
``mla_jax.models.hf_layout``.

Under a mesh the experts are split over the ``expert`` axis (and their intermediate width
over ``tensor``): each shard runs its local experts on the pairs routed to them and a
``psum`` adds the partial outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import quant, sharding
from mla_jax.models.config import MoEConfig
from mla_jax.models.mlp import MLP, swiglu
from mla_jax.sharding import EXPERT

GROUPED_MATMULS = ("auto", "ragged_dot", "tiled")


def resolve_grouped_matmul(name: str) -> str:
  """The MoE's grouped matmul: ``"ragged_dot"`` (XLA's grouped GEMM) or ``"tiled"`` (row
  tiles; its cost follows the routed rows on XLA:CPU, which expands ``ragged_dot`` over every
  expert). ``"auto"`` picks ``tiled`` on CPU and ``ragged_dot`` elsewhere."""
  if name not in GROUPED_MATMULS:
    raise ValueError(f"grouped_matmul must be one of {GROUPED_MATMULS}, got {name!r}")
  if name == "auto":
    return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
  return name


def route_tokens(logits_TE, bias_E, config: MoEConfig):
  """Chosen experts ``idx_TK`` (int32) and their combine weights ``weights_TK`` (fp32).

  Selection ranks ``sigmoid(logits) + bias``; the weights use the unbiased sigmoid scores.
  Ties go to the lower index, both among groups and among experts (``lax.top_k``).
  """
  num_tokens, num_experts = logits_TE.shape
  per_group = num_experts // config.n_group
  scores_TE = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
  select_TE = scores_TE + bias_E.astype(jnp.float32)

  if config.topk_group < config.n_group:
    select_TGE = select_TE.reshape(num_tokens, config.n_group, per_group)
    group_score_TG = jax.lax.top_k(select_TGE, min(2, per_group))[0].sum(-1)
    _, top_groups = jax.lax.top_k(group_score_TG, config.topk_group)  # [T, topk_group]
    kept_TG = jnp.zeros((num_tokens, config.n_group), bool)
    kept_TG = kept_TG.at[jnp.arange(num_tokens)[:, None], top_groups].set(True)
    # -inf, as in the DeepSeek reference: HF's 0.0 fill lets a dropped group win whenever the
    # biased scores in the kept groups are negative.
    select_TE = jnp.where(jnp.repeat(kept_TG, per_group, axis=1), select_TE, -jnp.inf)

  _, idx_TK = jax.lax.top_k(select_TE, config.num_experts_per_tok)
  weights_TK = jnp.take_along_axis(scores_TE, idx_TK, axis=-1)
  if config.norm_topk_prob:
    weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
  return idx_TK.astype(jnp.int32), weights_TK * config.routed_scaling_factor


class TopkRouter(nnx.Module):
  """Router logits in fp32 (weight and bias stay fp32 whatever the model dtype)."""

  def __init__(self, hidden_size: int, config: MoEConfig, *, rngs: nnx.Rngs):
    init = jax.random.normal(rngs.params(), (config.num_experts, hidden_size), jnp.float32)
    self.weight = nnx.Param(init * hidden_size**-0.5)
    # Zero until a checkpoint supplies the trained load-balancing bias.
    self.e_score_correction_bias = nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))
    self.config = config

  def __call__(self, x_TD):
    logits_TE = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), self.weight[...],
                           preferred_element_type=jnp.float32)
    return route_tokens(logits_TE, self.e_score_correction_bias[...], self.config)


class StackedExperts(nnx.Module):
  """The routed experts' SwiGLU weights, one leading expert axis per matrix ([out, in] each).

  A loaded fp8 checkpoint replaces each matrix by a ``quant.BlockScaledWeight`` of the same
  shape (values and per-expert block scales), which ``MoE`` passes on undequantized.
  """

  block_scalable = ("gate_proj", "up_proj", "down_proj")

  def __init__(self, hidden_size: int, config: MoEConfig, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    e, f, d = config.num_experts, config.moe_intermediate_size, hidden_size

    def init(shape, fan_in):
      value = jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5
      return nnx.Param(value.astype(param_dtype))

    self.gate_proj = init((e, f, d), d)
    self.up_proj = init((e, f, d), d)
    self.down_proj = init((e, d, f), f)


def _contract_last(lhs_MX, rhs_GYX, group_sizes_G, impl: str):
  """Row m of ``lhs`` times ``rhs[g]^T`` for the group g its (sorted) row falls in: [M, Y].

  Rows past ``sum(group_sizes)`` give 0. ``impl`` picks the grouped matmul: ``"ragged_dot"``
  is XLA's (a grouped GEMM where the platform has one; XLA:CPU expands it over every group),
  ``"tiled"`` pads each group to a multiple of a row tile and runs one small matmul per tile,
  so its cost follows the number of rows, not the number of groups. ``rhs`` may be a
  ``quant.BlockScaledArray``: it is dequantized per expert inside the program (``tiled``
  dequantizes only the experts its row tiles gather).
  """
  if impl == "ragged_dot":
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs_MX, quant.as_operand(rhs_GYX, lhs_MX.dtype),
                                      group_sizes_G, dims, preferred_element_type=jnp.float32)
  return _tiled_grouped_matmul(lhs_MX, rhs_GYX, group_sizes_G)


_TILES_PER_STEP = 8  # benchmarks/scale.py measured 4-9x faster than one batched gather


def tile_plan(m_rows: int, num_groups: int) -> tuple[int, int]:
  """(rows per tile, number of tiles) of the tiled grouped matmul for M rows, G groups."""
  used = min(num_groups, m_rows)
  tile = 1 << max((m_rows // used).bit_length() - 1, 0)
  return tile, (m_rows + used * (tile - 1)) // tile


def _tiled_grouped_matmul(lhs_MX, rhs_GYX, group_sizes_G):
  """The ``"tiled"`` grouped matmul: rows grouped into tiles of ``m`` that share one group.

  A group of n rows fills ``ceil(n / m)`` tiles, so at most ``(M + min(G, M) * (m - 1)) / m``
  tiles exist. With ``m = M // min(G, M)`` rounded down to a power of two that is under
  ``2 M / m`` tiles: at most 2M rows multiplied and ``2 min(G, M)`` weight matrices read,
  bounded by the routed rows (tokens x top-k) whatever G is. (Every implementation reads the
  weights of each expert it uses; with more experts than routed rows, that is the rows.)
  """
  (m_rows, _), num_groups = lhs_MX.shape, rhs_GYX.shape[0]
  tile, num_tiles = tile_plan(m_rows, num_groups)
  tiles_G = -(-group_sizes_G // tile)
  tile_start_G = jnp.cumsum(tiles_G) - tiles_G
  row_start_G = jnp.cumsum(group_sizes_G) - group_sizes_G
  rows_M = jnp.arange(m_rows, dtype=jnp.int32)
  # Sorted rows: the group of row r is the last group starting at or before it.
  group_M = jnp.searchsorted(row_start_G + group_sizes_G, rows_M, side="right")
  in_group_M = group_M < num_groups
  group_M = jnp.minimum(group_M, num_groups - 1)
  slot_M = tile_start_G[group_M] * tile + rows_M - row_start_G[group_M]
  slot_M = jnp.where(in_group_M, slot_M, num_tiles * tile)  # dropped by the scatter below
  padded_RX = jnp.zeros((num_tiles * tile, lhs_MX.shape[1]), lhs_MX.dtype)
  padded_RX = padded_RX.at[slot_M].set(lhs_MX, mode="drop")
  tile_group_N = jnp.searchsorted(tile_start_G + tiles_G, jnp.arange(num_tiles), side="right")
  tile_group_N = jnp.minimum(tile_group_N, num_groups - 1)

  def tile_matmul(args):
    x_mX, group = args
    weights_YX = quant.as_operand(quant.take(rhs_GYX, group), lhs_MX.dtype)
    return jnp.einsum("mx,yx->my", x_mX, weights_YX, preferred_element_type=jnp.float32)

  # A few tiles per iteration: gathering every tile's weights at once would write a copy of
  # up to 2 min(G, M) weight matrices, which costs more than the matmuls on a CPU.
  out_NmY = jax.lax.map(tile_matmul, (padded_RX.reshape(num_tiles, tile, -1), tile_group_N),
                        batch_size=_TILES_PER_STEP)
  out_RY = out_NmY.reshape(num_tiles * tile, -1)
  return jnp.where(in_group_M[:, None], out_RY[jnp.minimum(slot_M, num_tiles * tile - 1)], 0.0)


def routed_experts(x_TD, idx_TK, weights_TK, gate_EFD, up_EFD, down_EDF, *, first_expert=0,
                   impl: str = "ragged_dot", swiglu_limit: float | None = None):
  """``sum_k weights[t, k] * expert_{idx[t, k]}(x[t])`` over the experts held here: [T, D] f32.

  ``gate/up/down`` hold experts ``first_expert .. first_expert + E_local - 1`` (arrays or
  ``quant.BlockScaledArray``s); pairs routed to other experts contribute 0 (another shard adds
  them). Pairs are sorted by expert (stable,
  so a token's pairs keep their order), multiplied group by group, then scattered back.
  """
  num_tokens, top = idx_TK.shape
  num_local = gate_EFD.shape[0]
  local_P = idx_TK.reshape(-1) - first_expert
  held_P = (local_P >= 0) & (local_P < num_local)
  # Pairs held elsewhere sort last, as an extra group that no matmul reads.
  group_P = jnp.where(held_P, local_P, num_local)
  order_P = jnp.argsort(group_P, stable=True)
  token_P = order_P // top
  group_sizes_G = jnp.bincount(group_P, length=num_local + 1)[:num_local].astype(jnp.int32)
  dtype = x_TD.dtype
  x_PD = x_TD[token_P]
  gate_PF = _contract_last(x_PD, gate_EFD, group_sizes_G, impl)
  up_PF = _contract_last(x_PD, up_EFD, group_sizes_G, impl)
  h_PF = swiglu(gate_PF, up_PF, swiglu_limit).astype(dtype)
  out_PD = _contract_last(h_PF, down_EDF, group_sizes_G, impl)
  weight_P = jnp.where(held_P, weights_TK.reshape(-1), 0.0)[order_P]
  # where, not a multiply: a pair held elsewhere must add exactly nothing here.
  out_PD = jnp.where(weight_P[:, None] != 0, out_PD * weight_P[:, None], 0.0)
  return jnp.zeros((num_tokens, x_TD.shape[1]), jnp.float32).at[token_P].add(out_PD)


class MoE(nnx.Module):
  """Routed experts (grouped matmul) plus optional shared experts."""

  def __init__(self, hidden_size: int, config: MoEConfig, *, rngs: nnx.Rngs,
               grouped_matmul: str = "auto", mesh=None, param_dtype=jnp.float32):
    self.gate = TopkRouter(hidden_size, config, rngs=rngs)
    self.experts = StackedExperts(hidden_size, config, rngs=rngs, param_dtype=param_dtype)
    self.shared_experts = (
        MLP(hidden_size, config.moe_intermediate_size * config.n_shared_experts, rngs=rngs,
            param_dtype=param_dtype) if config.n_shared_experts else None)
    self.grouped_matmul = resolve_grouped_matmul(grouped_matmul)
    self.mesh = mesh
    self.swiglu_limit = None  # DeepSeek-V4's clipped SwiGLU sets it (mla_jax.v4.moe)

  def _routed(self, x_TD, idx_TK, weights_TK):
    experts, impl, mesh, limit = (self.experts, self.grouped_matmul, self.mesh,
                                  self.swiglu_limit)
    weights = tuple(quant.weight_operand(w)
                    for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
    if mesh is None:
      return routed_experts(x_TD, idx_TK, weights_TK, *weights, impl=impl, swiglu_limit=limit)

    def local(x_TD, idx_TK, weights_TK, gate_EFD, up_EFD, down_EDF):
      first = jax.lax.axis_index(EXPERT) * gate_EFD.shape[0]
      out_TD = routed_experts(x_TD, idx_TK, weights_TK, gate_EFD, up_EFD, down_EDF,
                              first_expert=first, impl=impl, swiglu_limit=limit)
      return jax.lax.psum(out_TD, sharding.MOE_SUM_AXES)

    tokens = sharding.MOE_TOKENS_SPEC
    in_specs = (tokens, tokens, tokens, sharding.MOE_IN_PROJ_SPEC, sharding.MOE_IN_PROJ_SPEC,
                sharding.MOE_OUT_PROJ_SPEC)
    return sharding.shard_map(local, mesh, in_specs, tokens)(x_TD, idx_TK, weights_TK,
                                                              *weights)

  def __call__(self, x_BTD):
    dtype = x_BTD.dtype
    x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
    idx_TK, weights_TK = self.gate(x_TD)
    out_TD = self._routed(x_TD, idx_TK, weights_TK)
    if self.shared_experts is not None:
      out_TD = out_TD + self.shared_experts(x_TD).astype(jnp.float32)
    return out_TD.astype(dtype).reshape(x_BTD.shape)
