"""The one device decode loop: ``count`` decode steps in one program (one dispatch), as a
fixed-length ``lax.scan``. No loop or branch in it waits on a value of the device: XLA:GPU
would copy such a predicate to the host and block on it, every iteration.

``generate``'s decode and speculative programs and the engine's multi-step dispatches each
write only their one step (contiguous caches or paged pools; one sampled token, or a verified
run of drafts); this loop owns what they share: which sequences are still active, how many
tokens each has emitted, the stop rule (``stops.ends``) and which tokens are emitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mla_jax.decoding.stops import ends


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Progress:
  """Where each sequence of a decode stands."""

  active_B: jax.Array  # bool: has not ended (a stop id or its last allowed token)
  emitted_B: jax.Array  # int32: tokens it has emitted, the count the stop rule's length reads

  @classmethod
  def start(cls, active_B, emitted_B) -> Progress:
    active_B = jnp.asarray(active_B, bool)
    return cls(active_B, jnp.broadcast_to(jnp.asarray(emitted_B, jnp.int32), active_B.shape))


def emit(progress: Progress, tokens_BK, valid_B, stop_ids, max_tokens):
  """One step's tokens under the stop rule: of each active sequence's first ``valid_B``
  candidates ``tokens_BK``, those up to and including its first end (``stops.ends``: one of
  ``stop_ids``, [M] or per sequence [B, M], or its ``max_tokens``-th token, a scalar or [B]).
  Returns the progress after the step and the emitted tokens [B, K] (-1 where none)."""
  t_K = jnp.arange(tokens_BK.shape[1], dtype=jnp.int32)
  keep_BK = progress.active_B[:, None] & (t_K < valid_B[:, None])
  end_BK = keep_BK & ends(tokens_BK, jnp.asarray(stop_ids)[..., None, :],
                          progress.emitted_B[:, None] + t_K + 1,
                          jnp.asarray(max_tokens)[..., None])
  keep_BK = keep_BK & (jnp.cumsum(end_BK, axis=1) - end_BK == 0)  # nothing after an end
  progress = Progress(progress.active_B & ~end_BK.any(axis=1),
                      progress.emitted_B + keep_BK.sum(axis=1, dtype=jnp.int32))
  return progress, jnp.where(keep_BK, tokens_BK, -1)


Step = Callable[[object, Progress, jax.Array], tuple]


def decode_steps(step: Step, carry, progress: Progress, count: int, *, stop_ids, max_tokens):
  """``count`` decode steps. ``step(carry, progress, i) -> (carry, tokens_BK, valid_B,
  extra)`` runs step i (0-based) for the active sequences (the others must write nothing and
  keep their carry): K candidate tokens per sequence, the first ``valid_B`` of them real, and
  anything it keeps per step (``extra``, a pytree or None). Returns ``(carry, progress,
  emitted_NBK, extra_N)``: the tokens each step emitted (``emit``), -1 where none."""

  def body(state, i):
    carry, progress = state
    carry, tokens_BK, valid_B, extra = step(carry, progress, i)
    progress, emitted_BK = emit(progress, tokens_BK, valid_B, stop_ids, max_tokens)
    return (carry, progress), (emitted_BK, extra)

  (carry, progress), (emitted_NBK, extra_N) = jax.lax.scan(
      body, (carry, progress), jnp.arange(count, dtype=jnp.int32))
  return carry, progress, emitted_NBK, extra_N
