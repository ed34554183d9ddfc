"""Training losses: next-token cross entropy and the lightning indexer's KL losses.

DeepSeek-V3.2 trains the indexer to imitate the main attention. For query t over a key set
S_t the loss is ``KL(p_t || softmax(I_t))``, where ``p_t`` is the main attention of query t
summed over heads and L1-normalised over S_t (a fixed target: no gradient flows into it) and
``I_t`` are the indexer's scores:

* dense warm-up: S_t is every causal key;
* sparse training: S_t is the top-k set the layer attended, and ``p_t`` over it is exactly
  the attention the layer ran.

Both are written with dense [B, T, S] key masks: simple and exact, and O(T*S) memory, which
is fine for the short sequences trained here (a long-context trainer would gather instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_loss(logits_BTV, ids_BT, lens_B, target_mask_BT):
  """Mean cross entropy of predicting token t from position t - 1.

  Args:
    logits_BTV: float logits of every position.
    ids_BT: int token ids, right-padded.
    lens_B: real tokens per sequence; padding targets never count.
    target_mask_BT: which tokens are training targets (token 0 never is: nothing predicts it).

  Returns:
    ``(loss, num_targets)``: the mean over counted targets (0 when there are none) and their
    number.
  """
  t_T = jnp.arange(ids_BT.shape[1])
  counted_BT = (target_mask_BT > 0) & (t_T[None, :] < lens_B[:, None]) & (t_T[None, :] > 0)
  log_probs_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  target_log_probs_BT = jnp.take_along_axis(log_probs_BTV, ids_BT[:, 1:, None], axis=-1)[..., 0]
  counted_BT = counted_BT[:, 1:]
  num_targets = counted_BT.sum()
  total = jnp.where(counted_BT, -target_log_probs_BT, 0.0).sum()
  return total / jnp.maximum(num_targets, 1), num_targets


def causal_key_mask(positions_BT, kv_len_B, num_keys: int):
  """bool [B, T, S]: key s is visible to query t (s <= its position and s < kv_len)."""
  s_S = jnp.arange(num_keys, dtype=jnp.int32)
  return (s_S[None, None, :] <= positions_BT[..., None]) & (s_S[None, None, :]
                                                             < kv_len_B[:, None, None])


def selected_key_mask(topk_BTK, num_keys: int):
  """bool [B, T, S]: key s is in query t's top-k set (-1 entries select nothing)."""
  b, t, _ = topk_BTK.shape
  idx_BTK = jnp.where(topk_BTK < 0, num_keys, topk_BTK)  # out of range: dropped below
  b_BTK = jnp.arange(b)[:, None, None]
  t_BTK = jnp.arange(t)[None, :, None]
  return jnp.zeros((b, t, num_keys), bool).at[b_BTK, t_BTK, idx_BTK].set(True, mode="drop")


def head_summed_attention(q_BTHL, latent_BSL, keys_BTS, sm_scale: float):
  """The main attention of each query, summed over heads and L1-normalised over its keys.

  Args:
    q_BTHL: absorbed-form queries [q_lat | q_pe] per head (the MQA form gives the same
      logits as the MHA form).
    latent_BSL: the latent rows [c_kv | k_pe].
    keys_BTS: which keys each query attends.
    sm_scale: the main attention's softmax scale.

  Returns:
    float32 [B, T, S] summing to 1 over each row's keys; all zeros for a row without keys.
  """
  logits_BTHS = jnp.einsum("bthl,bsl->bths", q_BTHL.astype(jnp.float32),
                           latent_BSL.astype(jnp.float32)) * sm_scale
  mask_BT1S = keys_BTS[:, :, None, :]
  logits_BTHS = jnp.where(mask_BT1S, logits_BTHS, -jnp.inf)
  has_keys_BT11 = keys_BTS.any(-1)[:, :, None, None]
  probs_BTHS = jax.nn.softmax(jnp.where(has_keys_BT11, logits_BTHS, 0.0), axis=-1)
  summed_BTS = jnp.where(mask_BT1S, probs_BTHS, 0.0).sum(axis=2)
  return summed_BTS / jnp.maximum(summed_BTS.sum(-1, keepdims=True), 1e-30)


def indexer_kl(p_BTS, index_logits_BTS, keys_BTS):
  """``KL(p_t || softmax(I_t))`` per query over its keys: float32 [B, T].

  ``p_BTS`` is a target: it is stop-gradiented here, so only the indexer scores learn.
  Rows without keys give 0.
  """
  p_BTS = jax.lax.stop_gradient(p_BTS.astype(jnp.float32))
  has_keys_BT1 = keys_BTS.any(-1, keepdims=True)
  logits_BTS = jnp.where(keys_BTS, index_logits_BTS.astype(jnp.float32), -jnp.inf)
  log_q_BTS = jax.nn.log_softmax(jnp.where(has_keys_BT1, logits_BTS, 0.0), axis=-1)
  counted_BTS = keys_BTS & (p_BTS > 0)
  log_p_BTS = jnp.log(jnp.where(counted_BTS, p_BTS, 1.0))
  log_q_BTS = jnp.where(counted_BTS, log_q_BTS, 0.0)
  return jnp.where(counted_BTS, p_BTS * (log_p_BTS - log_q_BTS), 0.0).sum(-1)


def token_mean(values_BT, real_BT):
  """Mean of ``values_BT`` over the real tokens (0 when there are none)."""
  return jnp.where(real_BT, values_BT, 0.0).sum() / jnp.maximum(real_BT.sum(), 1)
