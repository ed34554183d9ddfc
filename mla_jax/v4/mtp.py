"""DeepSeek-V4's multi-token-prediction layer, as its release stores it (``mtp.{k}.*``) and
vLLM's ``deepseek_v4_mtp.py`` runs it.

MTP row p pairs the main model's residual streams at position p (before ``hc_head``: all
``hc_mult`` of them) with the embedding of the token at p + 1, and predicts the token at
p + 2 (one further per draft step, which feeds back the layer's own output streams):

    x_BTND = h_proj(hnorm(streams_BTND)) + e_proj(enorm(embed(t_{p+1})))[:, :, None]
    out    = block(x_BTND)                              # a sliding-window decoder layer
    logits = lm_head(norm(hc_head(out)))                # the layer's own hc_head and norm

- ``hnorm`` and ``h_proj`` act on each stream; the embedding's projection is added to every
  stream. The embedding is zero at position 0, as vLLM masks it there.
- ``block`` is a ``V4DecoderLayer`` with sliding-window attention (no compressor: vLLM gives
  the MTP layer compress ratio 1) and a learned-routing MoE (it gets no token ids to hash).
  Its cache is the window ring, addressed by position like every V4 cache's state.
- The embedding and the LM head are the main model's. A checkpoint's per-layer copies of them
  (``mtp.{k}.emb.*``, ``mtp.{k}.head.weight``, when present) are not read.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mla_jax.layers import Linear, RMSNorm
from mla_jax.v4.attention import CompressedSelection
from mla_jax.v4.cache import StepGeometry, V4LayerCache
from mla_jax.v4.config import SLIDING, V4Config
from mla_jax.v4.hyper import HyperHead

# vLLM gives the MTP layer compress ratio 1: its block attends to its sliding window only.
MTP_LAYER_TYPE = SLIDING


class V4MTPLayer(nnx.Module):
  """One MTP layer: ``enorm`` / ``hnorm`` / ``e_proj`` / ``h_proj``, the ``block`` (a
  ``V4DecoderLayer``), ``hc_head`` and ``norm``."""

  def __init__(self, config: V4Config, block: nnx.Module, *, rngs: nnx.Rngs, param_dtype):
    d, eps = config.hidden_size, config.rms_norm_eps
    self.enorm = RMSNorm(d, eps=eps)
    self.hnorm = RMSNorm(d, eps=eps)
    self.e_proj = Linear(d, d, rngs=rngs, param_dtype=param_dtype)
    self.h_proj = Linear(d, d, rngs=rngs, param_dtype=param_dtype)
    self.block = block
    self.hc_head = HyperHead(d, config.hc_mult, hc_eps=config.hc_eps, norm_eps=eps, rngs=rngs)
    self.norm = RMSNorm(d, eps=eps)

  def __call__(self, streams_BTND, next_ids_BT, embed_BTD, cache: V4LayerCache,
               geo: StepGeometry):
    """The output streams of a step's rows (at ``geo``'s positions) and the block's cache
    after.

    ``streams_BTND``: the main model's streams at those positions (or a draft step's output);
    ``embed_BTD``: the embedding of ``next_ids_BT``, the tokens one position later."""
    pos_BT = geo.pos_N.reshape(next_ids_BT.shape)
    embed_BTD = jnp.where((pos_BT == 0)[..., None], 0, embed_BTD)
    x_BTND = (self.h_proj(self.hnorm(streams_BTND.astype(embed_BTD.dtype)))
              + self.e_proj(self.enorm(embed_BTD))[:, :, None, :])
    # A sliding block: no compressed entries to select or read.
    return self.block(x_BTND, next_ids_BT, cache, geo, CompressedSelection.NONE, 1)

  def hidden(self, streams_XND):
    """What the LM head reads: the streams collapsed by ``hc_head``, then ``norm``."""
    return self.norm(self.hc_head(streams_XND))
