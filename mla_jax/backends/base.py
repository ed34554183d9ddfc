"""The backend contract: four attention operations and the capabilities a backend declares.

Modules never know which backend runs; backends never know about routes, meshes or the MoE.
A backend is kernels only: per-sequence kernels, batched here by ``vmap``. Capabilities are
class-level constants so that routing reads them at trace time and no runtime branch exists
(``mla_jax.routing`` is the only place that combines them with the module's own). Running the
ops sharded over a device mesh is ``mla_jax.backends.on_mesh``'s job.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from mla_jax import checks
from mla_jax.routing import settle_masked_capability


@dataclasses.dataclass(frozen=True)
class Backend(abc.ABC):
  """Batched attention operations over per-sequence kernels.

  Subclasses implement the per-sequence ``_sparse_mqa`` and ``_indexer_logits`` (and
  ``_dense_mha`` when they declare ``supports_dense_mha_prefill``, ``_masked_mha`` when they
  can run ``supports_masked_mha_prefill``, which defaults to the dense capability); this base
  vmaps them over the batch axis, which Pallas turns into an extra grid axis. Instances are
  frozen and hashable, so a module may hold one as a static attribute.

  Attributes:
    masked_mha_max_tokens: static; the MASKED_MHA route is taken while ``top-k < cached + new
      <= masked_mha_max_tokens`` (``mla_jax.routing``); 0 turns it off. Each backend defaults
      it from its own cost model. Unused by a backend without the masked capability.
    key_chunk: static; key positions an engine's flat step scores per call of
      ``indexer_logits`` (``Indexer.select_in_key_chunks``: a loop up to the step's longest
      reach, each row reading its own sequence's keys). Each backend defaults it from its
      own measurements.
  """

  name: ClassVar[str]
  supports_dense_mha_prefill: ClassVar[bool] = False
  supports_masked_mha_prefill: ClassVar[bool] = False
  _masked_mha_declared: ClassVar[bool | None] = None  # see routing.settle_masked_capability

  masked_mha_max_tokens: int = 0
  key_chunk: int = 2048

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.supports_dense_mha_prefill and cls._dense_mha is Backend._dense_mha:
      raise TypeError(
          f"{cls.__name__} declares supports_dense_mha_prefill = True but does not implement"
          " _dense_mha"
      )
    settle_masked_capability(cls, implemented=cls._masked_mha is not Backend._masked_mha,
                             method="_masked_mha")

  def __post_init__(self):
    checks.static_int(self.masked_mha_max_tokens, "masked_mha_max_tokens", minimum=0)
    checks.static_int(self.key_chunk, "key_chunk", minimum=1)

  @abc.abstractmethod
  def _sparse_mqa(self, q_THL, kv_SL, topk_TK, *, sm_scale, d_v):
    """Per-sequence sparse MQA; see ``pallas_kernels.sparse_mqa_reference``."""

  @abc.abstractmethod
  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=None,
                      key_rows_S=None):
    """Per-sequence indexer logits; see ``pallas_kernels.indexer_logits_reference``."""

  def _dense_mha(self, q_THQ, k_SHQ, v_SHV, *, sm_scale, q_offset, kv_len, segment_ids_T=None):
    raise NotImplementedError(f"backend {self.name!r} has no dense MHA prefill kernel")

  def _masked_mha(self, q_THQ, k_SHQ, v_SHV, topk_TK, *, sm_scale, q_offset, kv_len):
    raise NotImplementedError(f"backend {self.name!r} has no masked MHA prefill kernel")

  def sparse_mqa(self, q_BTHL, kv_BSL, topk_BTK, *, sm_scale: float, d_v: int,
                 batched_rows: bool = True):
    """Returns ``(out_BTHV, lse_BTH)`` with natural-log LSE; invalid indices are -1 or >= S.

    ``kv_BSL`` is an array or ``Fp8LatentRows`` (every part batched, sharded like an array).
    ``batched_rows`` False: ``kv_BSL`` is rows [S, L] that every sequence indexes (a page
    pool), read by each sequence's kernel as they are, never copied per sequence.
    """
    if batched_rows:
      _same_batch("sparse_mqa", q_BTHL=q_BTHL, kv_BSL=kv_BSL, topk_BTK=topk_BTK)
    else:
      _same_batch("sparse_mqa", q_BTHL=q_BTHL, topk_BTK=topk_BTK)
    fn = jax.vmap(lambda q, kv, idx: self._sparse_mqa(q, kv, idx, sm_scale=sm_scale, d_v=d_v),
                  in_axes=(0, 0 if batched_rows else None, 0))
    return fn(q_BTHL, kv_BSL, topk_BTK)

  def indexer_logits(self, q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT, *, k_scale_BS=None,
                     key_rows_BS=None):
    """Returns float32 logits [B, T, S], -inf outside each row's ``[start, end)`` window.

    ``k_scale_BS``: per-key dequant scales of fp8 keys (the fp8 queries' scales are folded
    into ``w_BTG``).
    ``key_rows_BS`` (int32 [B, S], -1 for no key): pool mode. ``k_BSI`` is then key rows
    [P, I] that every sequence indexes (a page pool; ``k_scale_BS`` its [P] scales), and
    column s of sequence b scores pool row ``key_rows_BS[b, s]``: each sequence's kernel reads
    those rows of the pool as it is, never a per-sequence copy. Columns without a key are
    -inf. A float pool may be wider than the queries; rows are cast once read.
    """
    op = "indexer_logits"
    if key_rows_BS is None:
      _same_batch(op, q_BTGI=q_BTGI, k_BSI=k_BSI, w_BTG=w_BTG, starts_BT=starts_BT,
                  ends_BT=ends_BT)
    else:
      _row_ids(op, "key_rows_BS", key_rows_BS)
      _same_batch(op, q_BTGI=q_BTGI, w_BTG=w_BTG, starts_BT=starts_BT, ends_BT=ends_BT,
                  key_rows_BS=key_rows_BS)
    keys_axis = 0 if key_rows_BS is None else None  # the pool and its scales: unbatched
    per_sequence = lambda q, k, w, s, e, ks, rows: self._indexer_logits(
        q, k, w, s, e, k_scale_S=ks, key_rows_S=rows)
    fn = jax.vmap(per_sequence, in_axes=(0, keys_axis, 0, 0, 0, keys_axis, 0))
    return fn(q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT, k_scale_BS, key_rows_BS)

  def dense_mha(self, q_BTHQ, k_BSHQ, v_BSHV, *, sm_scale: float, q_offset_B, kv_len_B,
                segment_ids_BT=None):
    """Causal attention; query t of sequence b sits at position ``q_offset_B[b] + t``.

    ``segment_ids_BT`` (int32 [B, T], keys = queries, S == T): each row b holds several
    sequences laid end to end, and a query sees only keys of its own segment (an engine's
    flat step; see ``pallas_kernels.dense_mha_reference``)."""
    _same_batch("dense_mha", q_BTHQ=q_BTHQ, k_BSHQ=k_BSHQ, v_BSHV=v_BSHV, q_offset_B=q_offset_B,
                kv_len_B=kv_len_B)
    # As arrays: a NumPy operand closed over by jit would reach the kernel's custom VJP as a
    # raw constant under vmap, which its residuals cannot hold.
    offsets = (jnp.asarray(q_offset_B), jnp.asarray(kv_len_B))
    if segment_ids_BT is None:
      fn = jax.vmap(lambda q, k, v, off, n: self._dense_mha(q, k, v, sm_scale=sm_scale,
                                                            q_offset=off, kv_len=n))
      return fn(q_BTHQ, k_BSHQ, v_BSHV, *offsets)
    _same_batch("dense_mha", q_BTHQ=q_BTHQ, segment_ids_BT=segment_ids_BT)
    fn = jax.vmap(lambda q, k, v, off, n, seg: self._dense_mha(
        q, k, v, sm_scale=sm_scale, q_offset=off, kv_len=n, segment_ids_T=seg))
    return fn(q_BTHQ, k_BSHQ, v_BSHV, *offsets, jnp.asarray(segment_ids_BT))

  def masked_mha(self, q_BTHQ, k_BSHQ, v_BSHV, topk_BTK, *, sm_scale: float, q_offset_B,
                 kv_len_B):
    """``dense_mha`` with query t of sequence b restricted to the keys in ``topk_BTK[b, t]``
    (-1 and indices >= S ignored; a row left with no key gives out 0 and LSE +inf)."""
    _same_batch("masked_mha", q_BTHQ=q_BTHQ, k_BSHQ=k_BSHQ, v_BSHV=v_BSHV, topk_BTK=topk_BTK,
                q_offset_B=q_offset_B, kv_len_B=kv_len_B)
    fn = jax.vmap(lambda q, k, v, idx, off, n: self._masked_mha(
        q, k, v, idx, sm_scale=sm_scale, q_offset=off, kv_len=n))
    return fn(q_BTHQ, k_BSHQ, v_BSHV, *map(jnp.asarray, (topk_BTK, q_offset_B, kv_len_B)))


def _row_ids(op: str, name: str, rows) -> None:
  """Per-sequence row ids into a pool: int32 [B, S]."""
  if getattr(rows, "ndim", None) != 2:
    raise ValueError(f"{op}: {name} must be int32 [B, S], got shape "
                     f"{list(getattr(rows, 'shape', ()))}")
  if rows.dtype != jnp.int32:
    raise TypeError(f"{op}: {name} must be int32, got {rows.dtype}")


def _same_batch(op: str, **arrays) -> None:
  """Every argument of a batched op leads with the same batch axis (the kernels' own checks
  then see one sequence each); a mismatch would otherwise surface as a ``vmap`` error."""
  # An fp8 latent cache (``Fp8LatentRows``) leads with the batch axis in each of its parts.
  sizes = {name: getattr(getattr(a, "values", a), "shape", ())[:1] for name, a in arrays.items()}
  first_name, first = next(iter(sizes.items()))
  for name, size in sizes.items():
    if not size or size != first:
      raise ValueError(f"{op}: {name} must lead with the batch axis of {first_name} "
                       f"({first[0] if first else '?'}), got shape "
                       f"{list(getattr(arrays[name], 'shape', ()))}")
