"""Float64 NumPy references and random-input builders for users' own chex tests.

``mla_attention_reference`` recomputes one MLA layer in float64 from the module's parameters,
the way Hugging Face's eager path does (SPEC.md 10.5): the MHA form with the indexer's top-k
folded into the causal mask. It shares no code with the JAX implementation. Deliberate
deviations: the indexer's Hadamard rotation is omitted (it is orthogonal, so exact scores are
unchanged) and there is no fp8 quantization.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.config import MLAConfig, RopeConfig
from mla_jax.params import flat_params, set_flat_params


def randomize_params(module: nnx.Module, seed: int, *, norm_jitter: float = 0.1) -> None:
  """Gives every parameter fresh random values in place (norm weights near 1, never zeros).

  Freshly initialized norms are all ones and LayerNorm biases all zeros, which hides mistakes
  such as a skipped norm; tests should run on these randomized weights instead.
  """
  current = flat_params(module)
  keys = jax.random.split(jax.random.key(seed), len(current))
  new = {}
  for (name, leaf), key in zip(sorted(current.items()), keys):
    noise = jax.random.normal(key, leaf.shape, jnp.float32)
    if "norm" in name:  # RMSNorm / LayerNorm weights near 1, LayerNorm bias near 0
      value = (1.0 if name.endswith("weight") else 0.0) + norm_jitter * noise
    elif leaf.ndim >= 2:  # [..., out, in] matrices, possibly stacked over layers or experts
      value = noise * leaf.shape[-1] ** -0.5
    else:
      value = noise * 0.1
    new[name] = value.astype(leaf.dtype)
  set_flat_params(module, new)


def random_hidden(seed: int, shape, dtype=jnp.float32):
  """Standard-normal hidden states (fresh, never zeros)."""
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def numpy_params(module: nnx.Module) -> dict[str, np.ndarray]:
  """Flat ``{"q_a_proj.weight": float64 array}`` view of a module's parameters."""
  return {name: np.asarray(value, np.float64) for name, value in flat_params(module).items()}


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rotate_pairs(x, positions, inv_freq, *, interleaved: bool):
  """Rotates each (first, second) index pair by ``position * theta_k``, pair by pair."""
  half = x.shape[-1] // 2
  out = x.copy()
  for k in range(half):
    first, second = (2 * k, 2 * k + 1) if interleaved else (k, k + half)
    angle = positions * inv_freq[k]
    if x.ndim == 3:  # [T, heads, R]
      angle = angle[:, None]
    cos, sin = np.cos(angle), np.sin(angle)
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., first] * sin + x[..., second] * cos
  return out


def _inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
  base = 1.0 / rope.theta ** (np.arange(0, dim, 2) / dim)
  if rope.yarn is None:
    return base
  y = rope.yarn
  corr = lambda r: dim * math.log(y.original_max_position_embeddings / (r * 2 * math.pi)) / (
      2 * math.log(rope.theta))
  low, high = max(math.floor(corr(y.beta_fast)), 0), min(math.ceil(corr(y.beta_slow)), dim - 1)
  ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)
  return base * (1 - ramp) + base / y.factor * ramp


def indexer_topk_reference(scores_TS, topk: int) -> list[list[int]]:
  """Causal top-k per row of a [T, S] score matrix (row t sees s <= t); ties: lower index."""
  rows = []
  for t in range(scores_TS.shape[0]):
    visible = scores_TS[t, : t + 1]
    order = sorted(range(t + 1), key=lambda s: (-visible[s], s))
    rows.append(order[:topk])
  return rows


