"""jit-compiled generation for ``V4CausalLM``: one prefill program, one decode program.

The prompts (equal lengths: each row's positions are the same) run as one step from 0; each
new token is then a step of one with the caches donated, so a decode step writes its window
slot, compressed entries and compressor state in place. The caches hold
``prompt + max_new_tokens`` tokens.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.decoding.requests import check_fits, checked_prompt
from mla_jax.decoding.sampling import SamplingConfig, sample
from mla_jax.generation.loop import TokenRates
from mla_jax.progress import progress_bar
from mla_jax.v4.model import V4CausalLM


@dataclasses.dataclass
class V4GenerationResult(TokenRates):
  tokens: list[list[int]]
  selections: list[str]  # per layer: its type and what it selects among compressed entries
  compile_s: float
  prefill_s: float
  decode_s: float
  prefill_tokens: int
  decode_tokens: int


def _step(graphdef, state, ids_BT, caches, start_B, key, sampling: SamplingConfig):
  model = nnx.merge(graphdef, state)
  logits, caches = model(ids_BT, caches, start_B)
  return sample(logits[:, -1], key, sampling), caches


# The caches are donated: a step writes its window slots, entries and compressor state in place.
step_program = jax.jit(_step, static_argnums=(0, 6), donate_argnums=(3,))


def generate(model: V4CausalLM, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id=None,
             progress: bool = False) -> V4GenerationResult:
  """Up to ``max_new_tokens`` tokens after each prompt (a list of id lists, equal lengths).

  ``eos_id`` (an id or a collection of ids): a row stops after producing one; decoding
  stops when every row has.
  """
  if not isinstance(model, V4CausalLM):
    raise TypeError(f"model must be a V4CausalLM, got {type(model).__name__}")
  config = model.config
  prompts = [checked_prompt(p, config.vocab_size, f"prompt {i}")
             for i, p in enumerate(prompt_ids)]
  if not prompts:
    raise ValueError("prompt_ids is empty; pass at least one prompt")
  if len({len(p) for p in prompts}) != 1:
    raise ValueError(f"DeepSeek-V4 generation takes prompts of one length, got lengths "
                     f"{sorted({len(p) for p in prompts})}")
  if type(max_new_tokens) is not int or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  sampling = SamplingConfig(temperature=temperature, top_p=top_p)
  num_prompt = len(prompts[0])
  check_fits(num_prompt, max_new_tokens, config.max_position_embeddings)
  eos = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
  batch = len(prompts)
  capacity = num_prompt + max_new_tokens
  caches = model.init_cache(batch, capacity)
  selections = [f"{layer.self_attn.layer_type}: compressed {selection.value}"
                for layer, selection in zip(model.model.layers, model.selections(caches))]
  graphdef, state = nnx.split(model)
  key = jax.random.key(seed)

  ids_BT = jnp.asarray(prompts, jnp.int32)
  start_B = jnp.zeros((batch,), jnp.int32)
  t0 = time.perf_counter()
  prefill = step_program.lower(graphdef, state, ids_BT, caches, start_B, key, sampling).compile()
  one_B = jnp.zeros((batch, 1), jnp.int32)
  decode = step_program.lower(graphdef, state, one_B, caches, start_B, key, sampling).compile()
  compile_s = time.perf_counter() - t0

  t0 = time.perf_counter()
  next_B, caches = prefill(state, ids_BT, caches, start_B, jax.random.fold_in(key, 0))
  next_B = np.asarray(next_B)
  prefill_s = time.perf_counter() - t0
  tokens = [[int(t)] for t in next_B]
  done = np.array([t in eos for t in next_B])
  t0 = time.perf_counter()
  bar = progress_bar(max_new_tokens - 1, "decode", unit="tok", enabled=progress)
  decoded = 0
  for i in range(1, max_new_tokens):
    if done.all():
      break
    start_B = jnp.full((batch,), num_prompt + i - 1, jnp.int32)
    next_B, caches = decode(state, jnp.asarray(next_B[:, None], jnp.int32), caches, start_B,
                            jax.random.fold_in(key, i))
    next_B = np.asarray(next_B)
    for row, t in enumerate(next_B):
      if not done[row]:
        tokens[row].append(int(t))
        done[row] = t in eos
    decoded += 1
    bar.update(1)
  bar.close()
  decode_s = time.perf_counter() - t0
  return V4GenerationResult(tokens=tokens, selections=selections, compile_s=compile_s,
                            prefill_s=prefill_s, decode_s=decode_s,
                            prefill_tokens=batch * num_prompt, decode_tokens=batch * decoded)
