"""The gated pooling compressor: one entry per ``m`` tokens, streamed a step at a time.

Entry ``w`` of a compressor without overlap (HCA, ``m' = 128``) pools tokens
``[w m, (w + 1) m)``:

    entry_w = norm( sum_j softmax_j(gate_j + bias_{j mod m}) * kv_j )     (per feature)

With overlap (CSA and its indexer, ``m = 4``) each token projects two series, Ca and Cb
(the two halves of a ``2 * width`` projection), and entry ``w`` pools window ``w - 1``'s Ca
with window ``w``'s Cb: 2m slots, stride m; window -1 has no tokens (softmax weight 0). The
entry is then rotated at position ``w m`` (the compress RoPE, on its last ``rope_dim``
features).

A step's rows need the projections of the tokens before them that no entry has used up yet:
the last ``m`` tokens' (``2m`` with overlap). They are the compressor's state (``pool_kv`` /
``pool_gate``), a ring per sequence whatever its length (position p in row p % R,
``mla_jax.v4.cache``), so a step costs O(T + m) and never reads the sequence again. With
R = 2m + k (k spare rows) a step may run k tokens past the position the next step starts
from, and none of what those tokens wrote is read (speculative decoding's rejected drafts).

A row whose position ends a window (``(p + 1) % m == 0``) computes that window's entry, from
this step's rows and the state read before it; at most ``rows / m + sequences`` rows of a
step do, so only that many candidates are pooled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.cache import scatter_part
from mla_jax.config import RopeConfig
from mla_jax.layers import Linear, RMSNorm
from mla_jax.rope import apply_rope
from mla_jax.v4.cache import StepGeometry


class Compressor(nnx.Module):
  """``kv_proj`` / ``gate_proj`` / ``position_bias`` / ``kv_norm`` as Hugging Face names them."""

  def __init__(self, hidden_size: int, width: int, ratio: int, *, overlap: bool, rope_dim: int,
               rope: RopeConfig, max_position: int, norm_eps: float, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    series = 2 if overlap else 1
    self.kv_proj = Linear(hidden_size, series * width, rngs=rngs, param_dtype=param_dtype)
    self.gate_proj = Linear(hidden_size, series * width, rngs=rngs, param_dtype=param_dtype)
    self.position_bias = nnx.Param(jnp.zeros((ratio, series * width), jnp.float32))
    self.kv_norm = RMSNorm(width, eps=norm_eps)
    self.width, self.ratio, self.overlap = width, ratio, overlap
    self.rope_dim, self.rope, self.max_position = rope_dim, rope, max_position

  @property
  def state_tokens(self) -> int:
    """Tokens of projections the state keeps: m, or 2m with overlap."""
    return self.ratio * (2 if self.overlap else 1)

  def init_state(self, slots: int, dtype, spare: int = 0):
    """Zero rings of the last ``state_tokens`` (+ ``spare``) tokens' projections."""
    shape = (slots, self.state_tokens + spare, self.kv_proj.weight.shape[0])
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

  def __call__(self, x_ND, pool_kv_SRX, pool_gate_SRX, geo: StepGeometry):
    """Entries of the windows that the step's rows (``x_ND``, at ``geo``'s positions) end.

    Returns ``(entries_JW, window_J, row_J, pool_kv, pool_gate)``: for J candidate rows, the
    entry of the window each ends (``window_J`` its index, -1 where the row ends none: its
    entry is garbage that no write keeps) and the rows' indices; then the state after the
    step.
    """
    # In the state's dtype (the cache's), so the state keeps its dtype from step to step.
    kv_NX = self.kv_proj(x_ND).astype(pool_kv_SRX.dtype)
    gate_NX = self.gate_proj(x_ND).astype(pool_gate_SRX.dtype)
    m, width, n = self.ratio, self.width, x_ND.shape[0]
    ends_N = geo.real_N & ((geo.pos_N + 1) % m == 0)
    num_candidates = min(n, n // m + geo.slot_S.shape[0])
    row_J = (jnp.arange(n, dtype=jnp.int32) if num_candidates == n else
             jnp.nonzero(ends_N, size=num_candidates, fill_value=0)[0].astype(jnp.int32))
    window_J = jnp.where(ends_N[row_J], (geo.pos_N[row_J] + 1) // m - 1, -1)
    pos_JM = window_J[:, None] * m + jnp.arange(m, dtype=jnp.int32)[None, :]
    ring = pool_kv_SRX.shape[1]
    flat = lambda pool: pool.reshape(-1, pool.shape[-1])
    bias_MX = self.position_bias[...]

    def slots(pos_JM, half: slice):
      step_JM, ring_JM = geo.sources(row_J, pos_JM, ring)
      pick = lambda new_NX, pool: jnp.where(
          (step_JM >= 0)[..., None], new_NX[jnp.maximum(step_JM, 0)],
          flat(pool)[jnp.maximum(ring_JM, 0)])[..., half].astype(jnp.float32)
      held = (step_JM >= 0) | (ring_JM >= 0)  # positions before 0 are in neither
      gate = pick(gate_NX, pool_gate_SRX) + bias_MX[:, half]
      return pick(kv_NX, pool_kv_SRX), jnp.where(held[..., None], gate, -jnp.inf)

    if self.overlap:
      kv_a, gate_a = slots(pos_JM - m, slice(0, width))  # Ca of the window before
      kv_b, gate_b = slots(pos_JM, slice(width, 2 * width))  # Cb of this window
      kv_JSW = jnp.concatenate([kv_a, kv_b], axis=1)
      gate_JSW = jnp.concatenate([gate_a, gate_b], axis=1)
    else:
      kv_JSW, gate_JSW = slots(pos_JM, slice(0, width))
    pooled_JW = jnp.sum(jax.nn.softmax(gate_JSW, axis=1) * kv_JSW, axis=1)
    entries_JW = self.kv_norm(pooled_JW)
    rope = apply_rope(entries_JW[:, width - self.rope_dim:], jnp.maximum(window_J, 0) * m,
                      self.rope, interleaved=True, max_position=self.max_position)
    entries_JW = jnp.concatenate([entries_JW[:, :width - self.rope_dim], rope], axis=-1)
    return (entries_JW.astype(x_ND.dtype), window_J, row_J,
            geo.state_after(pool_kv_SRX, kv_NX), geo.state_after(pool_gate_SRX, gate_NX))


def write_entries(pool_RW, new_JW, rows_J, keep_J):
  """``pool[rows_J] = new_JW`` where ``keep_J``, encoded in the pool's layout (a float array,
  or fp8 parts that all lead with the rows; in place under donation)."""
  rows_J = jnp.where(keep_J, rows_J, jax.tree.leaves(pool_RW)[0].shape[0])  # dropped
  return scatter_part(pool_RW, new_JW, rows_J)
