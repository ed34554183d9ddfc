"""The dense causal MHA suite, run over every implementation (``test_dense_mha.py``).

Against a float64 NumPy computation and the jnp reference, future and past-kv_len rows
poisoned with NaN/inf, bad inputs and degenerate sizes; and the masked route (``topk_TK``):
-1 padding, empty rows, cached prefixes, rows past kv_len, whole key blocks skipped, and
unselected poisoned rows that never reach a query.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.testing import relative_error
from pallas_kernels.block_config import DenseMHAKernelConfig
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference, mask_operands, visible_keys
from tests.kernels import common
from tests.kernels.numpy_reference import assert_attention_matches, numpy_dense_mha

sds = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_inputs(seed, T, S, H, D, V, dtype):
  rng = np.random.default_rng(seed)
  return tuple(
      jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((T, H, D), (S, H, D), (S, H, V))
  )


def assert_matches(out, lse, q, k, v, sm_scale, q_offset, kv_len, dtype, topk=None):
  assert_attention_matches(out, lse, *numpy_dense_mha(q, k, v, sm_scale, q_offset, kv_len, topk),
                           rtol=RTOL[dtype], lse_rtol=1e-5, lse_atol=1e-4)


def random_topk(seed, T, S, K, q_offset, *, empty_rows=()):
  """Distinct causal key rows per query, -1 padded, plus two slots the mask must ignore: a
  future key (or one past kv_len) and a row past S. ``empty_rows`` select nothing."""
  rng = np.random.default_rng(seed)
  topk = np.full((T, K), -1, np.int32)
  for t in range(T):
    causal = min(q_offset + t + 1, S)
    picks = rng.choice(causal, size=rng.integers(0, min(K - 2, causal) + 1), replace=False)
    row = np.concatenate([picks, [rng.integers(causal, S + 8), S + 3]])
    topk[t, :len(row)] = rng.permutation(row)
  topk[list(empty_rows)] = -1
  return jnp.asarray(topk)


# (T, S, H, q_offset, kv_len); the tiny MLA widths are qk 48 = 32 nope + 16 rope, v 32.
CASES = (
    dict(testcase_name="t1_kv1_h1", T=1, S=1, H=1, q_offset=0, kv_len=1),
    dict(testcase_name="t3_kv100_h4_decode_like", T=3, S=100, H=4, q_offset=97, kv_len=100),
    dict(testcase_name="t64_kv100_h4_padded_keys", T=64, S=128, H=4, q_offset=36, kv_len=100),
    dict(testcase_name="t257_kv257_h4_prefill", T=257, S=257, H=4, q_offset=0, kv_len=257),
    dict(testcase_name="t64_kv1000_h16_context", T=64, S=1000, H=16, q_offset=936, kv_len=1000),
    dict(testcase_name="t3_kv0_h4_empty_rows", T=3, S=16, H=4, q_offset=0, kv_len=0),
)

# (T, S, H, q_offset, kv_len, K) for the masked route (topk_TK).
MASKED_CASES = (
    dict(testcase_name="t40_kv40_h2_k8_prefill", T=40, S=40, H=2, q_offset=0, kv_len=40, K=8),
    dict(testcase_name="t24_kv100_h4_k16_cached_prefix", T=24, S=100, H=4, q_offset=76,
         kv_len=100, K=16),
    dict(testcase_name="t64_kv100_h2_k16_rows_past_kv_len", T=64, S=128, H=2, q_offset=36,
         kv_len=100, K=16),
    dict(testcase_name="t5_kv0_h2_k4_no_kv", T=5, S=16, H=2, q_offset=0, kv_len=0, K=4),
)

# ---- whole key blocks skipped: T 32 at positions 48..79, S 80, blocks of 16 -------------------
# Query block 0 selects keys of key blocks 0 and 2 only, query block 1 selects nothing; key
# blocks 1, 3 and 4 are never selected, so no program loads them.
SKIP_Q_OFFSET = 48


def skipping_topk(seed=3):
  rng = np.random.default_rng(seed)
  topk = np.full((32, 8), -1, np.int32)
  for t in range(16):
    topk[t, :6] = rng.choice(np.r_[0:16, 32:48], size=6, replace=False)
  return topk


# ---- hidden rows: T 12 at positions 20..31, kv_len 28, S 40; blocks of 16 -------------------
# Key block 0 (keys 0-15) is seen whole by every query (the unmasked loop); block 1 (16-31)
# holds the causal diagonal and kv_len; block 2 (32-39) lies past kv_len and is skipped.

MASKING_CONFIG = DenseMHAKernelConfig(block_q=16, block_k=16)
Q_OFFSET, KV_LEN = 20, 28
MASKING_CASES = {
    # name: (poisoned arrays, rows, query rows whose output may change)
    "future_token": ("kv", [24], list(range(4, 12))),       # position 24: seen from query 4 on
    "future_token_value_only": ("v", [24], list(range(4, 12))),
    "future_token_key_only": ("k", [25], list(range(5, 12))),
    "rows_at_and_past_kv_len": ("kv", list(range(28, 40)), []),
    "row_every_query_sees": ("kv", [3], list(range(12))),
    "own_query_row": ("q", [2], [2]),
}


# The masked route's poison: (poisoned arrays, the queries whose top-k names row 5).
POISONED_ROW = 5
MASKED_POISON_CASES = {
    "key_selected_by_some": ("k", (0, 3, 7)),
    "value_selected_by_some": ("v", (0, 3, 7)),
    "selected_by_none": ("kv", ()),
}


def masking_inputs(seed=1):
  rng = np.random.default_rng(seed)
  shapes = ((12, 2, 48), (40, 2, 48), (40, 2, 32))
  return [rng.standard_normal(s).astype(np.float32) for s in shapes]


# ---- bad inputs: (case, changed arguments, error, the argument the message must name) ------

VALID = dict(q=sds((3, 2, 48), F32), k=sds((20, 2, 48), F32), v=sds((20, 2, 32), F32),
             sm_scale=0.2, q_offset=0, kv_len=20)
BAD_INPUTS = [
    ("q_rank", dict(q=sds((3, 48), F32)), ValueError, "q_THQ"),
    ("k_heads", dict(k=sds((20, 3, 48), F32)), ValueError, "k_SHQ"),
    ("v_rows", dict(v=sds((21, 2, 32), F32)), ValueError, "v_SHV"),
    ("v_width_zero", dict(v=sds((20, 2, 0), F32)), ValueError, "v_SHV"),
    ("int_q", dict(q=sds((3, 2, 48), I32)), TypeError, "q_THQ"),
    ("mixed_dtypes", dict(v=sds((20, 2, 32), BF16)), TypeError, "v_SHV"),
    ("kv_len_float", dict(kv_len=2.5), TypeError, "kv_len"),
    ("kv_len_bool", dict(kv_len=True), TypeError, "kv_len"),
    ("kv_len_vector", dict(kv_len=np.array([20, 20])), TypeError, "kv_len"),
    ("q_offset_float_array", dict(q_offset=np.float32(0)), TypeError, "q_offset"),
    ("q_offset_past_int32", dict(q_offset=2**40), ValueError, "q_offset"),
    ("q_offset_negative", dict(q_offset=-2), ValueError, "q_offset"),
    ("q_offset_negative_numpy", dict(q_offset=np.int32(-1)), ValueError, "q_offset"),
    ("sm_scale_zero", dict(sm_scale=0.0), ValueError, "sm_scale"),
    ("sm_scale_inf", dict(sm_scale=float("inf")), ValueError, "sm_scale"),
    ("topk_rank", dict(topk_TK=sds((3,), I32)), ValueError, "topk_TK"),
    ("topk_rows", dict(topk_TK=sds((4, 5), I32)), ValueError, "topk_TK"),
    ("topk_float", dict(topk_TK=sds((3, 5), F32)), TypeError, "topk_TK"),
    ("segments_rows", dict(segment_ids_T=sds((4,), I32)), ValueError, "segment_ids_T"),
    ("segments_float", dict(segment_ids_T=sds((3,), F32)), TypeError, "segment_ids_T"),
]


class DenseMHATestBase(common.KernelTestBase):

  KERNEL = staticmethod(dense_mha)
  REFERENCE = staticmethod(dense_mha_reference)
  STATIC_ARGNAMES = ("sm_scale",)
  POSITIONAL = ("q", "k", "v")

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{dt.__name__}", dtype=dt)
      for c in CASES for dt in (jnp.float32, jnp.bfloat16)
      if dt == jnp.float32 or c["testcase_name"] in ("t3_kv100_h4_decode_like", "t257_kv257_h4_prefill")
  )
  def test_matches_float64_and_reference(self, T, S, H, q_offset, kv_len, dtype):
    D, V, sm_scale = 48, 32, 48**-0.5
    q, k, v = make_inputs(T + S, T, S, H, D, V, dtype)
    out, lse = self.fn()(q, k, v, sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len)
    chex.assert_shape((out, lse), ((T, H, V), (T, H)))
    chex.assert_type(out, dtype)
    assert_matches(out, lse, q, k, v, sm_scale, q_offset, kv_len, dtype)
    ref = self.reference()(q, k, v, sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    chex.assert_trees_all_close(
        (out.astype(jnp.float32), lse), (ref[0].astype(jnp.float32), ref[1]), rtol=tol, atol=tol
    )

  @parameterized.named_parameters(
      ("deepseek_qk192_v128", 192, 128), ("glm_qk256_v256", 256, 256)
  )
  def test_model_widths_bf16(self, D, V):
    q, k, v = make_inputs(0, 40, 70, 2, D, V, jnp.bfloat16)
    out, lse = self.fn()(q, k, v, sm_scale=D**-0.5, q_offset=30, kv_len=70)
    assert_matches(out, lse, q, k, v, D**-0.5, 30, 70, jnp.bfloat16)

  def test_traced_offsets_under_jit(self):
    q, k, v = make_inputs(1, 9, 40, 2, 48, 32, jnp.float32)
    fn = jax.jit(functools.partial(self.fn(), sm_scale=0.2))
    for q_offset, kv_len in ((0, 9), (31, 40), (5, 12)):
      out, lse = fn(q, k, v, q_offset=jnp.int32(q_offset), kv_len=jnp.int32(kv_len))
      assert_matches(out, lse, q, k, v, 0.2, q_offset, kv_len, jnp.float32)

  @parameterized.parameters((1, 1, 0, 1), (6, 6, 0, 6), (4, 11, 7, 11), (5, 12, 3, 6))
  def test_is_causal_from_offset(self, t, s, offset, kv_len):
    rng = np.random.default_rng(t + s)
    h, d, v = 3, 24, 8
    q, k, val = rng.standard_normal((t, h, d)), rng.standard_normal((s, h, d)), rng.standard_normal((s, h, v))
    out, lse = self.fn()(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                         jnp.asarray(val, jnp.float32), sm_scale=0.25,
                         q_offset=jnp.int32(offset), kv_len=jnp.int32(kv_len))
    ref, _ = numpy_dense_mha(q, k, val, 0.25, offset, kv_len)
    assert relative_error(out, ref) < 1e-5
    chex.assert_tree_all_finite(lse)

  def test_backend_batched_matches_reference(self):
    q, k, v = (jnp.stack([x, x[::-1]]) for x in make_inputs(2, 9, 20, 2, 48, 32, jnp.float32))
    offsets, lengths = jnp.array([0, 11], jnp.int32), jnp.array([9, 20], jnp.int32)
    got = self.backend().dense_mha(q, k, v, sm_scale=0.2, q_offset_B=offsets, kv_len_B=lengths)
    want = jax.jit(jax.vmap(lambda q, k, v, offset, n: self.REFERENCE(
        q, k, v, sm_scale=0.2, q_offset=offset, kv_len=n)))(q, k, v, offsets, lengths)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)

  # ---- NaN and inf in rows a query may not see never reach it ------------------------------

  @parameterized.named_parameters(common.named_product(
      case={c: c for c in MASKING_CASES}, poison=common.POISONS))
  def test_hidden_rows_stay_hidden(self, case, poison):
    which, rows, affected_rows = MASKING_CASES[case]
    q, k, v = masking_inputs()
    bad = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
    for name in ("k", "v") if which == "kv" else (which,):
      bad[name][rows] = poison
    call = functools.partial(self.jitted(MASKING_CONFIG, sm_scale=48**-0.5), q_offset=Q_OFFSET,
                             kv_len=KV_LEN)
    got = [np.asarray(x) for x in call(*(jnp.asarray(bad[n]) for n in "qkv"))]
    clean = call(*(jnp.asarray(x) for x in (q, k, v)))
    affected = np.isin(np.arange(12), affected_rows)
    common.assert_only_affected_change(got, clean, affected)
    with np.errstate(invalid="ignore"):
      truth = numpy_dense_mha(bad["q"], bad["k"], bad["v"], 48**-0.5, Q_OFFSET, KV_LEN)
    keep = ~affected
    assert_attention_matches(got[0][keep], got[1][keep], truth[0][keep], truth[1][keep],
                             rtol=1e-5, lse_rtol=1e-5, lse_atol=1e-4)

  # ---- the masked route: only the causal keys of each query's top-k row ---------------------

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{dt.__name__}", dtype=dt)
      for c in MASKED_CASES for dt in (jnp.float32, jnp.bfloat16)
      if dt == jnp.float32 or c["testcase_name"] != "t5_kv0_h2_k4_no_kv"
  )
  def test_masked_matches_float64_and_reference(self, T, S, H, q_offset, kv_len, K, dtype):
    q, k, v = make_inputs(T + S + K, T, S, H, 48, 32, dtype)
    topk = random_topk(T + K, T, S, K, q_offset, empty_rows=(1, T - 1))
    out, lse = self.fn()(q, k, v, sm_scale=0.2, q_offset=q_offset, kv_len=kv_len, topk_TK=topk)
    chex.assert_shape((out, lse), ((T, H, 32), (T, H)))
    chex.assert_type(out, dtype)
    assert_matches(out, lse, q, k, v, 0.2, q_offset, kv_len, dtype, topk)
    ref = self.reference()(q, k, v, sm_scale=0.2, q_offset=q_offset, kv_len=kv_len, topk_TK=topk)
    tol = RTOL[dtype]
    chex.assert_trees_all_close((out.astype(F32), lse), (ref[0].astype(F32), ref[1]), rtol=tol,
                                atol=tol)

  def test_masked_skips_whole_key_blocks(self):
    q, k, v = (np.array(x) for x in make_inputs(4, 32, 80, 2, 48, 32, jnp.float32))
    topk = skipping_topk()
    for rows in (slice(16, 32), slice(48, 80)):  # never selected: poison whole key blocks
      k[rows], v[rows] = np.nan, np.inf
    out, lse = self.jitted(MASKING_CONFIG, sm_scale=0.2)(
        *map(jnp.asarray, (q, k, v)), q_offset=SKIP_Q_OFFSET, kv_len=80, topk_TK=topk)
    assert_matches(out, lse, q, k, v, 0.2, SKIP_Q_OFFSET, 80, jnp.float32, topk)
    assert np.isposinf(np.asarray(lse)[16:]).all()  # query block 1 selected nothing

  def test_masked_traced_offsets_under_jit(self):
    q, k, v = make_inputs(5, 9, 40, 2, 48, 32, jnp.float32)
    fn = jax.jit(functools.partial(self.fn(), sm_scale=0.2))
    for q_offset, kv_len in ((0, 9), (31, 40), (5, 12)):
      topk = random_topk(q_offset, 9, 40, 8, q_offset)
      out, lse = fn(q, k, v, q_offset=jnp.int32(q_offset), kv_len=jnp.int32(kv_len), topk_TK=topk)
      assert_matches(out, lse, q, k, v, 0.2, q_offset, kv_len, jnp.float32, topk)

  def test_backend_batched_masked_matches_reference(self):
    """A ragged batch: each sequence its own cached length, kv length and top-k."""
    q, k, v = (jnp.stack([x, x[::-1]]) for x in make_inputs(6, 9, 20, 2, 48, 32, jnp.float32))
    offsets, lengths = jnp.array([0, 11], jnp.int32), jnp.array([9, 20], jnp.int32)
    topk = jnp.stack([random_topk(7, 9, 20, 6, 0), random_topk(8, 9, 20, 6, 11)])
    got = self.backend().masked_mha(q, k, v, topk, sm_scale=0.2, q_offset_B=offsets,
                                    kv_len_B=lengths)
    for b in range(2):
      assert_matches(got[0][b], got[1][b], q[b], k[b], v[b], 0.2, int(offsets[b]),
                     int(lengths[b]), jnp.float32, topk[b])

  @parameterized.named_parameters(common.named_product(
      case={c: c for c in MASKED_POISON_CASES}, poison=common.POISONS))
  def test_masked_unselected_rows_stay_hidden(self, case, poison):
    """Row 5 is causal for every query; only the queries whose top-k names it may change."""
    which, selecting = MASKED_POISON_CASES[case]
    q, k, v = masking_inputs()
    topk = np.array(random_topk(9, 12, 40, 8, Q_OFFSET))
    topk[topk == POISONED_ROW] = -1
    topk[list(selecting), 0] = POISONED_ROW
    bad = {"k": k.copy(), "v": v.copy()}
    for name in ("k", "v") if which == "kv" else (which,):
      bad[name][POISONED_ROW] = poison
    call = functools.partial(self.jitted(MASKING_CONFIG, sm_scale=48**-0.5), q_offset=Q_OFFSET,
                             kv_len=KV_LEN, topk_TK=jnp.asarray(topk))
    got = [np.asarray(x) for x in call(*map(jnp.asarray, (q, bad["k"], bad["v"])))]
    clean = call(*map(jnp.asarray, (q, k, v)))
    affected = np.isin(np.arange(12), selecting)
    common.assert_only_affected_change(got, clean, affected)
    truth = numpy_dense_mha(q, k, v, 48**-0.5, Q_OFFSET, KV_LEN, topk)
    assert_attention_matches(got[0][~affected], got[1][~affected], truth[0][~affected],
                             truth[1][~affected], rtol=1e-5, lse_rtol=1e-5, lse_atol=1e-4)

  # ---- segments: several sequences laid end to end (an engine's flat step) ---------------

  def test_segmented_matches_float64_and_reference(self):
    """Four sequences of 1, 9, 17 and 5 rows and two padding rows (segment -1) in one row
    block: each query attends its own sequence's rows up to itself; blocks of 16 put a
    segment boundary inside a key block."""
    lengths, T = (1, 9, 17, 5), 34
    segments = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(lengths)]
                              + [np.full(T - sum(lengths), -1, np.int32)])
    clean_q, clean_k, clean_v = make_inputs(11, T, T, 2, 48, 32, jnp.float32)
    call = functools.partial(self.jitted(MASKING_CONFIG, sm_scale=0.2), q_offset=0, kv_len=T,
                             segment_ids_T=jnp.asarray(segments))
    out, lse = call(clean_q, clean_k, clean_v)
    assert_attention_matches(out, lse, *numpy_dense_mha(clean_q, clean_k, clean_v, 0.2, 0, T,
                                                        segments=segments),
                             rtol=1e-5, lse_rtol=1e-5, lse_atol=1e-4)
    ref = self.reference()(clean_q, clean_k, clean_v, sm_scale=0.2, q_offset=0, kv_len=T,
                           segment_ids_T=jnp.asarray(segments))
    chex.assert_trees_all_close((out, lse), ref, rtol=1e-5, atol=1e-5)
    # Row 3 (of the second sequence) poisoned: only that sequence's queries from row 3 on see
    # it; the rows of the other sequences, before and after it, never do.
    bad_k = np.array(clean_k)
    bad_k[3] = np.nan
    got = [np.asarray(x) for x in call(clean_q, jnp.asarray(bad_k), clean_v)]
    affected = (segments == 1) & (np.arange(T) >= 3)
    common.assert_only_affected_change(got, (out, lse), affected)

  def test_segmented_gradients_match_float64(self):
    """The segmented route is differentiable like the others (the masked kernel's backward
    reads the same bitmask)."""
    segments = jnp.asarray(np.repeat(np.arange(3, dtype=np.int32), [4, 7, 5]))
    q, k, v = make_inputs(12, 16, 16, 2, 48, 32, jnp.float32)
    loss = lambda fn: lambda q, k, v: (fn(q, k, v, sm_scale=0.2, q_offset=0, kv_len=16,
                                          segment_ids_T=segments)[0] ** 2).sum()
    got = jax.grad(loss(self.fn()), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(self.reference()), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
      assert relative_error(g, w) < 1e-5

  # ---- bad inputs and degenerate sizes -----------------------------------------------------

  @parameterized.named_parameters(common.bad_input_cases(VALID, BAD_INPUTS))
  def test_refuses_bad_input(self, args, error, argument):
    self.assert_refused_like_the_reference(args, error, argument)

  def test_valid_arguments_pass(self):
    self.assert_accepted(VALID)

  @parameterized.named_parameters(("no_keys", 3, 0, None), ("no_tokens", 0, 20, None),
                                  ("masked_no_slots", 3, 20, 0), ("masked_no_keys", 3, 0, 4),
                                  ("masked_no_tokens", 0, 20, 4))
  def test_degenerate_sizes(self, T, S, K):
    q, k, v = jnp.ones((T, 2, 48), F32), jnp.ones((S, 2, 48), F32), jnp.ones((S, 2, 32), F32)
    topk = None if K is None else jnp.zeros((T, K), I32)
    common.assert_no_attention(
        self.fn()(q, k, v, sm_scale=0.2, q_offset=0, kv_len=S, topk_TK=topk), (T, 2, 32))


class DenseMHAKernelTestBase(DenseMHATestBase):
  """The suite, and what only the kernel has: a block config, refused if it is not one."""

  def test_refuses_a_foreign_config(self):
    self.assert_kernel_refuses_config(VALID, "fast")

  def test_masked_schedule_lists_only_selected_key_blocks(self):
    """The skipping case's schedule: query block 0 visits key blocks 0 and 2, block 1 none;
    the bitmask decodes back to the visible pairs."""
    visible = visible_keys(32, 80, SKIP_Q_OFFSET, 80, jnp.asarray(skipping_topk()))
    bits_WT, key_blocks, num_blocks = mask_operands(visible, MASKING_CONFIG)
    np.testing.assert_array_equal(num_blocks, [2, 0])
    np.testing.assert_array_equal(key_blocks[0, :2], [0, 2])
    decoded_TS = (np.asarray(bits_WT).T[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_array_equal(decoded_TS.reshape(32, -1)[:, :80], np.asarray(visible))
    assert not decoded_TS.reshape(32, -1)[:, 80:].any()
