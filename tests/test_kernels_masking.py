"""NaN and inf in rows a query may not see never reach it, in every kernel and every reference.

Each case poisons one kind of hidden row and names the outputs that may change: all others
must equal the unpoisoned run exactly and the float64 ground truth of the poisoned inputs, and
be finite. For the attention ops, outputs that see a poisoned row must not be finite (a poisoned
visible row shows instead of being hidden). Kernels run in interpret mode with small blocks, so that the cases
cover both full and masked key blocks, overhanging head/slot/key blocks and skipped tiles.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import fp8_cache
from pallas_kernels.block_config import (DenseMHAKernelConfig, IndexerLogitsKernelConfig,
                                         SparseMQAKernelConfig)
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference
from pallas_kernels.fp8_rows import Fp8LatentRows
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference
from pallas_kernels.sparse_mqa import sparse_mqa, sparse_mqa_reference
from tests.numpy_kernels import (assert_attention_matches, numpy_dense_mha,
                                 numpy_dequantize_rows, numpy_indexer_logits, numpy_sparse_mqa)

POISONS = [pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf")]


def impls(kernel, reference, config, **static):
  """The kernel (interpret mode) and the reference, each jitted once for all of its cases."""
  return [pytest.param(jax.jit(functools.partial(kernel, config=config, interpret=True, **static)),
                       id="kernel"),
          pytest.param(jax.jit(functools.partial(reference, **static)), id="reference")]


def assert_only_affected_change(got, clean, affected):
  """``affected`` selects the leading-axis rows that see poison; the others are untouched."""
  for g, c in zip(got, clean):
    g, c = np.asarray(g, np.float64), np.asarray(c, np.float64)
    np.testing.assert_array_equal(g[~affected], c[~affected])
    for row in np.flatnonzero(affected):
      assert not np.isfinite(g[row]).all(), f"row {row} sees a poisoned row but is finite"


# ---- sparse MQA: T 4, H 5 (head blocks of 16 overhang), K 7 (slot blocks of 16), S 40 --------

SPARSE_TOPK = np.array([
    [3, -1, 9, 40, 12, 4, -1],       # -1 and >= S slots read row 0 (clamped)
    [5, 6, 7, 8, 52, -1, 11],
    [-1, -1, 40, 41, -1, -1, -1],    # an empty row
    [12, 13, 14, 3, 5, -1, 39],
], np.int32)


def sparse_inputs(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(shape).astype(np.float32) for shape in ((4, 5, 80), (40, 80))]


SPARSE_CASES = {
    # name: (which array, which rows of it, tokens whose output may change)
    "row_no_slot_selects": ("kv", [20, 30, 38], []),
    "row_invalid_slots_clamp_to": ("kv", [0], []),
    "selected_row_shows": ("kv", [12], [0, 3]),
    "own_query_row": ("q", [1], [1]),
}


@pytest.mark.parametrize("case", list(SPARSE_CASES))
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("fn", impls(sparse_mqa, sparse_mqa_reference,
                                     SparseMQAKernelConfig(block_h=16, block_k=16),
                                     sm_scale=0.11, d_v=64))
def test_sparse_mqa_hidden_rows_stay_hidden(fn, poison, case):
  which, rows, affected_tokens = SPARSE_CASES[case]
  q, kv = sparse_inputs()
  bad = {"q": q.copy(), "kv": kv.copy()}
  bad[which][rows] = poison
  topk = jnp.asarray(SPARSE_TOPK)
  got = [np.asarray(x) for x in fn(jnp.asarray(bad["q"]), jnp.asarray(bad["kv"]), topk)]
  clean = fn(jnp.asarray(q), jnp.asarray(kv), topk)
  affected = np.isin(np.arange(4), affected_tokens)
  assert_only_affected_change(got, clean, affected)
  with np.errstate(invalid="ignore"):
    truth = numpy_sparse_mqa(bad["q"], bad["kv"], SPARSE_TOPK, 0.11, 64)
  keep = ~affected
  assert_attention_matches(got[0][keep], got[1][keep], truth[0][keep], truth[1][keep],
                           rtol=1e-5, lse_rtol=1e-5, lse_atol=1e-5)


# fp8 rows of the same kv (A 64 + R 16, one scale tile): poison one part of some rows. e4m3 has
# NaN but no inf, so an inf "value" is poisoned through its scale (inf * 0 = NaN included).
FP8_PARTS = {"values": 0, "scales": 1, "rope": 2}


@pytest.mark.parametrize("case", [c for c in SPARSE_CASES if SPARSE_CASES[c][0] == "kv"])
@pytest.mark.parametrize("part", list(FP8_PARTS))
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("fn", impls(sparse_mqa, sparse_mqa_reference,
                                     SparseMQAKernelConfig(block_h=16, block_k=16),
                                     sm_scale=0.11, d_v=64))
def test_sparse_mqa_fp8_hidden_rows_stay_hidden(fn, poison, part, case):
  _, rows, affected_tokens = SPARSE_CASES[case]
  q, kv = sparse_inputs()
  clean_rows = fp8_cache.quantize_latent(jnp.asarray(kv), 64)
  parts = [np.asarray(p).copy() for p in clean_rows]
  target = FP8_PARTS["scales"] if part == "values" and np.isinf(poison) else FP8_PARTS[part]
  parts[target][rows] = poison
  bad_rows = Fp8LatentRows(*(jnp.asarray(p) for p in parts))
  topk = jnp.asarray(SPARSE_TOPK)
  got = [np.asarray(x) for x in fn(jnp.asarray(q), bad_rows, topk)]
  clean = fn(jnp.asarray(q), clean_rows, topk)
  affected = np.isin(np.arange(4), affected_tokens)
  assert_only_affected_change(got, clean, affected)
  truth = numpy_sparse_mqa(q, numpy_dequantize_rows(clean_rows), SPARSE_TOPK, 0.11, 64)
  keep = ~affected
  assert_attention_matches(got[0][keep], got[1][keep], truth[0][keep], truth[1][keep],
                           rtol=1e-5, lse_rtol=1e-5, lse_atol=1e-5)


# ---- dense MHA: T 12 at positions 20..31, kv_len 28, S 40; blocks of 16 -----------------------
# Key block 0 (keys 0-15) is seen whole by every query (the unmasked loop); block 1 (16-31)
# holds the causal diagonal and kv_len; block 2 (32-39) lies past kv_len and is skipped.

Q_OFFSET, KV_LEN = 20, 28


def dense_inputs(seed=1):
  rng = np.random.default_rng(seed)
  shapes = ((12, 2, 48), (40, 2, 48), (40, 2, 32))
  return [rng.standard_normal(s).astype(np.float32) for s in shapes]


DENSE_CASES = {
    # name: (poisoned arrays, rows, query rows whose output may change)
    "future_token": ("kv", [24], list(range(4, 12))),       # position 24: seen from query 4 on
    "future_token_value_only": ("v", [24], list(range(4, 12))),
    "future_token_key_only": ("k", [25], list(range(5, 12))),
    "rows_at_and_past_kv_len": ("kv", list(range(28, 40)), []),
    "row_every_query_sees": ("kv", [3], list(range(12))),
    "own_query_row": ("q", [2], [2]),
}


@pytest.mark.parametrize("case", list(DENSE_CASES))
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("fn", impls(dense_mha, dense_mha_reference,
                                     DenseMHAKernelConfig(block_q=16, block_k=16),
                                     sm_scale=48**-0.5))
def test_dense_mha_hidden_rows_stay_hidden(fn, poison, case):
  which, rows, affected_rows = DENSE_CASES[case]
  q, k, v = dense_inputs()
  bad = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
  for name in ("k", "v") if which == "kv" else (which,):
    bad[name][rows] = poison
  call = functools.partial(fn, q_offset=Q_OFFSET, kv_len=KV_LEN)
  got = [np.asarray(x) for x in call(*(jnp.asarray(bad[n]) for n in "qkv"))]
  clean = call(*(jnp.asarray(x) for x in (q, k, v)))
  affected = np.isin(np.arange(12), affected_rows)
  assert_only_affected_change(got, clean, affected)
  with np.errstate(invalid="ignore"):
    truth = numpy_dense_mha(bad["q"], bad["k"], bad["v"], 48**-0.5, Q_OFFSET, KV_LEN)
  keep = ~affected
  assert_attention_matches(got[0][keep], got[1][keep], truth[0][keep], truth[1][keep],
                           rtol=1e-5, lse_rtol=1e-5, lse_atol=1e-4)


# ---- indexer logits: T 5, S 40, windows inside [0, 20); tiles of 16 -----------------------------
# Tile columns 32-47 lie past every window (skipped); 16-31 straddle the last window's end.

STARTS = np.array([0, 3, 5, 0, 10], np.int32)
ENDS = np.array([4, 9, 5, 12, 20], np.int32)


def indexer_inputs(seed=2):
  rng = np.random.default_rng(seed)
  return dict(q=rng.standard_normal((5, 4, 32)).astype(np.float32),
              k=rng.standard_normal((40, 32)).astype(np.float32),
              w=rng.standard_normal((5, 4)).astype(np.float32),
              scale=rng.uniform(0.5, 2.0, 40).astype(np.float32))


INDEXER_CASES = {
    # name: (poisoned array, rows, query rows whose in-window logits may change)
    "keys_outside_every_window": ("k", list(range(20, 40)), []),
    "key_scales_outside_every_window": ("scale", list(range(20, 40)), []),
    "key_inside_some_windows": ("k", [2], [0, 3]),       # rows 1, 2, 4 do not see key 2
    "own_query_row": ("q", [1], [1]),
    "own_weight_row": ("w", [4], [4]),
}


@pytest.mark.parametrize("case", list(INDEXER_CASES))
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("fn", impls(indexer_logits, indexer_logits_reference,
                                     IndexerLogitsKernelConfig(block_t=16, block_s=16)))
def test_indexer_logits_keys_outside_a_window_stay_hidden(fn, poison, case):
  which, rows, affected_rows = INDEXER_CASES[case]
  clean_in = indexer_inputs()
  bad_in = {name: x.copy() for name, x in clean_in.items()}
  bad_in[which][rows] = poison

  def call(x):
    return fn(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["w"]), jnp.asarray(STARTS),
              jnp.asarray(ENDS), k_scale_S=jnp.asarray(x["scale"]))

  got, clean = np.asarray(call(bad_in), np.float64), np.asarray(call(clean_in), np.float64)
  cols = np.arange(40)
  inside = (cols[None, :] >= STARTS[:, None]) & (cols[None, :] < ENDS[:, None])
  np.testing.assert_array_equal(np.isneginf(got), ~inside)  # outside: exactly -inf
  # A poisoned key row or scale touches its own column; a q or w row its own row.
  touched = np.zeros_like(inside)
  if which in ("k", "scale"):
    touched[np.ix_(affected_rows, rows)] = True
  else:
    touched[affected_rows] = True
  touched &= inside
  np.testing.assert_array_equal(got[~touched], clean[~touched])
  truth = numpy_indexer_logits(clean_in["q"], clean_in["k"], clean_in["w"], STARTS, ENDS,
                               clean_in["scale"])
  kept = inside & ~touched
  np.testing.assert_allclose(got[kept], truth[kept], rtol=1e-5, atol=1e-5)
