"""The gated pooling compressor: one entry per ``m`` tokens, streamed a step at a time.

Entry ``w`` of a compressor without overlap (HCA, ``m' = 128``) pools tokens
``[w m, (w + 1) m)``:

    entry_w = norm( sum_j softmax_j(gate_j + bias_{j mod m}) * kv_j )     (per feature)

With overlap (CSA and its indexer, ``m = 4``) each token projects two series, Ca and Cb
(the two halves of a ``2 * width`` projection), and entry ``w`` pools window ``w - 1``'s Ca
with window ``w``'s Cb: 2m slots, stride m; window -1 has no tokens (softmax weight 0). The
entry is then rotated at position ``w m`` (the compress RoPE, on its last ``rope_dim``
features).

A step of T new tokens needs the projections of the tokens before it that no entry has used
up yet: the last ``m`` tokens' (``2m`` with overlap). They are the compressor's state
(``pool_kv`` / ``pool_gate``), a fixed-size buffer whatever the sequence's length, so a step
costs O(T + m) and never reads the sequence again. The buffer is a ring addressed by position
(position p in slot p % R, ``ring_rows``), as the attention's window is: with R = 2m + k (k
spare rows) a step may run k tokens past the position the next step starts from, and none of
what those tokens wrote is read (speculative decoding's rejected drafts, ``mla_jax.v4.mtp``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.config import RopeConfig
from mla_jax.layers import Linear, RMSNorm
from mla_jax.rope import apply_rope


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

  def init_state(self, batch: int, dtype, spare: int = 0):
    """Zero rings of the last ``state_tokens`` (+ ``spare``) tokens' projections."""
    shape = (batch, self.state_tokens + spare, self.kv_proj.weight.shape[0])
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

  def __call__(self, x_BTD, pool_kv_BRX, pool_gate_BRX, start_B):
    """Entries of the windows that the T new tokens (at ``start_B + t``) complete.

    Returns ``(entries_BJW, window_BJ, pool_kv, pool_gate)``: J = ceil(T / m) candidate
    windows, ``window_BJ`` their entry index or -1 where the window is not complete by the
    end of the step (its row of ``entries`` is then garbage that no write keeps), and the
    state after the step.
    """
    # In the state's dtype (the cache's), so the state keeps its dtype from step to step.
    kv_BTX = self.kv_proj(x_BTD).astype(pool_kv_BRX.dtype)
    gate_BTX = self.gate_proj(x_BTD).astype(pool_gate_BRX.dtype)
    src_kv = jnp.concatenate([pool_kv_BRX, kv_BTX], axis=1)
    src_gate = jnp.concatenate([pool_gate_BRX, gate_BTX], axis=1)
    pool = functools.partial(self._pool, num_new=x_BTD.shape[1], ring=pool_kv_BRX.shape[1])
    entries, window = jax.vmap(pool)(src_kv, src_gate, start_B)
    return (entries.astype(x_BTD.dtype), window, write_ring(pool_kv_BRX, kv_BTX, start_B),
            write_ring(pool_gate_BRX, gate_BTX, start_B))

  def _pool(self, src_kv_SX, src_gate_SX, start, *, num_new: int, ring: int):
    m, width = self.ratio, self.width
    num_windows = -(-num_new // m)
    window_J = start // m + jnp.arange(num_windows, dtype=jnp.int32)
    complete_J = (window_J + 1) * m <= start + num_new
    pos_JM = window_J[:, None] * m + jnp.arange(m, dtype=jnp.int32)[None, :]
    bias_MX = self.position_bias[...]

    def slots(pos_JM, half: slice):
      # Positions before 0 are masked below, past the step are incomplete windows' (dropped).
      row_JM = jnp.clip(ring_rows(pos_JM, start, ring), 0, src_kv_SX.shape[0] - 1)
      kv = src_kv_SX[row_JM][..., half].astype(jnp.float32)
      gate = src_gate_SX[row_JM][..., half].astype(jnp.float32) + bias_MX[:, half]
      return kv, jnp.where((pos_JM >= 0)[..., None], gate, -jnp.inf)

    if self.overlap:
      kv_a, gate_a = slots(pos_JM - m, slice(0, width))  # Ca of the window before
      kv_b, gate_b = slots(pos_JM, slice(width, 2 * width))  # Cb of this window
      kv_JSW = jnp.concatenate([kv_a, kv_b], axis=1)
      gate_JSW = jnp.concatenate([gate_a, gate_b], axis=1)
    else:
      kv_JSW, gate_JSW = slots(pos_JM, slice(0, width))
    pooled_JW = jnp.sum(jax.nn.softmax(gate_JSW, axis=1) * kv_JSW, axis=1)
    entries_JW = self.kv_norm(pooled_JW)
    rope = apply_rope(entries_JW[:, width - self.rope_dim:], window_J * m, self.rope,
                      interleaved=True, max_position=self.max_position)
    entries_JW = jnp.concatenate([entries_JW[:, :width - self.rope_dim], rope], axis=-1)
    return entries_JW, jnp.where(complete_J, window_J, -1)


def ring_rows(pos, start, ring: int):
  """Row of position ``pos`` in ``[ring (R rows, position p in slot p % R) | a step's rows
  from position start]``."""
  return jnp.where(pos >= start, ring + pos - start, pos % ring)


def write_ring(ring_BRX, new_BTX, start_B):
  """The ring after a step of T rows from ``start_B``: its last ``min(T, R)`` rows in slots
  ``pos % R`` (in the ring's dtype)."""
  size, num_new = ring_BRX.shape[1], new_BTX.shape[1]
  kept = min(num_new, size)
  pos_BK = start_B[:, None] + jnp.arange(num_new - kept, num_new, dtype=jnp.int32)
  batch_BK = jnp.broadcast_to(jnp.arange(ring_BRX.shape[0])[:, None], pos_BK.shape)
  return ring_BRX.at[batch_BK, pos_BK % size].set(new_BTX[:, num_new - kept:].astype(
      ring_BRX.dtype))


def write_entries(entries_BCW, new_BJW, window_BJ):
  """``entries[b, window[b, j]] = new[b, j]`` where ``window >= 0``, in place under donation."""
  capacity = entries_BCW.shape[1]
  rows_BJ = jnp.where(window_BJ >= 0, window_BJ, capacity)  # out of range: dropped
  batch_BJ = jnp.broadcast_to(jnp.arange(rows_BJ.shape[0])[:, None], rows_BJ.shape)
  return entries_BCW.at[batch_BJ, rows_BJ].set(new_BJW.astype(entries_BCW.dtype), mode="drop")
