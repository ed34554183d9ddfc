"""Runtime checks on values: eager on concrete inputs, opt-in under ``jit`` through checkify.

Shapes, dtypes and Python arguments are checked where they are given, before anything is
traced. Values (cache lengths, token ids, top-k rows) are only known at run time. Each check
here takes the values it needs and

* raises ``CheckError`` at once when they are concrete (an eager call);
* otherwise adds a ``checkify.debug_check``: a no-op in the compiled program unless the
  computation runs checkified, so the default path keeps its program (XLA removes the dead
  predicate) and its speed. An entry point that chooses at trace time (``functionalize``,
  ``generate``'s programs) leaves the checks out of an unchecked trace altogether.

Run a jitted computation with its checks on through ``checked(fn)`` (or
``generate(..., checks=True)``): a failed check then raises ``CheckError`` naming the problem
instead of giving a silently wrong result. Checks work through ``lax.scan`` (scanned layer
groups, chunked scoring, the multi-step decode); checkify cannot check inside a Pallas
kernel, so every check sits outside the kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import checkify

from mla_jax import sharding


class CheckError(ValueError):
  """A run-time value is out of its contract (eager, or in a checked computation)."""


class IdOutOfRangeError(CheckError, IndexError):
  """A token id outside [0, vocab_size)."""


_ERROR_TYPES: dict[str, type[CheckError]] = {}  # message format -> the class it raises
# False while an unchecked entry point traces (``functionalize``): its checks stay out of the
# program altogether (see ``check``).
_TRACE_CHECKS = contextvars.ContextVar("mla_jax_trace_checks", default=True)


def float_dtype(dtype, name: str) -> jnp.dtype:
  """``dtype`` as a floating ``jnp.dtype``; a ``TypeError`` naming ``name`` otherwise.

  Parameters and cache rows hold floats: an integer dtype would silently round them (random
  weights to 0, cache rows to integers).
  """
  try:
    resolved = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{name} must be a floating dtype, got {dtype!r}") from None
  if isinstance(dtype, bool) or not jnp.issubdtype(resolved, jnp.floating):
    raise TypeError(f"{name} must be a floating dtype, got {resolved}")
  return resolved


def is_traced(*values) -> bool:
  """Whether any of ``values`` is a tracer (its value is only known when the program runs)."""
  return any(isinstance(v, jax.core.Tracer) for v in values)


def is_int(value) -> bool:
  """A Python or NumPy integer, not a bool (``True`` is an ``int`` to Python)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def static_int(value, name: str, *, minimum: int | None = None, maximum: int | None = None,
               wrong_type: type[Exception] = TypeError) -> int:
  """``value`` as a Python int in ``[minimum, maximum]``, or an error naming ``name``.

  NumPy integer scalars are accepted (and converted), bools, floats, strings and traced values
  are ``wrong_type``; an int out of range is a ``ValueError``.
  """
  if not is_int(value):
    raise wrong_type(f"{name} must be a static int, got {type(value).__name__} {value!r}")
  value = int(value)
  if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
    bounds = (f"in [{minimum}, {maximum}]" if minimum is not None and maximum is not None
              else f">= {minimum}" if minimum is not None else f"<= {maximum}")
    raise ValueError(f"{name} must be an int {bounds}, got {value}")
  return value


def check(pred, message: str, *values, error: type[CheckError] = CheckError) -> None:
  """Raises ``error(message.format(*values))`` unless ``pred``; see the module docstring.

  ``pred`` is a scalar bool (array); ``values`` are scalar arrays named in ``message``.
  """
  if not is_traced(pred, *values):
    if not bool(pred):
      raise error(message.format(*(np.asarray(v).item() for v in values)))
    return
  if not _TRACE_CHECKS.get():
    return
  _ERROR_TYPES[message] = error
  checkify.debug_check(jnp.asarray(pred), message, *(jnp.asarray(v) for v in values))


def throw(err) -> None:
  """Raises the first failed check of a checkify ``Error`` (None: nothing was checked)."""
  if err is None:
    return
  exc = err.get_exception()
  if exc is None:
    return
  # checkify's exception classes are private: tell them apart by their attributes.
  if hasattr(exc, "error_mapping"):  # a check under vmap / shard_map: report the first one
    exc = next(iter(exc.error_mapping.values()))
  if not hasattr(exc, "fmt_string"):  # not a user check (only those are enabled here)
    raise CheckError(str(exc))
  values = (np.asarray(v).item() for v in exc.args)
  raise _ERROR_TYPES.get(exc.fmt_string, CheckError)(exc.fmt_string.format(*values))


@contextlib.contextmanager
def _untraced_checks():
  token = _TRACE_CHECKS.set(False)
  try:
    yield
  finally:
    _TRACE_CHECKS.reset(token)


def functionalize(fn, enabled: bool):
  """``fn`` returning ``(err, out)``: checkified when ``enabled``, else ``(None, out)``.

  For jitted entry points that choose at trace time (a static flag) whether to check.
  Unchecked, ``fn`` is traced without its checks: a ``debug_check`` compiles to nothing, but
  it marks the program with an effect, and jax dispatches a program with effects through its
  Python path (about 2 ms of host time per call) instead of the C++ one.
  """
  if enabled:
    return nnx.checkify(fn)

  def unchecked(*args, **kwargs):
    with _untraced_checks():
      return None, fn(*args, **kwargs)

  return unchecked


