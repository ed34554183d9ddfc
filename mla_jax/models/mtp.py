"""Multi-token prediction layers (DeepSeek-V3 report §2.2), as DeepSeek-V3.2 and GLM-5 ship them.

MTP layer i is stored as HF ``model.layers.{num_layers + i}``. It reads two things at each
position p: the main model's hidden state at p and the embedding of the token at p + 1, and
predicts the token at p + 2 (one further per chained layer or draft step):

    x_BTD  = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])     # embedding first, as vLLM
    h'_BTD = block(x_BTD)                                      # one decoder layer, own cache
    logits = lm_head(shared_head.norm(h'_BTD))

- ``hnorm``'s input ``h_p`` is the main model's *final-normed* output (after ``model.norm``,
  the state its ``lm_head`` reads), as vLLM's ``DeepseekV2Model`` hands it to its MTP layer;
  a further draft step feeds back ``h'`` itself (before ``shared_head.norm``), as vLLM does.
- ``block`` is a ``DecoderLayer`` built as layer ``num_layers + i`` would be: MoE or dense
  MLP by the config's rule, the config's attention class, and an indexer of its own in a DSA
  model (an MTP layer has no full layer in its pass to share top-k with). Its cache is a
  ``LayerCache`` of its own whose row p holds the pair (h_p, t_{p+1}) at RoPE position p.
- The embedding and the LM head are the main model's (shared, §2.2). DeepSeek's and GLM's
  checkpoints store copies of both in every MTP layer (``embed_tokens``,
  ``shared_head.head``); the loader checks that they equal the main tensors and the writer
  writes them back (``hf_layout.mtp_shared_copies``), so none is held twice in memory.

vLLM also zeroes the embedding at position 0; this module does not (SGLang does not either):
the first pair of a prompt is the only one where the two differ.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mla_jax import checks
from mla_jax.cache import CacheView
from mla_jax.layers import Linear, RMSNorm
from mla_jax.step_plan import StepPlan


class SharedHead(nnx.Module):
  """HF's ``shared_head``: the norm before the (shared) LM head."""

  def __init__(self, hidden_size: int, *, eps: float, param_dtype):
    self.norm = RMSNorm(hidden_size, eps=eps, param_dtype=param_dtype)


class MTPLayer(nnx.Module):
  """One MTP layer around ``block`` (a ``DecoderLayer`` built for layer ``num_layers + i``).

  Parameters, by HF name below ``model.layers.{num_layers + i}``: ``enorm.weight``,
  ``hnorm.weight``, ``eh_proj.weight`` [D, 2D], ``shared_head.norm.weight``, and the block's
  own names (``self_attn.*``, ``mlp.*``, ``input_layernorm.weight``, ...) without a prefix.
  """

  def __init__(self, hidden_size: int, block: nnx.Module, *, eps: float, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    self.enorm = RMSNorm(hidden_size, eps=eps, param_dtype=param_dtype)
    self.hnorm = RMSNorm(hidden_size, eps=eps, param_dtype=param_dtype)
    self.eh_proj = Linear(2 * hidden_size, hidden_size, rngs=rngs, param_dtype=param_dtype)
    self.block = block
    self.shared_head = SharedHead(hidden_size, eps=eps, param_dtype=param_dtype)

  def __call__(self, embed_BTD, hidden_BTD, cache, plan: StepPlan, *, new_lens_B):
    """``(h'_BTD, attn)``: the block's output (before ``shared_head.norm``) and its
    attention's ``AttentionOutput`` (its cache with the T new rows written after
    ``cache.num_cached_B``; the indexer's KL when the plan asks for one)."""
    x_BTD = self.eh_proj(jnp.concatenate(
        [self.enorm(embed_BTD), self.hnorm(hidden_BTD.astype(embed_BTD.dtype))], axis=-1))
    return self.block.forward(x_BTD, cache, plan, new_lens_B=new_lens_B)


def check_mtp_inputs(config, index, hidden_BTD, next_ids_BT, mtp_caches) -> None:
  """``CausalLM.mtp_forward``'s arguments, each refused by name (shapes and types; the new
  lengths and the plan are checked where the main model checks its own)."""
  count = config.num_mtp_layers
  if not checks.is_int(index) or not 0 <= index < count:
    raise ValueError(f"MTP layer index must be an int in [0, {count}) (the model has {count} "
                     f"MTP layer(s)), got {index!r}")
  if (not isinstance(mtp_caches, tuple) or len(mtp_caches) != count
      or not all(isinstance(c, CacheView) for c in mtp_caches)):
    raise ValueError(f"mtp_caches must be init_mtp_cache's tuple of {count} LayerCache(s) "
                     f"(or paged cache views, as the engine's), "
                     f"got {type(mtp_caches).__name__}")
  if getattr(next_ids_BT, "ndim", None) != 2 or not jnp.issubdtype(next_ids_BT.dtype,
                                                                   jnp.integer):
    raise ValueError(f"next_ids must be an int array [batch, tokens], got "
                     f"{getattr(next_ids_BT, 'dtype', type(next_ids_BT).__name__)} of shape "
                     f"{getattr(next_ids_BT, 'shape', None)}")
  d = config.mla.hidden_size
  if getattr(hidden_BTD, "shape", None) != (*next_ids_BT.shape, d):
    raise ValueError(f"hidden must be [batch, tokens, {d}] = {(*next_ids_BT.shape, d)} to "
                     f"pair with next_ids, got shape {getattr(hidden_BTD, 'shape', None)}")
