"""jit-compiled generation for ``V4CausalLM``: one prefill program, one decode program.

The prompts (equal lengths: each row's positions are the same) run as one step from 0; each
new token is then a step of one with the caches donated, so a decode step writes its window
slot, compressed entries and compressor state in place. The caches hold
``prompt + max_new_tokens`` tokens.

With ``speculative_tokens=k`` (a model with MTP layers) the prefill also runs MTP layer 0,
and each decode step is one iteration of the shared speculative decoding
(``mla_jax.v4.speculative``): k drafts, one verification of k + 1 tokens, the accepted ones
kept. The caches then hold k more tokens and their rings k spare slots.
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
from mla_jax.decoding.speculative import MAX_SPECULATIVE_TOKENS
from mla_jax.generation import speculative
from mla_jax.generation.loop import TokenRates
from mla_jax.generation.speculative import DraftState
from mla_jax.progress import progress_bar
from mla_jax.v4.model import V4CausalLM
from mla_jax.v4.speculative import PositionalCaches, SpeculativeView, Width


@dataclasses.dataclass
class V4GenerationResult(TokenRates):
  tokens: list[list[int]]
  selections: list[str]  # per layer: its type and what it selects among compressed entries
  compile_s: float
  prefill_s: float
  decode_s: float
  prefill_tokens: int
  decode_tokens: int
  drafted: int = 0  # speculative decoding: draft tokens proposed
  accepted: int = 0  # ... and accepted

  @property
  def acceptance_rate(self) -> float | None:
    """Accepted draft tokens / proposed ones; None without speculative decoding."""
    return self.accepted / self.drafted if self.drafted else None


def _step(graphdef, state, ids_BT, caches, start_B, key, sampling: SamplingConfig):
  model = nnx.merge(graphdef, state)
  logits, caches = model(ids_BT, caches, start_B)
  return sample(logits[:, -1], key, sampling), caches


# The caches are donated: a step writes its window slots, entries and compressor state in place.
step_program = jax.jit(_step, static_argnums=(0, 6), donate_argnums=(3,))


def _speculative_prefill(graphdef, state, caches, mtp_caches, ids_BT, key,
                         sampling: SamplingConfig):
  lens_B = jnp.full((ids_BT.shape[0],), ids_BT.shape[1], jnp.int32)
  return speculative.prefill(SpeculativeView(nnx.merge(graphdef, state)), caches, mtp_caches,
                             ids_BT, lens_B, key, plan=None, sampling=sampling)


def _speculative_iteration(graphdef, state, caches, mtp_caches, draft, key, max_new,
                           k: int, sampling: SamplingConfig, eos: tuple[int, ...] | None):
  return speculative.iteration(SpeculativeView(nnx.merge(graphdef, state)), caches, mtp_caches,
                               draft, key, max_new, verify_plan=Width(k + 1), draft_plan=None,
                               sampling=sampling, eos_id=eos)


speculative_prefill_program = jax.jit(_speculative_prefill, static_argnums=(0, 6),
                                      donate_argnums=(2, 3))
speculative_program = jax.jit(_speculative_iteration, static_argnums=(0, 7, 8, 9),
                              donate_argnums=(2, 3))


def generate(model: V4CausalLM, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id=None, progress: bool = False,
             speculative_tokens: int = 0) -> V4GenerationResult:
  """Up to ``max_new_tokens`` tokens after each prompt (a list of id lists, equal lengths).

  ``eos_id`` (an id or a collection of ids): a row stops after producing one; decoding
  stops when every row has. ``speculative_tokens`` k > 0 drafts k tokens a step with the
  model's MTP layers (module docstring); greedy tokens are plain decoding's, sampled ones
  have its distribution.
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
  k = speculative_tokens
  if type(k) is not int or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
    raise ValueError(f"speculative_tokens must be an int in [0, {MAX_SPECULATIVE_TOKENS}], "
                     f"got {k!r}")
  if k and not config.num_mtp_layers:
    raise ValueError("speculative_tokens needs MTP layers to draft with; the model has none "
                     "(load a checkpoint holding them: v4.load_pretrained(..., mtp=True))")
  sampling = SamplingConfig(temperature=temperature, top_p=top_p)
  num_prompt = len(prompts[0])
  check_fits(num_prompt, max_new_tokens + k, config.max_position_embeddings)
  eos = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
  batch = len(prompts)
  caches = model.init_cache(batch, num_prompt + max_new_tokens + k, spare=k)
  selections = [f"{layer.self_attn.layer_type}: compressed {selection.value}"
                for layer, selection in zip(model.model.layers, model.selections(caches))]
  graphdef, state = nnx.split(model)
  key = jax.random.key(seed)
  ids_BT = jnp.asarray(prompts, jnp.int32)
  run = _speculate if k else _decode
  result = run(graphdef, state, model, caches, ids_BT, key, sampling, max_new_tokens, eos, k,
               progress)
  return V4GenerationResult(selections=selections, prefill_tokens=batch * num_prompt, **result)