def layer_internals_reference(params, config: MLAConfig, x_TD):
  """Float64 internals of one MLA layer on one sequence from position 0: the main attention
  logits [H, T, S] (unmasked), the values [S, H, V] and the indexer scores [T, S] (None
  without an indexer)."""
  c, p = config, params
  x = np.asarray(x_TD, np.float64)
  t = x.shape[0]
  h, n, r, v, a = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                   c.kv_lora_rank)
  pos = np.arange(t, dtype=np.float64)
  inv_freq = _inv_freq(c.rope, r)
  mag = 1.0
  if c.rope.yarn is not None and c.rope.yarn.factor > 1:
    ms = lambda m: 0.1 * m * math.log(c.rope.yarn.factor) + 1
    mag = ms(c.rope.yarn.mscale) / ms(c.rope.yarn.mscale_all_dim)
  q_resid = _rms(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], c.latent_norm_eps)
  q = (q_resid @ p["q_b_proj.weight"].T).reshape(t, h, n + r)
  q_pe = _rotate_pairs(q[..., n:], pos, inv_freq, interleaved=True) * mag
  kv = x @ p["kv_a_proj_with_mqa.weight"].T
  c_kv = _rms(kv[:, :a], p["kv_a_layernorm.weight"], c.latent_norm_eps)
  k_pe = _rotate_pairs(kv[:, a:], pos, inv_freq, interleaved=True) * mag
  w_kvb = p["kv_b_proj.weight"].reshape(h, n + v, a)
  k_nope = np.einsum("sa,hna->shn", c_kv, w_kvb[:, :n])
  val = np.einsum("sa,hva->shv", c_kv, w_kvb[:, n:])
  logits = (np.einsum("thn,shn->hts", q[..., :n], k_nope)
            + np.einsum("thr,sr->hts", q_pe, k_pe)) * c.softmax_scale
  scores = None
  if c.indexer is not None:
    ic = c.indexer
    qi = (q_resid @ p["indexer.wq_b.weight"].T).reshape(t, ic.num_heads, ic.head_dim)
    ki = x @ p["indexer.wk.weight"].T
    ki = (ki - ki.mean(-1, keepdims=True)) / np.sqrt(ki.var(-1, keepdims=True) + ic.norm_eps)
    ki = ki * p["indexer.k_norm.weight"] + p["indexer.k_norm.bias"]
    qi[..., :r] = _rotate_pairs(qi[..., :r], pos, inv_freq, interleaved=ic.rope_interleave) * mag
    ki[..., :r] = _rotate_pairs(ki[..., :r], pos, inv_freq, interleaved=ic.rope_interleave) * mag
    w = (x @ p["indexer.weights_proj.weight"].T) * ic.num_heads**-0.5
    dots = np.einsum("tgi,si->tgs", qi, ki) * ic.head_dim**-0.5
    scores = np.einsum("tg,tgs->ts", w, np.maximum(dots, 0.0))
  return logits, val, scores


def _softmax_rows(logits, allowed):
  logits = np.where(allowed, logits, -np.inf)
  logits = logits - logits.max(-1, keepdims=True)
  probs = np.exp(logits)
  return probs / probs.sum(-1, keepdims=True)


def mla_attention_reference(params: dict[str, np.ndarray], config: MLAConfig, x_TD,
                            *, dense: bool = False) -> np.ndarray:
  """One MLA layer over a whole sequence starting at position 0, in float64.

  Args:
    params: ``numpy_params(module)`` of an ``MLAAttention``-family module.
    config: its config.
    x_TD: the layer input for one sequence.
    dense: ignore the indexer (plain causal MLA).

  Returns:
    float64 [T, D] layer output.
  """
  logits, val, scores = layer_internals_reference(params, config, x_TD)
  t = logits.shape[1]
  allowed = np.tril(np.ones((t, t), bool))
  if scores is not None and not dense:
    selected = np.zeros((t, t), bool)
    for row, cols in enumerate(indexer_topk_reference(scores, config.indexer.topk)):
      selected[row, cols] = True
    allowed &= selected
  probs = _softmax_rows(logits, allowed[None])
  out = np.einsum("hts,shv->thv", probs, val).reshape(t, -1)
  return out @ params["o_proj.weight"].T


def indexer_capture_reference(params: dict[str, np.ndarray], config: MLAConfig,
                              x_TD) -> np.ndarray:
  """Per query, the share of its main attention (over causal keys, summed over heads and
  L1-normalised) that falls on the keys its indexer selects: float64 [T], 1 when the top-k
  holds every causal key. Measures how well the indexer imitates the attention."""
  logits, _, scores = layer_internals_reference(params, config, x_TD)
  t = logits.shape[1]
  causal = np.tril(np.ones((t, t), bool))
  p = _softmax_rows(logits, causal[None]).sum(0)
  p /= p.sum(-1, keepdims=True)
  selected = np.zeros((t, t), bool)
  for row, cols in enumerate(indexer_topk_reference(scores, config.indexer.topk)):
    selected[row, cols] = True
  return (p * selected).sum(-1)


def indexer_kl_reference(params: dict[str, np.ndarray], config: MLAConfig, x_TD,
                         selected_TS=None) -> tuple[float, np.ndarray]:
  """DeepSeek-V3.2's indexer loss for one layer and sequence, in float64.

  ``KL(p_t || softmax(I_t))`` over each query's key set, averaged over queries: the causal
  keys, or ``selected_TS`` (bool [T, S]) when given (the sparse stage's top-k sets). ``p_t`` is
  the main attention over that set, summed over heads and L1-normalised.

  Returns:
    ``(mean KL, scores_TS)``: the indexer scores let a test check a top-k set it passes in.
  """
  logits, _, scores = layer_internals_reference(params, config, x_TD)
  t = logits.shape[1]
  keys = np.tril(np.ones((t, t), bool))
  if selected_TS is not None:
    keys &= np.asarray(selected_TS, bool)
  p = _softmax_rows(logits, keys[None]).sum(0)
  p /= p.sum(-1, keepdims=True)
  counted = keys & (p > 0)
  log_p = np.log(np.where(counted, p, 1.0))
  log_q = np.log(np.where(counted, _softmax_rows(scores, keys), 1.0))
  kl = (p * (log_p - log_q)).sum(-1)
  return float(kl.mean()), scores


def relative_error(out, ref) -> float:
  """``||out - ref|| / ||ref||`` in float64."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
