"""MLA attention modules: the dense-capable ``MLAAttention`` and MQA-only ``DeepseekV32Attention``.

A call (docs/design.md §2, §6) reads one ``StepPlan`` (``mla_jax.step_plan``), resolved in
Python before tracing: a model builds it once per step, a standalone layer call builds its own.
The layer then *prepares* (validates, projects q and the latent, writes the latent cache and
the indexer key cache: always, on every route) and runs exactly one route function:

* DENSE_MHA  - decompress per-head K/V from the latent, causal attention  (``mla_dense_mha``)
* MASKED_MHA - indexer top-k (``indexer_score``), the same MHA form over the causal keys with
  each query masked to its top-k set (``mla_masked_mha``); equals SPARSE_MQA up to rounding
* SPARSE_MQA - indexer top-k (``indexer_score``), absorbed MQA over those rows (``mla_sparse_mqa``)
* DENSE_MQA  - absorbed MQA over every causal row, for MLA without an indexer (``mla_dense_mqa``)

Only the chosen function is traced. The MHA routes are methods of the dense-capable class
alone (``forward_mha``, ``forward_masked_mha``): ``DeepseekV32Attention`` derives from the base
and has neither, declaring a capability without its method is a ``TypeError`` at class
definition, and a plan with an MHA route cannot be built for a class or backend without the
capability.
"""

from __future__ import annotations

import logging
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax import checks, losses
from mla_jax.backends import Backend, get_backend
from mla_jax.backends.on_mesh import MeshOps
from mla_jax.cache import CacheView, check_layout
from mla_jax.config import MLAConfig
from mla_jax.fp8_cache import Fp8LatentRows, dense_latent
from mla_jax.indexer import Indexer, topk_indices
from mla_jax.layers import Linear, RMSNorm
from mla_jax.rope import apply_rope
from mla_jax.routing import (PrefillRoute, dense_mha_allowed, masked_mha_allowed,
                             resolve_prefill_route, settle_masked_capability)
from mla_jax.step_plan import INDEXER_LOSSES, StepPlan, plan_step, static_num_cached

logger = logging.getLogger("mla_jax")
_logged_mqa_only: set[tuple[str, str]] = set()

class AttentionOutput(NamedTuple):
  out_BTD: jax.Array
  cache: CacheView
  topk_BTK: jax.Array | None  # the indices this call attended over (MASKED_MHA: its mask);
                              # None on DENSE_MHA
  indexer_loss: jax.Array | None = None  # the indexer's KL when asked for; see __call__


class PreparedStep(NamedTuple):
  """What every route starts from: projections, positions and the caches already written."""

  x_BTD: jax.Array
  positions_BT: jax.Array
  q_resid_BTC: jax.Array       # the normalised query latent (the indexer's input)
  q_nope_BTHN: jax.Array
  q_pe_BTHR: jax.Array
  num_cached_B: jax.Array      # before this step's rows were written
  new_lens_B: jax.Array
  cache: CacheView             # with this step's rows written
  index_logits_BTS: jax.Array | None  # every causal score, only when an indexer loss is asked


def causal_indices(positions_BT, num_rows: int):
  """Every causal row as an index set: [B, T, S] with -1 past each query's position."""
  s_S = jnp.arange(num_rows, dtype=jnp.int32)
  return jnp.where(s_S[None, None, :] <= positions_BT[..., None], s_S, -1)