def _decode(graphdef, state, model, caches, ids_BT, key, sampling, max_new_tokens, eos, k,
            progress):
  """Plain decoding: the prefill, then a step of one token at a time."""
  batch, num_prompt = ids_BT.shape
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
  return dict(tokens=tokens, compile_s=compile_s, prefill_s=prefill_s,
              decode_s=time.perf_counter() - t0, decode_tokens=batch * decoded)


def _speculate(graphdef, state, model, caches, ids_BT, key, sampling, max_new_tokens, eos, k,
               progress):
  """Speculative decoding: the MTP prefill, then iterations until every row has its tokens
  or its end-of-sequence id (``mla_jax.v4.speculative``)."""
  batch, num_prompt = ids_BT.shape
  zeros = lambda: jnp.zeros((batch,), jnp.int32)  # one buffer each: they are donated
  caches = PositionalCaches(caches, zeros())
  mtp_caches = tuple(PositionalCaches(c, zeros()) for c in model.init_mtp_cache(
      batch, num_prompt + max_new_tokens + k, spare=k))
  eos_ids = tuple(sorted(eos)) or None
  t0 = time.perf_counter()
  prefill = speculative_prefill_program.lower(graphdef, state, caches, mtp_caches, ids_BT, key,
                                              sampling).compile()
  compile_s = time.perf_counter() - t0

  t0 = time.perf_counter()
  first_B, caches, mtp_caches, draft_BV, hidden_BND = prefill(state, caches, mtp_caches,
                                                              ids_BT, key)
  rows = [[int(t)] for t in np.asarray(first_B)]
  prefill_s = time.perf_counter() - t0
  ended = lambda: np.array([len(r) >= max_new_tokens or r[-1] in eos for r in rows])
  count = lambda value: jnp.full((batch,), value, jnp.int32)
  draft = DraftState(tokens_B=first_B, draft_BV=draft_BV, hidden_BD=hidden_BND,
                     done_B=jnp.asarray(ended()), emitted_B=count(1), accepted_B=count(0),
                     drafted_B=count(0))
  max_new = jnp.int32(max_new_tokens)
  t0 = time.perf_counter()
  iteration = speculative_program.lower(graphdef, state, caches, mtp_caches, draft, key,
                                        max_new, k, sampling, eos_ids).compile()
  compile_s += time.perf_counter() - t0

  t0 = time.perf_counter()
  bar = progress_bar(max_new_tokens, "decode", unit="tok", enabled=progress, initial=1)
  step = 0
  while not ended().all():
    step += 1
    caches, mtp_caches, draft, emitted_BK = iteration(state, caches, mtp_caches, draft,
                                                      jax.random.fold_in(key, step), max_new)
    for row, new in zip(rows, np.asarray(emitted_BK)):
      row.extend(int(t) for t in new if t >= 0)
    bar.update(max(map(len, rows)) - bar.n)
  bar.close()
  return dict(tokens=rows, compile_s=compile_s, prefill_s=prefill_s,
              decode_s=time.perf_counter() - t0, decode_tokens=sum(map(len, rows)) - batch,
              drafted=int(np.asarray(draft.drafted_B).sum()),
              accepted=int(np.asarray(draft.accepted_B).sum()))
