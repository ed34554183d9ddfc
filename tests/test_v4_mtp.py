"""DeepSeek-V4's MTP layer against its float64 reference, loaded from and saved to ``mtp.*``,
and speculative decoding through the shared machinery: greedy tokens equal plain decoding's."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import cli
from mla_jax.checkpoints.reading import open_checkpoint
from mla_jax.generation import generate, speculative
from mla_jax.v4.checkpoint import load_pretrained, save_pretrained
from mla_jax.v4.config import CSA, MOE, tiny_v4_config
from mla_jax.v4.model import V4CausalLM
from tests import v4_reference as ref
from tests.test_v4_model import randomize, rel_err

# One CSA layer: a rollback must restore its window ring, compressor and indexer state.
CONFIG = tiny_v4_config(layer_types=(CSA,), mlp_layer_types=(MOE,), hc_sinkhorn_iters=2,
                        num_mtp_layers=1)
LOAD = dict(dtype=jnp.float32, backend="xla", grouped_matmul="ragged_dot")
PROMPTS = np.random.default_rng(0).integers(0, 256, (2, 13)).tolist()
NEW = 10


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A random tiny V4 with one MTP layer, saved (``mtp.0.*``) and loaded back."""
  path = tmp_path_factory.mktemp("v4_mtp")
  model = V4CausalLM(CONFIG, rngs=nnx.Rngs(0), backend="xla", grouped_matmul="ragged_dot")
  save_pretrained(randomize(model, 1), path)
  return path, load_pretrained(path, **LOAD)


@functools.lru_cache(maxsize=None)
def _plain(path) -> list[list[int]]:
  return generate(load_pretrained(path, **LOAD), PROMPTS, NEW).tokens


def test_mtp_tensors_are_stored_under_deepseeks_names(saved):
  path, model = saved
  names = set(open_checkpoint(path))
  for name in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight",
               "mtp.0.hnorm.weight", "mtp.0.norm.weight", "mtp.0.hc_head_fn",
               "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.7.w2.weight", "mtp.0.hc_attn_fn"):
    assert name in names, name
  assert not any(n.startswith("mtp.0.attn.compressor") for n in names)  # a sliding block
  assert len(model.mtp) == 1
  assert len(load_pretrained(path, mtp=False, **LOAD).mtp) == 0


@nnx.jit
def _main_and_mtp(model, ids_BT, next_BT):
  b, t = ids_BT.shape
  _, _, streams = model(ids_BT, model.init_cache(b, t), return_hidden=True)
  chunk = t // 2  # two MTP steps of one program: the second reads the first's window ring
  caches, out = model.init_mtp_cache(b, t), []
  for start in (0, chunk):
    logits, _, caches = model.mtp_forward(0, streams[:, start:start + chunk],
                                          next_BT[:, start:start + chunk], caches)
    out.append(logits)
  return streams, jnp.concatenate(out, axis=1)


def test_mtp_layer_matches_float64_reference(saved):
  """Row p pairs the main model's streams at p with token p + 1: the MTP logits are the
  float64 reference's, the model's streams its too."""
  _, model = saved
  ids = np.random.default_rng(3).integers(0, 256, (1, 17))
  streams, logits = _main_and_mtp(model, jnp.asarray(ids[:, :16], jnp.int32),
                                  jnp.asarray(ids[:, 1:], jnp.int32))
  params = ref.params_of(model)
  want_streams = ref.final_streams(params, model.config, ids[0, :16])
  assert rel_err(np.asarray(streams[0], np.float64), want_streams) < 1e-5
  want, _ = ref.mtp(params, model.config, want_streams, ids[0, 1:])
  assert rel_err(np.asarray(logits[0]), want) < 1e-5


@nnx.jit
def _step(model, ids_BT, caches):
  return model(ids_BT, caches)


def test_positions_a_step_ran_ahead_are_never_read(saved):
  """Caches with 2 spare ring slots: a step that wrote 2 positions past where the next step
  starts (rejected drafts) leaves the logits of never having written them. Steps of 3 tokens
  (one program); the run-ahead step completes a compressed entry with its wrong tokens."""
  _, model = saved
  ids = np.random.default_rng(5).integers(0, 256, (1, 16))
  wrong = ids.copy()
  wrong[0, 10:12] = (ids[0, 10:12] + 7) % 256

  def run(starts, tokens):
    caches, out = model.init_cache(1, 16, spare=2), {}
    for start, row in zip(starts, tokens):
      logits, caches = _step(model, jnp.asarray(row[None, start:start + 3], jnp.int32),
                             caches.with_num_cached(start))
      out.update({start + t: np.asarray(logits[0, t]) for t in range(3)})
    return out

  plain = run([0, 3, 6, 9, 12], [ids[0]] * 5)
  ahead = run([0, 3, 6, 9, 10, 13], [ids[0]] * 3 + [wrong[0], ids[0], ids[0]])
  for position in range(10, 15):
    assert rel_err(ahead[position], plain[position]) < 1e-5, position


def test_speculative_greedy_tokens_equal_plain_decoding(saved):
  """k = 2 drafts a step from the MTP layer (the second by one more MTP step on its own
  output): a random MTP layer's drafts are rejected nearly always, so each step rolls the
  caches back past two rejected tokens."""
  path, model = saved
  result = generate(model, PROMPTS, NEW, speculative_tokens=2)
  assert result.tokens == _plain(path)
  assert result.drafted > 0 and 0 <= result.acceptance_rate < 0.5


def test_accepted_drafts_advance_the_caches(saved, monkeypatch):
  """Drafts that are the plain tokens but at every third position (k = 1): rows accept a
  varying number a step, and the tokens still equal plain decoding's."""
  path, model = saved
  table = jnp.asarray(_plain(path), jnp.int32)
  prompt = len(PROMPTS[0])

  def oracle(model, logits_BV, hidden_BD, buffers, rows_at, buffers_of, start_B, wanted_B,
             count, plan):
    pos_BK = start_B[:, None] + jnp.arange(1, count + 1, dtype=jnp.int32)
    right = jnp.take_along_axis(table, jnp.clip(pos_BK - prompt, 0, NEW - 1), axis=1)
    return jnp.where(pos_BK % 3 == 0, (right + 1) % 256, right), buffers

  monkeypatch.setattr(speculative, "draft", oracle)
  result = generate(model, PROMPTS, NEW, speculative_tokens=1)
  assert result.tokens == _plain(path)
  assert 0.4 < result.acceptance_rate < 0.9


def test_speculative_decoding_needs_mtp_layers(saved, tmp_path, capsys):
  path, _ = saved
  with pytest.raises(ValueError, match="drafts with the model's MTP layers, but it has none"):
    generate(load_pretrained(path, mtp=False, **LOAD), PROMPTS, 2, speculative_tokens=1)
  save_pretrained(V4CausalLM(tiny_v4_config(), rngs=nnx.Rngs(0), backend="xla"), tmp_path)
  assert cli.main(["generate", "--checkpoint", str(tmp_path), "--speculative-tokens", "1",
                   "--backend", "xla", "--quiet"]) == 2
  assert "mtp=True, but num_nextn_predict_layers is 0" in capsys.readouterr().err