class MLAAttentionBase(nnx.Module):
  """Projections, caches, the indexer and the absorbed-MQA routes shared by every MLA layer.

  Attributes:
    supports_dense_mha_prefill: whether this layer's semantics allow the dense-MHA prefill.
      Subclasses that declare True must define ``forward_mha`` (the DENSE_MHA route).
    supports_masked_mha_prefill: whether they allow the masked-MHA prefill; defaults to the
      dense capability (``routing.settle_masked_capability``). True needs
      ``forward_masked_mha`` (the MASKED_MHA route).
  """

  supports_dense_mha_prefill: ClassVar[bool] = False
  supports_masked_mha_prefill: ClassVar[bool] = False
  _masked_mha_declared: ClassVar[bool | None] = None

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.supports_dense_mha_prefill and not callable(getattr(cls, "forward_mha", None)):
      raise TypeError(f"{cls.__name__} declares supports_dense_mha_prefill = True but "
                      "implements no forward_mha (dense MHA prefill path)")
    settle_masked_capability(cls, implemented=callable(getattr(cls, "forward_masked_mha", None)),
                             method="forward_masked_mha")

  def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs, backend: str | Backend = "auto",
               mesh=None, param_dtype=jnp.float32, index_chunk_size: int = 2048,
               shares_topk: bool = False):
    """
    Args:
      config: the layer's dims; ``config.indexer`` makes it a sparse (DSA) layer.
      rngs: parameter initialization (an ``nnx.Rngs``).
      backend: ``"auto" | "xla" | "pallas" | "mosaic-gpu"`` or a ``Backend`` instance
        (kernels only).
      mesh: run the attention ops sharded over this device mesh (None: one device).
      param_dtype: parameter dtype (the indexer's ``weights_proj`` stays float32).
      index_chunk_size: query rows scored per block of indexer logits.
      shares_topk: an IndexShare "shared" layer (GLM-5.2): no indexer weights or key cache of
        its own; it attends over the top-k of the previous full layer of the same step.

    Values that only exist at run time (cache lengths, ``new_lens_B``, every real query
    row having a top-k index) are checked by ``mla_jax.checks``: at once in an eager call,
    and under ``jit`` when the computation runs checked (``checks.checked``).
    """
    if not isinstance(config, MLAConfig):
      raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(0)), got {type(rngs).__name__}")
    checks.static_int(index_chunk_size, "index_chunk_size", minimum=1, wrong_type=ValueError)
    checks.float_dtype(param_dtype, "param_dtype")
    c = config
    self.config = c
    self.backend = get_backend(backend)
    self.ops = MeshOps(self.backend, mesh)
    self.index_chunk_size = int(index_chunk_size)
    # No dense prefill path object at all unless both the layer class and backend allow it.
    self.dense_prefill_backend = self.ops if dense_mha_allowed(self, self.backend) else None
    self.masked_prefill_backend = self.ops if masked_mha_allowed(self, self.backend) else None
    if c.indexer is not None and self.dense_prefill_backend is None:
      key = (type(self).__name__, type(self.backend).__name__)
      if key not in _logged_mqa_only:
        _logged_mqa_only.add(key)
        logger.info("%s on backend %s has no dense-MHA prefill path; sparse MLA prefill "
                    "uses the top-k MQA path only", *key)
    self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, rngs=rngs, param_dtype=param_dtype)
    self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.latent_norm_eps, param_dtype=param_dtype)
    self.q_b_proj = Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, rngs=rngs,
                           param_dtype=param_dtype)
    self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.latent_dim, rngs=rngs,
                                     param_dtype=param_dtype)
    self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=c.latent_norm_eps, param_dtype=param_dtype)
    self.kv_b_proj = Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                            rngs=rngs, param_dtype=param_dtype)
    self.o_proj = Linear(c.num_heads * c.v_head_dim, c.hidden_size, rngs=rngs,
                         param_dtype=param_dtype)
    if shares_topk and c.indexer is None:
      raise ValueError("shares_topk requires config.indexer (a sparse layer)")
    self.shares_topk = shares_topk
    self.indexer = (Indexer(c, rngs=rngs, param_dtype=param_dtype)
                    if c.indexer is not None and not shares_topk else None)

  @property
  def mesh(self):
    return self.ops.mesh

  # ---- routing -------------------------------------------------------------------------

  def prefill_route(self, num_new_tokens: int, num_cached_tokens: int | None = 0, *,
                    force_mqa: bool = False) -> PrefillRoute:
    """The route a call with these static counts takes (None cached: unknown, so MQA)."""
    return resolve_prefill_route(self, self.backend, num_new_tokens=num_new_tokens,
                                 num_cached_tokens=num_cached_tokens, force_mqa=force_mqa)

  def step_plan(self, num_new_tokens: int, num_cached_tokens: int | None, *, capacity: int,
                kv_rows: int | None = None, force_mqa: bool = False,
                indexer_loss: str | None = None) -> StepPlan:
    """The plan of a standalone call of this layer (``kv_rows`` defaults to ``capacity``)."""
    return plan_step([self], self.backend, num_new_tokens=num_new_tokens,
                     num_cached_tokens=num_cached_tokens, capacity=capacity,
                     kv_rows=capacity if kv_rows is None else kv_rows, force_mqa=force_mqa,
                     indexer_loss=indexer_loss)

  # ---- the absorbed form -----------------------------------------------------------------

  def _kv_b_heads(self):
    """W_UK [H, N, A] and W_UV [H, V, A] from ``kv_b_proj`` (per head [k_nope | v] rows)."""
    c = self.config
    w = self.kv_b_proj.weight[...].reshape(c.num_heads, c.qk_nope_head_dim + c.v_head_dim,
                                           c.kv_lora_rank)
    return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

  def _absorbed_query(self, q_nope_BTHN, q_pe_BTHR):
    """The MQA-form query [q_lat (A) | q_pe (R)] per head: q_lat = W_UK^T q_nope."""
    w_uk_HNA, _ = self._kv_b_heads()
    dtype = q_nope_BTHN.dtype
    # Heads-major operands: XLA:CPU has no bf16 x bf16 -> f32 kernel for this batched dot
    # when the batch axis sits between the free axes ("bthn,hna" fails on jax 0.10-0.12).
    q_lat_HBTA = jnp.einsum("hbtn,hna->hbta", jnp.moveaxis(q_nope_BTHN, 2, 0),
                            w_uk_HNA.astype(dtype), preferred_element_type=jnp.float32)
    q_lat_BTHA = jnp.moveaxis(q_lat_HBTA, 0, 2).astype(dtype)
    return jnp.concatenate([q_lat_BTHA, q_pe_BTHR.astype(dtype)], axis=-1)

  def forward_mqa(self, q_nope_BTHN, q_pe_BTHR, latent_BSL, topk_BTK, *,
                  batched_rows: bool = True, split_rows: bool = False):
    """Absorb W_UK into q, attend over the selected latent rows, apply W_UV: [B, T, H, V].

    ``batched_rows`` False: ``latent_BSL`` is rows [S, L] shared by the batch (a page pool);
    ``split_rows``: they are a union top-k over a context axis (``MeshOps.sparse_mqa``)."""
    _, w_uv_HVA = self._kv_b_heads()
    dtype = q_nope_BTHN.dtype
    q_BTHL = self._absorbed_query(q_nope_BTHN, q_pe_BTHR)
    if not isinstance(latent_BSL, Fp8LatentRows):  # fp8 rows are dequantized by the backend
      latent_BSL = latent_BSL.astype(dtype)
    out_lat_BTHA, _ = self.ops.sparse_mqa(q_BTHL, latent_BSL, topk_BTK,
                                          sm_scale=self.config.softmax_scale,
                                          d_v=self.config.kv_lora_rank,
                                          batched_rows=batched_rows, split_rows=split_rows)
    return jnp.einsum("btha,hva->bthv", out_lat_BTHA, w_uv_HVA.astype(dtype),
                      preferred_element_type=jnp.float32).astype(dtype)

  # ---- the call --------------------------------------------------------------------------

  def project(self, x_BTD, positions_BT):
    """The query and latent projections of tokens at ``positions_BT``.

    Returns ``(q_resid_BTC, q_nope_BTHN, q_pe_BTHR, latent_BTL)``: the normalised query
    latent (the indexer's input), the no-RoPE and rotated query parts per head, and the cache
    rows [normalised c_kv | rotated k_pe].
    """
    c = self.config
    b, t, _ = x_BTD.shape
    q_resid_BTC = self.q_a_layernorm(self.q_a_proj(x_BTD))
    q_BTHQ = self.q_b_proj(q_resid_BTC).reshape(b, t, c.num_heads, c.qk_head_dim)
    q_pe_BTHR = apply_rope(q_BTHQ[..., c.qk_nope_head_dim:], positions_BT, c.rope,
                           interleaved=True, max_position=c.max_position_embeddings)
    kv_BTL = self.kv_a_proj_with_mqa(x_BTD)
    c_kv_BTA = self.kv_a_layernorm(kv_BTL[..., :c.kv_lora_rank])
    k_pe_BTR = apply_rope(kv_BTL[..., c.kv_lora_rank:], positions_BT, c.rope, interleaved=True,
                          max_position=c.max_position_embeddings)
    return (q_resid_BTC, q_BTHQ[..., :c.qk_nope_head_dim], q_pe_BTHR,
            jnp.concatenate([c_kv_BTA, k_pe_BTR], -1))

  def _validate(self, x_BTD, cache: CacheView, new_lens_B):
    c = self.config
    if getattr(x_BTD, "ndim", None) != 3 or x_BTD.shape[-1] != c.hidden_size:
      raise ValueError(f"x must be [batch, tokens, {c.hidden_size}], got shape "
                       f"{getattr(x_BTD, 'shape', None)}")
    if x_BTD.shape[0] == 0:
      raise ValueError("the batch is empty (batch size 0): x must hold at least one sequence")
    if x_BTD.shape[1] == 0:
      raise ValueError("x must hold at least one token")
    if not jnp.issubdtype(x_BTD.dtype, jnp.floating):
      raise TypeError(f"x must be a floating dtype, got {x_BTD.dtype}")
    if not isinstance(cache, CacheView):
      raise TypeError(f"cache must be a LayerCache, got {type(cache).__name__}")
    if cache.batch_size != x_BTD.shape[0] or cache.latent_dim != c.latent_dim:
      raise ValueError(f"cache of {cache.batch_size} sequences with rows {cache.latent_dim} "
                       f"wide does not fit x {x_BTD.shape} (expected [{x_BTD.shape[0]}, "
                       f"capacity, {c.latent_dim}])")
    if cache.has_index_keys != (self.indexer is not None):
      raise ValueError("cache.index_keys_BSI must be present exactly when the layer has an "
                       "indexer of its own")
    check_layout(cache, c)
    checks.new_tokens(new_lens_B, cache.num_cached_B, num_tokens=x_BTD.shape[1],
                      capacity=cache.capacity, max_positions=c.max_position_embeddings)

  def __call__(self, x_BTD, cache: CacheView, *, new_lens_B=None, plan: StepPlan | None = None,
               num_cached_tokens=None, force_mqa: bool = False, kv_rows: int | None = None,
               indexer_loss: str | None = None, shared_topk_BTK=None) -> AttentionOutput:
    """Attends ``x_BTD`` (after the layer's input norm) and appends it to ``cache``.

    Args:
      x_BTD: hidden states; row t of sequence b sits at position ``cache.num_cached_B[b] + t``.
      cache: this layer's cache (a ``LayerCache``, or a layer of a stacked one); returned
        updated in the output.
      new_lens_B: valid tokens per sequence (right padding beyond); default all T.
      plan: the step's ``StepPlan`` (a model passes its own). Without one the call builds
        its plan from the static settings below; with one, they must be left unset.
      num_cached_tokens: static upper bound on ``cache.num_cached_B``. When None it is read
        from concrete lengths; under ``jit`` it is unknown and the route is MQA (decode).
      force_mqa: take neither MHA route (dense or masked).
      kv_rows: static number of cache rows attention and the indexer read (rows past it are
        never touched); it must cover every row this step can reach. None: the capacity.
      indexer_loss: training only (static). ``"dense"``: the indexer's KL against the
        head-summed main attention over every causal key (DeepSeek-V3.2's warm-up);
        ``"sparse"``: the same KL over the keys this call attended (its top-k set, or every
        causal key on the dense route). Either one detaches the indexer's inputs from the
        main graph, so the indexer learns only from its KL and the rest of the layer only
        from the loss on ``out_BTD``. The output's ``indexer_loss`` is the KL's mean over
        real tokens, or None for a layer without an indexer of its own.
      shared_topk_BTK: for a ``shares_topk`` layer, the indices its full layer selected in
        this same step; required on the sparse route, unused on the dense one.
    """
    if indexer_loss not in INDEXER_LOSSES:
      raise ValueError(f"indexer_loss must be one of {INDEXER_LOSSES}, got {indexer_loss!r}")
    if getattr(x_BTD, "ndim", None) != 3:
      raise ValueError(f"x must be [batch, tokens, {self.config.hidden_size}], got shape "
                       f"{getattr(x_BTD, 'shape', None)}")
    b, t, _ = x_BTD.shape
    new_lens_B = jnp.full((b,), t, jnp.int32) if new_lens_B is None else jnp.asarray(new_lens_B)
    self._validate(x_BTD, cache, new_lens_B)
    if plan is None:
      plan = self.step_plan(t, static_num_cached(num_cached_tokens, cache.num_cached_B),
                            capacity=cache.capacity, kv_rows=kv_rows,
                            force_mqa=force_mqa, indexer_loss=indexer_loss)
    elif (num_cached_tokens, force_mqa, kv_rows, indexer_loss) != (None, False, None, None):
      raise ValueError("pass either a plan or the static settings it is built from "
                       "(num_cached_tokens, force_mqa, kv_rows, indexer_loss), not both")
    return self._run(x_BTD, cache, plan, new_lens_B.astype(jnp.int32), shared_topk_BTK)

  def attend(self, x_BTD, cache: CacheView, plan: StepPlan, *, new_lens_B=None,
             shared_topk_BTK=None) -> AttentionOutput:
    """The call inside a model, with the model's ``plan`` (``new_lens_B`` None: all T)."""
    if new_lens_B is None:
      new_lens_B = jnp.full(x_BTD.shape[:1], x_BTD.shape[1], jnp.int32)
    self._validate(x_BTD, cache, new_lens_B)
    return self._run(x_BTD, cache, plan, new_lens_B.astype(jnp.int32), shared_topk_BTK)

  def _run(self, x_BTD, cache, plan: StepPlan, new_lens_B, shared_topk_BTK) -> AttentionOutput:
    step = self._prepare(x_BTD, cache, plan, new_lens_B)
    if plan.route is PrefillRoute.DENSE_MHA:
      topk_BTK = None
      with jax.named_scope(plan.route.scope):
        o_BTHV = self.forward_mha(step, plan)  # only dense-capable classes have it
    elif plan.route is PrefillRoute.MASKED_MHA:
      topk_BTK = self._select(step, plan, shared_topk_BTK)
      checks.rows_attend(topk_BTK, new_lens_B)
      with jax.named_scope(plan.route.scope):
        o_BTHV = self.forward_masked_mha(step, plan, topk_BTK)  # likewise
    else:
      if plan.route is PrefillRoute.SPARSE_MQA:
        topk_BTK = self._select(step, plan, shared_topk_BTK)
      else:
        topk_BTK = causal_indices(step.positions_BT, plan.kv_rows)
      checks.rows_attend(topk_BTK, new_lens_B)
      # Logical positions become cache rows here, at the gather (a paged cache's pool rows).
      latent, rows_BTK, batched = step.cache.attention_rows(topk_BTK, plan.kv_rows)
      with jax.named_scope(plan.route.scope):
        o_BTHV = self.forward_mqa(step.q_nope_BTHN, step.q_pe_BTHR, latent, rows_BTK,
                                  batched_rows=batched, split_rows=self._union_topk(plan))
    c = self.config
    b, t, _ = x_BTD.shape
    out_BTD = self.o_proj(o_BTHV.reshape(b, t, c.num_heads * c.v_head_dim))
    loss = None
    if step.index_logits_BTS is not None:
      # The sparse KL runs over the set attended: top-k rows, or all causal keys when dense.
      loss = self._indexer_kl(step, plan, topk_BTK if plan.indexer_loss == "sparse" else None)
    return AttentionOutput(out_BTD, step.cache, topk_BTK, loss)

  def _prepare(self, x_BTD, cache, plan: StepPlan, new_lens_B) -> PreparedStep:
    """Checks the plan against this call, projects, and writes both caches (every route)."""
    plan.check_layer(self)
    t = x_BTD.shape[1]
    if plan.num_new_tokens != t:
      raise ValueError(f"the step plan is for {plan.num_new_tokens} new tokens, x holds {t}")
    if plan.kv_rows > cache.capacity:
      raise ValueError(f"kv_rows must be an int in [1, capacity={cache.capacity}], got "
                       f"{plan.kv_rows!r}")
    if plan.route.needs_topk != (self.config.indexer is not None) and \
        plan.route is not PrefillRoute.DENSE_MHA:
      raise ValueError(f"route {plan.route.name} does not fit a layer "
                       f"{'with' if self.config.indexer else 'without'} an indexer")
    if plan.bounds_num_cached:
      checks.within_cached_bound(cache.num_cached_B, plan.num_cached_tokens)
    if plan.segmented and cache.segment_ids_B is None:
      raise ValueError("a segmented step plan needs a cache view whose rows name their "
                       "sequences (segment_ids_B: the engine's flat step)")
    positions_BT = cache.num_cached_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    q_resid_BTC, q_nope_BTHN, q_pe_BTHR, latent_BTL = self.project(x_BTD, positions_BT)
    index_x_BTD, index_q_BTC = x_BTD, q_resid_BTC
    if plan.indexer_loss is not None:  # the indexer learns only from its own KL
      index_x_BTD, index_q_BTC = jax.lax.stop_gradient((x_BTD, q_resid_BTC))
    # Both caches are written before any routing consequence: decode reads them later.
    keys_BTI = None
    if self.indexer is not None:
      with jax.named_scope("indexer_cache_update"):
        keys_BTI = self.indexer.keys(index_x_BTD, positions_BT)
    new_cache = cache.write(latent_BTL, keys_BTI, new_lens_B)
    index_logits_BTS = None
    if plan.indexer_loss is not None and self.indexer is not None:
      keys, key_rows_BS = new_cache.index_keys(plan.kv_rows)
      index_logits_BTS = self.indexer.logits(index_x_BTD, index_q_BTC, positions_BT, keys,
                                             self.ops, key_rows_BS=key_rows_BS)
    return PreparedStep(x_BTD, positions_BT, q_resid_BTC, q_nope_BTHN, q_pe_BTHR,
                        cache.num_cached_B, new_lens_B, new_cache, index_logits_BTS)

  def _select(self, step: PreparedStep, plan: StepPlan, shared_topk_BTK):
    """The top-k of a route that needs it: shared, from the loss's logits, or scored here."""
    if self.shares_topk:
      if shared_topk_BTK is None:
        raise ValueError("this shared-indexer layer takes the sparse route but was given no "
                         "top-k from a full layer of the same step")
      return shared_topk_BTK
    if step.index_logits_BTS is not None:
      return topk_indices(step.index_logits_BTS, self.config.indexer.topk)  # scored once
    if plan.key_chunk is not None:  # a flat step over a page pool: each row's own keys
      key_pool, key_rows = step.cache.index_key_pool()
      with jax.named_scope("indexer_score"):
        return self.indexer.select_in_blocks(
            step.x_BTD, step.q_resid_BTC, step.positions_BT, key_pool, key_rows, self.ops,
            blocks=step.cache.buffers.key_blocks, key_chunk=plan.key_chunk,
            context_topk=plan.context_topk)
    # A paged cache's keys are read in place: its pool and each position's physical row.
    keys, key_rows_BS = step.cache.index_keys(plan.kv_rows)
    with jax.named_scope("indexer_score"):
      return self.indexer.select(step.x_BTD, step.q_resid_BTC, step.positions_BT, keys,
                                 self.ops, chunk_size=self.index_chunk_size,
                                 key_rows_BS=key_rows_BS)

  def _union_topk(self, plan: StepPlan) -> bool:
    """Whether this step's top-k is a union over context ranks (the pool-scoring route)."""
    return (plan.route is PrefillRoute.SPARSE_MQA and plan.key_chunk is not None
            and plan.context_topk == "union" and self.ops.context > 1)

  def _indexer_kl(self, step: PreparedStep, plan: StepPlan, selected_BTK):
    """Mean over real tokens of KL(head-summed main attention || softmax(indexer scores))."""
    latent_BSL = dense_latent(step.cache.rows(plan.kv_rows)[0], step.q_nope_BTHN.dtype)
    num_keys = latent_BSL.shape[1]
    if selected_BTK is None:
      keys_BTS = losses.causal_key_mask(step.positions_BT, step.cache.num_cached_B, num_keys)
    else:
      keys_BTS = losses.selected_key_mask(selected_BTK, num_keys)
    q_BTHL = self._absorbed_query(step.q_nope_BTHN, step.q_pe_BTHR)
    p_BTS = losses.head_summed_attention(q_BTHL, latent_BSL, keys_BTS, self.config.softmax_scale)
    kl_BT = losses.indexer_kl(p_BTS, step.index_logits_BTS, keys_BTS)
    real_BT = jnp.arange(kl_BT.shape[1])[None, :] < step.new_lens_B[:, None]
    return losses.token_mean(kl_BT, real_BT)


