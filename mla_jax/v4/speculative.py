"""Speculative decoding for DeepSeek-V4 with its MTP layers, through the shared machinery.

``mla_jax.generation.speculative`` drafts with the MTP layers, verifies the drafts in one main
step, accepts them (greedy: the longest prefix equal to the main model's argmax; sampled:
rejection sampling) and rolls the caches back to the accepted tokens. It calls the model and
its caches as V3.2's: ``model(ids, caches, new_lens_B=..., plan=..., return_hidden=True)``,
``model.mtp_forward`` / ``mtp_logits``, and caches that know their next row
(``num_cached_B``). ``SpeculativeView`` and ``PositionalCaches`` give V4 that shape.

Rolling back costs nothing: every V4 cache is addressed by position (the window and the
compressors' state are rings, position p in slot p % R; compressed entries sit at their
window's index), so a rollback only moves where the next step starts. With ``spare`` = k
ring slots (``init_cache(..., spare=k)``) the k positions a verification writes past the
accepted tokens are never read: a query at p reads the window p - W + 1 .. p and the
compressor the 2m positions before a step, all written by accepted tokens; the entries of
windows the rejected tokens completed are invisible until real tokens complete and rewrite
them. The MTP hidden state is the main model's residual streams [B, N, D] (before
``hc_head``), as vLLM's V4 proposer hands them over.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from mla_jax.v4.model import V4CausalLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PositionalCaches:
  """V4 caches (a model's, or one MTP layer's) and each sequence's next position."""

  layers: list | dict
  num_cached_B: jax.Array  # int32: positions 0 .. num_cached_B - 1 are the sequence's

  def with_num_cached(self, num_cached_B) -> PositionalCaches:
    return dataclasses.replace(self, num_cached_B=num_cached_B)


class Width(NamedTuple):
  """What the shared iteration reads of a step plan: its tokens (k + 1 for a verification)."""

  num_new_tokens: int


class _MtpCount(NamedTuple):
  num_mtp_layers: int


class SpeculativeView:
  """A ``V4CausalLM`` called as ``mla_jax.generation.speculative`` calls a model.

  Every step writes all its T rows from the caches' ``num_cached_B`` (a row past a sequence's
  ``new_lens_B`` is a position later steps overwrite) and advances it by ``new_lens_B``."""

  def __init__(self, model: V4CausalLM):
    self.model = model
    self.config = _MtpCount(model.config.num_mtp_layers)

  def __call__(self, ids_BT, caches: PositionalCaches, *, new_lens_B, plan=None,
               return_hidden: bool = True):
    logits, layers, streams = self.model(ids_BT, caches.layers, caches.num_cached_B,
                                         return_hidden=True)
    caches = PositionalCaches(layers, caches.num_cached_B + new_lens_B)
    return (logits, caches, streams) if return_hidden else (logits, caches)

  def mtp_forward(self, index: int, hidden_BTND, next_ids_BT, mtp_caches: tuple, *, new_lens_B,
                  plan=None, logits: bool = True):
    start_B = mtp_caches[index].num_cached_B
    out_logits, out, layers = self.model.mtp_forward(
        index, hidden_BTND, next_ids_BT, [c.layers for c in mtp_caches], start_B, logits=logits)
    cache = PositionalCaches(layers[index], start_B + new_lens_B)
    return out_logits, out, mtp_caches[:index] + (cache,) + mtp_caches[index + 1:]

  def mtp_logits(self, index: int, hidden_XND):
    return self.model.mtp_logits(index, hidden_XND)
