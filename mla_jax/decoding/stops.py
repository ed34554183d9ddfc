"""Where a sequence stops on the device: at a stop id or at its last allowed token. ``generate``'s
decode programs and the engine's multi-step dispatches both use it (stop strings are matched
on the host, after a dispatch: ``decoding.text``)."""

from __future__ import annotations


def is_stop(tokens_X, stop_ids_XM):
  """Whether each token is one of its row's stop ids (``stop_ids_XM`` broadcasts against
  ``tokens_X[..., None]``; -1 pads it)."""
  return (tokens_X[..., None] == stop_ids_XM).any(axis=-1)


def ends(token_B, stop_ids_BM, emitted_B, max_tokens_B):
  """Whether a sequence ends with the token it just emitted, its ``emitted_B``-th: a stop id,
  or its last allowed token."""
  return is_stop(token_B, stop_ids_BM) | (emitted_B >= max_tokens_B)