def checked(fn):
  """``fn`` with its run-time checks on: returns its result or raises ``CheckError``.

  ``fn`` may be jitted (``jax.jit``, ``nnx.jit``) or contain jitted calls::

    step = checks.checked(nnx.jit(lambda model, ids, caches: model(ids, caches)))
    logits, caches = step(model, ids, caches)  # CheckError on overflow, bad ids, ...
  """
  run_checkified = nnx.checkify(fn)  # the reference-aware checkify: modules may be arguments

  @functools.wraps(fn)
  def run(*args, **kwargs):
    err, out = run_checkified(*args, **kwargs)
    throw(err)
    return out

  return run


# ---- the value checks shared by the modules -----------------------------------------------
# Each takes arrays that are either all concrete (computed on the host with NumPy) or traced.

def _on_host_or_traced(*arrays):
  """NumPy and host copies of concrete arrays; jnp and the arrays themselves when traced."""
  if not is_traced(*arrays):
    return np, tuple(sharding.fetch(a) for a in arrays)
  return jnp, tuple(jnp.asarray(a) for a in arrays)


def _per_sequence(*arrays_B):
  """``_on_host_or_traced`` for per-sequence [B] arrays, refusing an empty batch first (its
  shape is static): a min or max over no sequence has no value."""
  if any(np.shape(a)[:1] == (0,) for a in arrays_B):
    raise ValueError("the batch is empty (batch size 0): a call needs at least one sequence")
  return _on_host_or_traced(*arrays_B)


def _worst(xp, values_B):
  """The index of the largest entry and that entry."""
  b = xp.argmax(values_B)
  return b, values_B[b]


def new_tokens(new_lens_B, num_cached_B, *, num_tokens: int, capacity: int,
               max_positions: int) -> None:
  """A step appending ``new_lens_B`` of ``num_tokens`` tokens to caches of ``num_cached_B``:
  ``new_lens_B`` is int [B] in [0, T], lengths and positions are in range, and the rows fit.

  The one check of a step's lengths, at the model (where they are still concrete in an eager
  call) and at each layer (which a standalone call reaches directly).
  """
  batch = tuple(num_cached_B.shape)
  if tuple(new_lens_B.shape) != batch or not jnp.issubdtype(new_lens_B.dtype, jnp.integer):
    raise ValueError(f"new_lens must be int {list(batch)}, got {new_lens_B.shape} "
                     f"{new_lens_B.dtype}")
  new_lens_in_range(new_lens_B, num_tokens)
  lengths_valid(num_cached_B, new_lens_B, max_positions)
  cache_fits(num_cached_B, new_lens_B, capacity)


def cache_fits(num_cached_B, new_lens_B, capacity: int) -> None:
  """A step appending ``new_lens_B`` tokens must fit: rows past capacity would be dropped."""
  xp, (num_cached_B, new_lens_B) = _per_sequence(num_cached_B, new_lens_B)
  b, total = _worst(xp, num_cached_B + new_lens_B)
  check(total <= capacity, "sequence {} would hold {} tokens, more than the cache capacity "
        f"{capacity}; the step is refused", b, total)


def new_lens_in_range(new_lens_B, num_tokens: int) -> None:
  """Each sequence's count of real tokens lies in [0, T]."""
  xp, (new_lens_B,) = _per_sequence(new_lens_B)
  low, high = xp.min(new_lens_B), xp.max(new_lens_B)
  check((low >= 0) & (high <= num_tokens),
        f"new_lens must lie in [0, {num_tokens}], got values in [{{}}, {{}}]", low, high)


def lengths_valid(num_cached_B, new_lens_B, max_positions: int) -> None:
  """Cache lengths are >= 0 and the new tokens' positions stay below ``max_positions``.

  RoPE's angle tables end there: a later position would be rotated by a clamped angle.
  """
  xp, (num_cached_B, new_lens_B) = _per_sequence(num_cached_B, new_lens_B)
  low = xp.min(num_cached_B)
  check(low >= 0, "cache lengths must be >= 0, got {}", low)
  b, end = _worst(xp, num_cached_B + new_lens_B)
  check(end <= max_positions, "sequence {} would write position {}, past "
        f"max_position_embeddings {max_positions} (RoPE's angle tables end there)", b, end - 1)


def within_cached_bound(num_cached_B, num_cached_tokens: int) -> None:
  """The static ``num_cached_tokens`` bound holds (the dense route reads only that many rows)."""
  xp, (num_cached_B,) = _per_sequence(num_cached_B)
  longest = xp.max(num_cached_B)
  check(longest <= num_cached_tokens, f"num_cached_tokens={num_cached_tokens} but the cache "
        "already holds {} tokens for some sequence", longest)


def ids_in_vocab(ids_BT, vocab_size: int) -> None:
  """Token ids lie in [0, vocab_size) (a gather past the table would read its last row)."""
  xp, (ids_BT,) = _on_host_or_traced(ids_BT)
  if ids_BT.size == 0:
    return
  low, high = xp.min(ids_BT), xp.max(ids_BT)
  check((low >= 0) & (high < vocab_size),
        f"token ids must lie in [0, {vocab_size}), got values in [{{}}, {{}}]", low, high,
        error=IdOutOfRangeError)


def rows_attend(topk_BTK, new_lens_B) -> None:
  """Every real query row has at least one valid top-k index (else its output would be 0)."""
  xp, (topk_BTK, new_lens_B) = _on_host_or_traced(topk_BTK, new_lens_B)
  num_tokens = topk_BTK.shape[1]
  real_BT = xp.arange(num_tokens)[None, :] < new_lens_B[:, None]
  empty_BT = real_BT & ~(topk_BTK >= 0).any(-1)
  flat = xp.argmax(empty_BT.reshape(-1))
  check(~empty_BT.any(), "query row {} of sequence {} has no valid top-k index: its attention "
        "output would silently be zero (was the indexer skipped, or are all its scores NaN or "
        "-inf?)",
        flat % num_tokens, flat // num_tokens)
