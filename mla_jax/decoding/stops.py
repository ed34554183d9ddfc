"""Where a sequence stops: at a stop id or at its last allowed token, written once in a device
form (``ends``: the one device decode loop, ``decoding.steps``) and a host form
(``stop_reason``: ``generate`` after its prefill, the engine and its scheduler). Stop strings are
matched on the host, after a dispatch (``decoding.text``); constraints in the engine."""

from __future__ import annotations

from collections.abc import Collection

import jax
import jax.numpy as jnp

STOP, LENGTH = "stop", "length"  # the finish reasons, as OpenAI names them


def is_stop(tokens_X, stop_ids_XM):
  """Whether each token is one of its row's stop ids (``stop_ids_XM`` broadcasts against
  ``tokens_X[..., None]``; -1 pads it)."""
  return (tokens_X[..., None] == stop_ids_XM).any(axis=-1)


def ends(token_B, stop_ids_BM, emitted_B, max_tokens_B):
  """Whether a sequence ends with the token it just emitted, its ``emitted_B``-th: a stop id,
  or its last allowed token."""
  return is_stop(token_B, stop_ids_BM) | (emitted_B >= max_tokens_B)


def stop_ids_of(eos_id) -> jax.Array:
  """``generate``'s end-of-sequence ids (an id, a list of them, or None) as ``ends`` takes
  them: [M] int32, empty for None."""
  return jnp.asarray(() if eos_id is None else eos_id, jnp.int32).reshape(-1)


def stop_reason(token: int | None, stop_ids: Collection[int], emitted: int,
                max_tokens: int) -> str | None:
  """``ends`` on the host, with the reason: ``STOP`` when ``token`` (a sequence's
  ``emitted``-th; None before its first) is one of its stop ids, ``LENGTH`` when it was its
  last allowed token, else None."""
  if token is not None and token in stop_ids:
    return STOP
  return LENGTH if emitted >= max_tokens else None
