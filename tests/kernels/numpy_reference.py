"""Float64 NumPy ground truth for the three kernels, written independently of the jnp references.

Shared by the kernel tests (interpret mode) and the reference tests (the XLA backend's math).
"""

import numpy as np


def numpy_sparse_mqa(q, kv, topk, sm_scale, d_v):
  """float64 ground truth, written independently of the jnp reference."""
  q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
  T, H, _ = q.shape
  out, lse = np.zeros((T, H, d_v)), np.full((T, H), np.inf)
  for t in range(T):
    rows = [i for i in np.asarray(topk[t]) if 0 <= i < kv.shape[0]]
    if not rows:
      continue
    logits = q[t] @ kv[rows].T * sm_scale
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    out[t] = p @ kv[rows, :d_v] / p.sum(-1, keepdims=True)
    lse[t] = (m + np.log(p.sum(-1, keepdims=True)))[:, 0]
  return out, lse


def numpy_sparse_mqa_grad(q, kv, topk, sm_scale, d_v, dout, dlse):
  """float64 ``(dq, dkv)`` of ``numpy_sparse_mqa`` for the cotangents ``(dout, dlse)`` of
  ``(out, lse)``: a row a token selects twice gets both slots' gradients; invalid slots and
  empty rows add nothing."""
  q, kv, dout, dlse = (np.asarray(x, np.float64) for x in (q, kv, dout, dlse))
  dq, dkv = np.zeros_like(q), np.zeros_like(kv)
  for t in range(q.shape[0]):
    rows = [i for i in np.asarray(topk[t]) if 0 <= i < kv.shape[0]]
    if not rows:
      continue
    x, v = kv[rows], kv[rows, :d_v]
    logits = q[t] @ x.T * sm_scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v
    ds = p * (dout[t] @ v.T - (dout[t] * out).sum(-1, keepdims=True) + dlse[t][:, None])
    dq[t] = sm_scale * ds @ x
    dx = sm_scale * ds.T @ q[t]
    dx[:, :d_v] += p.T @ dout[t]
    np.add.at(dkv, rows, dx)
  return dq, dkv


def numpy_dequantize_rows(rows):
  """fp8 latent rows (``Fp8LatentRows``) in float64: each tile times its scale, then RoPE."""
  values = np.asarray(rows.values).astype(np.float64)
  scales = np.repeat(np.asarray(rows.scales, np.float64), rows.tile, axis=-1)
  return np.concatenate([values * scales, np.asarray(rows.rope).astype(np.float64)], -1)


def numpy_dense_mha(q, k, v, sm_scale, q_offset, kv_len, topk=None, segments=None):
  """Causal attention from ``q_offset`` over keys below ``kv_len``; given ``topk`` [T, K], each
  query sees only the keys its row names (-1, indices >= S and repeats select nothing more);
  given ``segments`` [T] (keys = queries), only the keys of its own segment."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  T, H, _ = q.shape
  out, lse = np.zeros((T, H, v.shape[-1])), np.full((T, H), np.inf)
  for t in range(T):
    keys = np.arange(min(q_offset + t + 1, kv_len, k.shape[0]))
    if topk is not None:
      keys = np.intersect1d(keys, np.asarray(topk[t]))
    if segments is not None:
      keys = keys[np.asarray(segments)[keys] == np.asarray(segments)[t]]
    if keys.size == 0:
      continue
    logits = np.einsum("hd,shd->hs", q[t], k[keys]) * sm_scale
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    out[t] = np.einsum("hs,shv->hv", p, v[keys]) / p.sum(-1, keepdims=True)
    lse[t] = (m + np.log(p.sum(-1, keepdims=True)))[:, 0]
  return out, lse


def numpy_indexer_logits(q, k, w, starts, ends, k_scale):
  q, k, w = (np.asarray(x, np.float64) for x in (q, k, w))
  logits = np.einsum("tg,tgs->ts", w, np.maximum(np.einsum("tgi,si->tgs", q, k), 0.0))
  if k_scale is not None:
    logits = logits * np.asarray(k_scale, np.float64)[None, :]
  cols = np.arange(k.shape[0])
  inside = (cols[None, :] >= np.asarray(starts)[:, None]) & (cols[None, :] < np.asarray(ends)[:, None])
  return np.where(inside, logits, -np.inf)


def numpy_pooled_indexer_logits(q, pool, w, starts, ends, pool_scale, key_rows):
  """``numpy_indexer_logits`` over the pool rows ``key_rows`` names; -inf where it names none."""
  key_rows = np.asarray(key_rows)
  has_key = (key_rows >= 0) & (key_rows < len(pool))
  safe = np.where(has_key, key_rows, 0)
  scale = None if pool_scale is None else np.asarray(pool_scale, np.float64)[safe]
  logits = numpy_indexer_logits(q, np.asarray(pool, np.float64)[safe], w, starts, ends, scale)
  return np.where(has_key[None, :], logits, -np.inf)


def assert_attention_matches(out, lse, ref_out, ref_lse, *, rtol, lse_rtol, lse_atol):
  """Kernel (out, LSE) against the float64 ground truth, including the empty-row contract.

  Interpret mode poisons fresh outputs with NaN, so "finite everywhere" also proves that every
  element (padded rows and heads included) was written.
  """
  np.testing.assert_array_equal(np.isfinite(np.asarray(out, np.float64)), True)
  lse = np.asarray(lse, np.float64)
  assert not np.isnan(lse).any()
  out = np.asarray(out, np.float64)
  norm = np.linalg.norm(ref_out)
  if norm == 0:
    np.testing.assert_array_equal(out, 0.0)
  else:
    assert np.linalg.norm(out - ref_out) / norm < rtol
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
  empty = np.isinf(ref_lse)
  np.testing.assert_array_equal(out[empty], 0.0)
  np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=lse_rtol, atol=lse_atol)

