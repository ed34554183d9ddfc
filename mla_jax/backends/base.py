"""The backend contract: three attention operations and the capabilities a backend declares.

Modules never know which backend runs; backends never know about routes. Capabilities are
class-level constants so that routing reads them at trace time and no runtime branch exists
(``mla_jax.routing`` is the only place that combines them with the module's own).

A backend may also carry a device mesh. Its operations then run under ``shard_map``: the
batch over ``data``, query heads over ``tensor`` (the latent rows and the indexer are whole on
every tensor shard), which is also what lets the Pallas kernels, which XLA cannot partition
itself, run on a mesh.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from mla_jax.sharding import DATA, TENSOR

GROUPED_MATMULS = ("auto", "ragged_dot", "tiled")

_BATCH = P(DATA)
_HEADS = P(DATA, None, TENSOR)  # [B, T, H, ...]: batch over data, heads over tensor


@dataclasses.dataclass(frozen=True)
class Backend(abc.ABC):
  """Batched attention operations over per-sequence kernels.

  Subclasses implement the per-sequence ``_sparse_mqa`` and ``_indexer_logits`` (and
  ``_dense_mha`` when they declare ``supports_dense_mha_prefill``); this base vmaps them over
  the batch axis, which Pallas turns into an extra grid axis. Instances are frozen and
  hashable, so a module may hold one as a static attribute.

  Attributes:
    mesh: run every operation sharded over this mesh (None: one device).
    grouped_matmul: the MoE's grouped matmul, ``"ragged_dot"`` (XLA's grouped GEMM) or
      ``"tiled"`` (row tiles; its cost follows the routed rows on XLA:CPU, which expands
      ``ragged_dot`` over every expert). ``"auto"`` picks ``tiled`` on CPU.
  """

  name: ClassVar[str]
  supports_dense_mha_prefill: ClassVar[bool] = False

  mesh: Mesh | AbstractMesh | None = None
  grouped_matmul: str = "auto"

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.supports_dense_mha_prefill and cls._dense_mha is Backend._dense_mha:
      raise TypeError(
          f"{cls.__name__} declares supports_dense_mha_prefill = True but does not implement"
          " _dense_mha"
      )

  def __post_init__(self):
    if self.grouped_matmul not in GROUPED_MATMULS:
      raise ValueError(f"grouped_matmul must be one of {GROUPED_MATMULS}, got "
                       f"{self.grouped_matmul!r}")
    if self.mesh is not None and not isinstance(self.mesh, (Mesh, AbstractMesh)):
      raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(self.mesh).__name__}")
    if self.grouped_matmul == "auto":
      platform = jax.default_backend()
      object.__setattr__(self, "grouped_matmul", "tiled" if platform == "cpu" else "ragged_dot")

  def on_mesh(self, mesh) -> Backend:
    """This backend running sharded over ``mesh``."""
    return dataclasses.replace(self, mesh=mesh)

  @abc.abstractmethod
  def _sparse_mqa(self, q_THL, kv_SL, topk_TK, *, sm_scale, d_v):
    """Per-sequence sparse MQA; see ``pallas_kernels.sparse_mqa_reference``."""

  @abc.abstractmethod
  def _indexer_logits(self, q_TGI, k_SI, w_TG, starts_T, ends_T, k_scale_S=None):
    """Per-sequence indexer logits; see ``pallas_kernels.indexer_logits_reference``."""

  def _dense_mha(self, q_THQ, k_SHQ, v_SHV, *, sm_scale, q_offset, kv_len):
    raise NotImplementedError(f"backend {self.name!r} has no dense MHA prefill kernel")

  def _sharded(self, fn, in_specs, out_specs):
    if self.mesh is None:
      return fn
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

  def sparse_mqa(self, q_BTHL, kv_BSL, topk_BTK, *, sm_scale: float, d_v: int):
    """Returns ``(out_BTHV, lse_BTH)`` with natural-log LSE; invalid indices are -1 or >= S.

    ``kv_BSL`` is an array or ``Fp8LatentRows`` (every part batched, sharded like an array).
    """
    _same_batch("sparse_mqa", q_BTHL=q_BTHL, kv_BSL=kv_BSL, topk_BTK=topk_BTK)
    fn = jax.vmap(lambda q, kv, idx: self._sparse_mqa(q, kv, idx, sm_scale=sm_scale, d_v=d_v))
    return self._sharded(fn, (_HEADS, _BATCH, _BATCH), (_HEADS, _HEADS))(q_BTHL, kv_BSL,
                                                                         topk_BTK)

  def indexer_logits(self, q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT, *, k_scale_BS=None):
    """Returns float32 logits [B, T, S], -inf outside each row's ``[start, end)`` window.

    ``k_scale_BS``: per-key dequant scales of fp8 keys (the fp8 queries' scales are folded
    into ``w_BTG``). On a mesh every tensor shard computes all the logits (the indexer is
    replicated), so all shards select the same top-k; the scales are split like the keys.
    """
    _same_batch("indexer_logits", q_BTGI=q_BTGI, k_BSI=k_BSI, w_BTG=w_BTG, starts_BT=starts_BT,
                ends_BT=ends_BT)
    args = (q_BTGI, k_BSI, w_BTG, starts_BT, ends_BT)
    if k_scale_BS is None:
      fn = jax.vmap(self._indexer_logits)
    else:
      fn = jax.vmap(lambda q, k, w, s, e, ks: self._indexer_logits(q, k, w, s, e, k_scale_S=ks))
      args += (k_scale_BS,)
    return self._sharded(fn, (_BATCH,) * len(args), _BATCH)(*args)

  def dense_mha(self, q_BTHQ, k_BSHQ, v_BSHV, *, sm_scale: float, q_offset_B, kv_len_B):
    """Causal attention; query t of sequence b sits at position ``q_offset_B[b] + t``."""
    _same_batch("dense_mha", q_BTHQ=q_BTHQ, k_BSHQ=k_BSHQ, v_BSHV=v_BSHV, q_offset_B=q_offset_B,
                kv_len_B=kv_len_B)
    fn = jax.vmap(lambda q, k, v, off, n: self._dense_mha(q, k, v, sm_scale=sm_scale,
                                                          q_offset=off, kv_len=n))
    return self._sharded(fn, (_HEADS, _HEADS, _HEADS, _BATCH, _BATCH), (_HEADS, _HEADS))(
        q_BTHQ, k_BSHQ, v_BSHV, q_offset_B, kv_len_B)


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
