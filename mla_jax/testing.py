"""Float64 NumPy references and random-input builders for users' own chex tests.

``mla_attention_reference`` recomputes one MLA layer in float64 from the module's parameters,
the way Hugging Face's eager path does (docs/design.md §12): the MHA form with the indexer's top-k
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


def _rope_magnitude(rope: RopeConfig) -> float:
  if rope.yarn is None or rope.yarn.factor <= 1:
    return 1.0
  ms = lambda m: 0.1 * m * math.log(rope.yarn.factor) + 1
  return ms(rope.yarn.mscale) / ms(rope.yarn.mscale_all_dim)


def indexer_keys_reference(params: dict[str, np.ndarray], config: MLAConfig, x_TD,
                           positions_T) -> np.ndarray:
  """The indexer keys of tokens ``x_TD`` at ``positions_T``, float64 [T, I], before the
  Hadamard rotation: ``LayerNorm(wk x)`` with RoPE (the indexer's pairing) on the first R dims.

  ``params`` are ``numpy_params`` of an attention module (``indexer.*`` names).
  """
  ic, r = config.indexer, config.qk_rope_head_dim
  x = np.asarray(x_TD, np.float64)
  pos = np.asarray(positions_T, np.float64)
  k = x @ params["indexer.wk.weight"].T
  k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + ic.norm_eps)
  k = k * params["indexer.k_norm.weight"] + params["indexer.k_norm.bias"]
  k[..., :r] = _rotate_pairs(k[..., :r], pos, _inv_freq(config.rope, r),
                             interleaved=ic.rope_interleave) * _rope_magnitude(config.rope)
  return k


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
  c, p = config, params
  x = np.asarray(x_TD, np.float64)
  t = x.shape[0]
  h, n, r, v, a = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                   c.kv_lora_rank)
  pos = np.arange(t, dtype=np.float64)
  inv_freq = _inv_freq(c.rope, r)
  mag, scale = _rope_magnitude(c.rope), (n + r) ** -0.5
  if c.rope.yarn is not None and c.rope.yarn.factor > 1:  # HF's yarn_get_mscale, recomputed
    scale *= (0.1 * c.rope.yarn.mscale_all_dim * math.log(c.rope.yarn.factor) + 1) ** 2
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
            + np.einsum("thr,sr->hts", q_pe, k_pe)) * scale
  allowed = np.tril(np.ones((t, t), bool))
  if c.indexer is not None and not dense:
    ic = c.indexer
    qi = (q_resid @ p["indexer.wq_b.weight"].T).reshape(t, ic.num_heads, ic.head_dim)
    ki = indexer_keys_reference(p, c, x, pos)
    qi[..., :r] = _rotate_pairs(qi[..., :r], pos, inv_freq, interleaved=ic.rope_interleave) * mag
    w = (x @ p["indexer.weights_proj.weight"].T) * ic.num_heads**-0.5
    dots = np.einsum("tgi,si->tgs", qi, ki) * ic.head_dim**-0.5
    scores = np.einsum("tg,tgs->ts", w, np.maximum(dots, 0.0))
    selected = np.zeros((t, t), bool)
    for row, cols in enumerate(indexer_topk_reference(scores, ic.topk)):
      selected[row, cols] = True
    allowed &= selected
  logits = np.where(allowed[None], logits, -np.inf)
  logits -= logits.max(-1, keepdims=True)
  probs = np.exp(logits)
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("hts,shv->thv", probs, val).reshape(t, h * v)
  return out @ p["o_proj.weight"].T


def relative_error(out, ref) -> float:
  """``||out - ref|| / ||ref||`` in float64."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