class MLAAttention(MLAAttentionBase):
  """MLA that may run short prefills in the dense MHA form (DeepSeek-V3, DSA with MHA)."""

  supports_dense_mha_prefill: ClassVar[bool] = True

  def _mha_operands(self, step: PreparedStep, plan: StepPlan):
    """Per-head ``(q_BTHQ, k_BSHQ, v_BSHV)`` of the MHA form, K/V decompressed from the
    latent rows of the (static) ``num_cached_tokens + T`` reachable keys, in logical order."""
    num_keys = plan.num_cached_tokens + plan.num_new_tokens
    return self._mha_form(step, step.cache.rows(num_keys)[0])

  def _mha_form(self, step: PreparedStep, stored_BSL):
    """``(q_BTHQ, k_BSHQ, v_BSHV)`` of the MHA form: the step's queries, and per-head keys
    and values decompressed from the stored latent rows ``stored_BSL`` (fp8 rows
    dequantized, so both forms read the same values)."""
    c = self.config
    w_uk_HNA, w_uv_HVA = self._kv_b_heads()
    dtype = step.q_nope_BTHN.dtype
    latent_BSL = dense_latent(stored_BSL, dtype)
    c_kv_BSA = latent_BSL[..., :c.kv_lora_rank]
    k_pe_BSR = latent_BSL[..., c.kv_lora_rank:]
    k_nope_BSHN = jnp.einsum("bsa,hna->bshn", c_kv_BSA, w_uk_HNA.astype(dtype),
                             preferred_element_type=jnp.float32).astype(dtype)
    v_BSHV = jnp.einsum("bsa,hva->bshv", c_kv_BSA, w_uv_HVA.astype(dtype),
                        preferred_element_type=jnp.float32).astype(dtype)
    k_pe_BSHR = jnp.broadcast_to(k_pe_BSR[:, :, None, :], (*k_pe_BSR.shape[:2], c.num_heads,
                                                           c.qk_rope_head_dim))
    k_BSHQ = jnp.concatenate([k_nope_BSHN, k_pe_BSHR], axis=-1)
    q_BTHQ = jnp.concatenate([step.q_nope_BTHN, step.q_pe_BTHR.astype(dtype)], axis=-1)
    return q_BTHQ, k_BSHQ, v_BSHV

  def forward_mha(self, step: PreparedStep, plan: StepPlan):
    """The DENSE_MHA route: causal attention over the decompressed keys: [B, T, H, V]."""
    if plan.segmented:
      return self._segmented_mha(step)
    q_BTHQ, k_BSHQ, v_BSHV = self._mha_operands(step, plan)
    out_BTHV, _ = self.dense_prefill_backend.dense_mha(
        q_BTHQ, k_BSHQ, v_BSHV, sm_scale=self.config.softmax_scale,
        q_offset_B=step.num_cached_B, kv_len_B=step.cache.num_cached_B)
    return out_BTHV

  def _segmented_mha(self, step: PreparedStep):
    """DENSE_MHA of a flat step (every sequence fresh): the rows, one token each, attend as
    one sequence of B tokens, each query to the keys of its own segment up to itself (rows of
    a sequence are consecutive and in order, so the causal rule holds within segments):
    [B, 1, H, V]."""
    rows_B1L = step.cache.latent_rows_at(step.num_cached_B[:, None])  # the rows just written
    q_B1HQ, k_B1HQ, v_B1HV = self._mha_form(step, rows_B1L)
    b = q_B1HQ.shape[0]
    flat = lambda x: x.reshape(1, b, *x.shape[2:])
    # Padding rows (no new token) get segment -1, so no real query sees their keys.
    segments_1T = jnp.where(step.new_lens_B > 0, step.cache.segment_ids_B, -1)[None]
    out_1THV, _ = self.dense_prefill_backend.dense_mha(
        flat(q_B1HQ), flat(k_B1HQ), flat(v_B1HV), sm_scale=self.config.softmax_scale,
        q_offset_B=jnp.zeros((1,), jnp.int32), kv_len_B=jnp.full((1,), b, jnp.int32),
        segment_ids_BT=segments_1T)
    return out_1THV.reshape(b, 1, *out_1THV.shape[2:])

  def forward_masked_mha(self, step: PreparedStep, plan: StepPlan, topk_BTK):
    """The MASKED_MHA route: the same MHA form, each query restricted to the causal keys of
    its (logical) top-k row; equals ``forward_mqa`` over those rows up to rounding: [B, T, H, V].

    Costs every causal pair at 2H(Q + V) FLOPs instead of K per query at 2H(L + A), which is
    why it only pays up to ``backend.masked_mha_max_tokens`` (docs/design.md §2, §6)."""
    q_BTHQ, k_BSHQ, v_BSHV = self._mha_operands(step, plan)
    out_BTHV, _ = self.masked_prefill_backend.masked_mha(
        q_BTHQ, k_BSHQ, v_BSHV, topk_BTK, sm_scale=self.config.softmax_scale,
        q_offset_B=step.num_cached_B, kv_len_B=step.cache.num_cached_B)
    return out_BTHV


class DeepseekV32Attention(MLAAttentionBase):
  """DeepSeek-V3.2's layer as in the reference engine: top-k MQA only, never dense MHA.

  It derives from the base and has no MHA method at all (no ``forward_mha``, no
  ``forward_masked_mha``), so no plan can route it dense or masked and its indexer always
  scores (the vLLM #52512 contract).
  """
