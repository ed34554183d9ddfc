"""A float64 NumPy DeepSeek-V4 forward, written from the formulas (docs/models.md) for tests.

Stateless and whole-sequence, as HF's forward without a cache: every compressed entry is
pooled from the full sequence, every query attends to its window and its entries by one
explicit softmax with the sink. No code is shared with ``mla_jax.v4``; parameters are read
from a model's ``nnx.state`` by path.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.rope import rope_inv_freq
from mla_jax.v4.config import CSA, HASH_MOE, SLIDING, V4Config


def params_of(model) -> dict:
  """``{"a.b.c": float64 / int array}`` of every variable of ``model``."""
  return {".".join(map(str, path)): np.asarray(var[...]).astype(
      np.float64 if jnp.issubdtype(var.dtype, jnp.floating) else np.int64)
          for path, var in nnx.state(model).flat_state()}


def rms(x, eps, weight=None):
  out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return out if weight is None else out * weight


def rotate(x, pos, rope, *, inverse=False):
  """Interleaved RoPE on the last axis of ``x`` (the rope slice), angle ``pos * theta_i``."""
  ang = np.asarray(pos, np.float64)[..., None] * rope_inv_freq(rope, x.shape[-1])
  if x.ndim == ang.ndim + 1:
    ang = ang[..., None, :]
  cos, sin = np.cos(ang), np.sin(ang) * (-1 if inverse else 1)
  re, im = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = re * cos - im * sin, re * sin + im * cos
  return out


def rope_tail(x, pos, rope, r, **kw):
  return np.concatenate([x[..., :-r], rotate(x[..., -r:], pos, rope, **kw)], -1)


def softmax(x, axis):
  x = x - np.max(x, axis=axis, keepdims=True)
  e = np.exp(x)
  return e / e.sum(axis=axis, keepdims=True)


def compress(x_TD, p, prefix, *, width, m, overlap, rope, r, eps):
  """Entries [T // m, width] of a whole sequence (HF's stateless compressor)."""
  n = x_TD.shape[0] // m
  kv = x_TD[:n * m] @ p[f"{prefix}.kv_proj.weight"].T
  gate = x_TD[:n * m] @ p[f"{prefix}.gate_proj.weight"].T
  kv = kv.reshape(n, m, kv.shape[-1])
  gate = gate.reshape(n, m, gate.shape[-1]) + p[f"{prefix}.position_bias"]
  if overlap:
    prev_kv = np.concatenate([np.zeros((1, m, width)), kv[:-1, :, :width]])
    prev_gate = np.concatenate([np.full((1, m, width), -np.inf), gate[:-1, :, :width]])
    kv = np.concatenate([prev_kv, kv[:, :, width:]], axis=1)
    gate = np.concatenate([prev_gate, gate[:, :, width:]], axis=1)
  pooled = (softmax(gate, axis=1) * kv).sum(1)
  entries = rms(pooled, eps, p[f"{prefix}.kv_norm.weight"])
  return rope_tail(entries, np.arange(n) * m, rope, r)


def attention(x_TD, p, pre, config: V4Config, layer_type):
  c = config
  t = x_TD.shape[0]
  h, dh, r, eps = c.num_attention_heads, c.head_dim, c.rope_dim, c.rms_norm_eps
  rope = c.main_rope if layer_type == SLIDING else c.compress_rope
  pos = np.arange(t)
  q_res = rms(x_TD @ p[f"{pre}.q_a_proj.weight"].T, eps, p[f"{pre}.q_a_norm.weight"])
  q = rms((q_res @ p[f"{pre}.q_b_proj.weight"].T).reshape(t, h, dh), eps)
  q = rope_tail(q, pos, rope, r)
  kv = rope_tail(rms(x_TD @ p[f"{pre}.kv_proj.weight"].T, eps, p[f"{pre}.kv_norm.weight"]),
                 pos, rope, r)
  mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < c.sliding_window)
  keys = kv
  if layer_type != SLIDING:
    m = c.compress_ratio(layer_type)
    entries = compress(x_TD, p, f"{pre}.compressor", width=dh, m=m, overlap=layer_type == CSA,
                       rope=c.compress_rope, r=r, eps=eps)
    visible = np.arange(len(entries))[None, :] < ((pos + 1) // m)[:, None]
    if layer_type == CSA:
      g, i = c.index_n_heads, c.index_head_dim
      ikeys = compress(x_TD, p, f"{pre}.indexer", width=i, m=m, overlap=True,
                       rope=c.compress_rope, r=r, eps=eps)
      iq = rope_tail((q_res @ p[f"{pre}.indexer.q_b_proj.weight"].T).reshape(t, g, i), pos,
                     c.compress_rope, r)
      w = (x_TD @ p[f"{pre}.indexer.weights_proj.weight"].T) * g**-0.5 * i**-0.5
      scores = np.einsum("tg,tgs->ts", w, np.maximum(np.einsum("tgi,si->tgs", iq, ikeys), 0))
      scores = np.where(visible, scores, -np.inf)
      chosen = np.zeros_like(visible)
      for row in range(t):
        top = np.argsort(-scores[row], kind="stable")[:c.index_topk]
        chosen[row, top[np.isfinite(scores[row, top])]] = True
      visible = chosen
    keys = np.concatenate([kv, entries])
    mask = np.concatenate([mask, visible], axis=1)
  logits = np.einsum("thl,sl->ths", q, keys) * dh**-0.5
  logits = np.where(mask[:, None, :], logits, -np.inf)
  sink = np.broadcast_to(p[f"{pre}.sinks"][None, :, None], (t, h, 1))
  probs = softmax(np.concatenate([logits, sink], -1), -1)[..., :-1]
  out = rope_tail(np.einsum("ths,sl->thl", probs, keys), pos, rope, r, inverse=True)
  groups = c.o_groups
  w_a = p[f"{pre}.o_a_proj.weight"].reshape(groups, c.o_lora_rank, -1)
  grouped = np.einsum("tgx,gox->tgo", out.reshape(t, groups, -1), w_a).reshape(t, -1)
  return grouped @ p[f"{pre}.o_b_proj.weight"].T


def hyper(streams_TND, p, pre, config: V4Config):
  n, eps = config.hc_mult, config.hc_eps
  flat = rms(streams_TND.reshape(streams_TND.shape[0], -1), config.rms_norm_eps)
  mixes = flat @ p[f"{pre}.fn"].T
  base, scale = p[f"{pre}.base"], p[f"{pre}.scale"]
  sig = lambda z: 1 / (1 + np.exp(-z))
  pre_w = sig(mixes[:, :n] * scale[0] + base[:n]) + eps
  post = 2 * sig(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
  comb = softmax((mixes[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n), -1) + eps
  comb = comb / (comb.sum(-2, keepdims=True) + eps)
  for _ in range(config.hc_sinkhorn_iters - 1):
    comb = comb / (comb.sum(-1, keepdims=True) + eps)
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
  return post, comb, np.einsum("tn,tnd->td", pre_w, streams_TND)


def swiglu(x, gate_w, up_w, down_w, limit):
  gate, up = np.minimum(x @ gate_w.T, limit), np.clip(x @ up_w.T, -limit, limit)
  return (gate / (1 + np.exp(-gate)) * up) @ down_w.T


def moe(x_TD, ids_T, p, pre, config: V4Config, mlp_type):
  logits = x_TD @ p[f"{pre}.gate.weight"].T
  scores = {"sqrtsoftplus": lambda z: np.sqrt(np.logaddexp(0, z)),
            "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
            "softmax": lambda z: softmax(z, -1)}[config.scoring_func](logits)
  k = config.num_experts_per_tok
  if mlp_type == HASH_MOE:
    idx = p[f"{pre}.gate.tid2eid"][ids_T]
  else:
    idx = np.argsort(-(scores + p[f"{pre}.gate.e_score_correction_bias"]), -1,
                     kind="stable")[:, :k]
  weights = np.take_along_axis(scores, idx, -1)
  weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * config.routed_scaling_factor
  out = np.zeros_like(x_TD)
  for t in range(x_TD.shape[0]):
    for j in range(k):
      e = idx[t, j]
      out[t] += weights[t, j] * swiglu(x_TD[t], p[f"{pre}.experts.gate_proj"][e],
                                       p[f"{pre}.experts.up_proj"][e],
                                       p[f"{pre}.experts.down_proj"][e], config.swiglu_limit)
  shared = [p[f"{pre}.shared_experts.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")]
  return out + swiglu(x_TD, *shared, config.swiglu_limit)


def decoder_layer(streams, ids_T, p, pre, config: V4Config, layer_type, mlp_type):
  """One block's attention and MoE, each read from and written back to the mHC streams."""
  eps = config.rms_norm_eps
  for hc, block in (("attn_hc", "attn"), ("ffn_hc", "ffn")):
    post, comb, collapsed = hyper(streams, p, f"{pre}.{hc}", config)
    if block == "attn":
      out = attention(rms(collapsed, eps, p[f"{pre}.input_layernorm.weight"]), p,
                      f"{pre}.self_attn", config, layer_type)
    else:
      out = moe(rms(collapsed, eps, p[f"{pre}.post_attention_layernorm.weight"]), ids_T, p,
                f"{pre}.mlp", config, mlp_type)
    streams = post[..., None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", comb, streams)
  return streams


def final_streams(p: dict, config: V4Config, ids_T) -> np.ndarray:
  """The residual streams [T, N, D] after the last layer, before ``hc_head``."""
  x = p["model.embed_tokens.weight"][ids_T]
  streams = np.repeat(x[:, None, :], config.hc_mult, axis=1)
  for i, (layer_type, mlp_type) in enumerate(zip(config.layer_types, config.mlp_layer_types)):
    streams = decoder_layer(streams, ids_T, p, f"model.layers.{i}", config, layer_type,
                            mlp_type)
  return streams


def logits_of(streams, p, config: V4Config, hc_head="model.hc_head",
              norm="model.norm.weight"):
  """``hc_head``'s collapse of the streams, the final norm, the LM head."""
  eps = config.rms_norm_eps
  flat = rms(streams.reshape(streams.shape[0], -1), eps)
  sig = lambda z: 1 / (1 + np.exp(-z))
  head_pre = sig(flat @ p[f"{hc_head}.hc_fn"].T * p[f"{hc_head}.hc_scale"]
                 + p[f"{hc_head}.hc_base"]) + config.hc_eps
  hidden = rms(np.einsum("tn,tnd->td", head_pre, streams), eps, p[norm])
  head = p["model.embed_tokens.weight"] if config.tie_word_embeddings else p["lm_head.weight"]
  return hidden @ head.T


def forward(p: dict, config: V4Config, ids_T) -> np.ndarray:
  """Logits [T, V] of one sequence."""
  return logits_of(final_streams(p, config, ids_T), p, config)


def mtp(p: dict, config: V4Config, streams_TND, next_ids_T, index: int = 0):
  """MTP layer ``index`` over a whole sequence from position 0 (docs/models.md): its logits
  [T, V] and output streams. Row t pairs ``streams_TND[t]`` with token ``next_ids_T[t]``."""
  pre, eps = f"mtp.{index}", config.rms_norm_eps
  embed = p["model.embed_tokens.weight"][next_ids_T]
  embed[0] = 0  # position 0's embedding is masked
  x = (rms(streams_TND, eps, p[f"{pre}.hnorm.weight"]) @ p[f"{pre}.h_proj.weight"].T
       + (rms(embed, eps, p[f"{pre}.enorm.weight"]) @ p[f"{pre}.e_proj.weight"].T)[:, None])
  out = decoder_layer(x, next_ids_T, p, f"{pre}.block", config, SLIDING, "moe")
  return logits_of(out, p, config, f"{pre}.hc_head", f"{pre}.norm.weight"), out
