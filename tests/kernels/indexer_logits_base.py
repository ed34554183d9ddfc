"""The indexer logits suite, run over every implementation (``test_indexer_logits.py``).

Against a float64 NumPy computation and the jnp reference (bf16, fp32, and fp8 keys with
per-key scales), keys outside a query's window poisoned with NaN/inf, bad inputs and
degenerate sizes; and the pool mode (``key_rows_S``): keys read in place from a paged pool
through per-column row ids, with -1 rows, prefix pages shared between sequences, ragged
windows and several page sizes.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.fp8_cache import quantize_indexer_queries, quantize_keys
from mla_jax.testing import relative_error
from pallas_kernels.block_config import IndexerLogitsKernelConfig, SparseMQAKernelConfig
from pallas_kernels.indexer_logits import indexer_logits, indexer_logits_reference
from tests.kernels import common
from tests.kernels.numpy_reference import numpy_indexer_logits, numpy_pooled_indexer_logits

sds = jax.ShapeDtypeStruct
F32, BF16, F16, I32, FP8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.float8_e4m3fn
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, FP8: 1e-5}  # fp8 vs the dequantized float64 result


def make_inputs(seed, T, G, I, S, dtype, window="causal"):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((T, G, I)), dtype)
  k = jnp.asarray(rng.standard_normal((S, I)), dtype)
  w = jnp.asarray(rng.standard_normal((T, G)), jnp.float32)
  if window == "causal":  # the prefill pattern: each row sees keys [0, S - T + t + 1)
    starts = np.zeros(T)
    ends = np.clip(S - T + 1 + np.arange(T), 0, S)
  else:  # random windows, some empty, some past S
    starts = rng.integers(0, S, T)
    ends = starts + rng.integers(0, S, T)
  k_scale = jnp.asarray(rng.uniform(0.5, 2.0, S), jnp.float32) if dtype == FP8 else None
  return q, k, w, jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32), k_scale


CASES = (
    dict(testcase_name="t1_s1", T=1, G=4, S=1),
    dict(testcase_name="t3_s100_random_windows", T=3, G=4, S=100, window="random"),
    dict(testcase_name="t64_s1000", T=64, G=16, S=1000),
    dict(testcase_name="t257_s1000_random_windows", T=257, G=4, S=1000, window="random"),
)

# ---- hidden keys: T 5, S 40, windows inside [0, 20); tiles of 16 ---------------------------
# Tile columns 32-47 lie past every window (skipped); 16-31 straddle the last window's end.

MASKING_CONFIG = IndexerLogitsKernelConfig(block_t=16, block_s=16)
STARTS = np.array([0, 3, 5, 0, 10], np.int32)
ENDS = np.array([4, 9, 5, 12, 20], np.int32)
MASKING_CASES = {
    # name: (poisoned array, rows, query rows whose in-window logits may change)
    "keys_outside_every_window": ("k", list(range(20, 40)), []),
    "key_scales_outside_every_window": ("scale", list(range(20, 40)), []),
    "key_inside_some_windows": ("k", [2], [0, 3]),       # rows 1, 2, 4 do not see key 2
    "own_query_row": ("q", [1], [1]),
    "own_weight_row": ("w", [4], [4]),
}


def masking_inputs(seed=2):
  rng = np.random.default_rng(seed)
  return dict(q=rng.standard_normal((5, 4, 32)).astype(np.float32),
              k=rng.standard_normal((40, 32)).astype(np.float32),
              w=rng.standard_normal((5, 4)).astype(np.float32),
              scale=rng.uniform(0.5, 2.0, 40).astype(np.float32))


# ---- bad inputs: (case, changed arguments, error, the argument the message must name) ------

VALID = dict(q=sds((3, 4, 32), F32), k=sds((50, 32), F32), w=sds((3, 4), F32),
             starts=sds((3,), I32), ends=sds((3,), I32), k_scale_S=None)
BAD_INPUTS = [
    ("q_rank", dict(q=sds((3, 128), F32)), ValueError, "q_TGI"),
    ("no_heads", dict(q=sds((3, 0, 32), F32), w=sds((3, 0), F32)), ValueError, "q_TGI"),
    ("k_width", dict(k=sds((50, 64), F32)), ValueError, "k_SI"),
    ("w_shape", dict(w=sds((3, 5), F32)), ValueError, "w_TG"),
    ("starts_int16", dict(starts=sds((3,), jnp.int16)), TypeError, "starts_T"),
    ("ends_length", dict(ends=sds((4,), I32)), ValueError, "ends_T"),
    ("mixed_dtypes", dict(k=sds((50, 32), BF16)), TypeError, "k_SI"),
    ("fp16_q", dict(q=sds((3, 4, 32), F16), k=sds((50, 32), F16)), TypeError, "q_TGI"),
    ("int_w", dict(w=sds((3, 4), I32)), TypeError, "w_TG"),
    ("k_scale_length", dict(k_scale_S=sds((49,), F32)), ValueError, "k_scale_S"),
    ("k_scale_int", dict(k_scale_S=sds((50,), I32)), TypeError, "k_scale_S"),
    # pool mode: k is a pool of 50 rows, 20 columns name rows of it
    ("key_rows_int16", dict(key_rows_S=sds((20,), jnp.int16)), TypeError, "key_rows_S"),
    ("key_rows_rank", dict(key_rows_S=sds((2, 20), I32)), ValueError, "key_rows_S"),
    ("pool_scale_per_column", dict(k_scale_S=sds((20,), F32), key_rows_S=sds((20,), I32)),
     ValueError, "k_scale_S"),  # one scale per pool row, not per column
    ("fp8_pool_float_queries", dict(k=sds((50, 32), FP8), key_rows_S=sds((20,), I32)),
     TypeError, "k_SI"),
]
# A float pool wider (or narrower) than the queries is cast per row, never copied whole.
VALID_POOL = dict(VALID, k=sds((50, 32), BF16), key_rows_S=sds((20,), I32))


# ---- pool mode: sequences' keys in a shared pool of pages ----------------------------------

def paged_key_rows(rng, page_size, lengths, num_keys, shared_pages=1):
  """Row ids [len(lengths), num_keys] of sequences over a shuffled pool of pages, and the
  pool's row count. The first ``shared_pages`` pages are a prefix every sequence reads (prefix
  caching); positions at or past a sequence's length are -1. Page 0 is never used, so the
  row that -1 columns read (row 0) is one no column names."""
  pages = [-(-n // page_size) for n in lengths]
  num_pages = 1 + shared_pages + sum(p - shared_pages for p in pages) + 2  # 2 spare pages
  order = iter(rng.permutation(np.arange(1, num_pages)))
  prefix = [next(order) for _ in range(shared_pages)]
  positions = np.arange(num_keys)
  rows = []
  for n, p in zip(lengths, pages):
    table = np.array(prefix + [next(order) for _ in range(p - shared_pages)] + [0])
    page_of = table[np.minimum(positions // page_size, p)]
    rows.append(np.where(positions < n, page_of * page_size + positions % page_size, -1))
  return np.stack(rows).astype(np.int32), num_pages * page_size


def ragged_windows(rng, T, S):
  """Windows of every kind: empty, causal, random, and reaching past S."""
  starts = rng.integers(0, S // 2, T)
  ends = starts + rng.integers(0, S, T)
  starts[:3], ends[:3] = (0, 0, 5), (0, S, S + 7)
  return starts.astype(np.int32), ends.astype(np.int32)


POOL_T, POOL_G, POOL_I, POOL_S = 9, 4, 32, 100
POOL_LENGTHS = (100, 67, 20)  # ragged; every one past the shared first page at page size 16


def pool_inputs(seed, page_size, dtype, pool_dtype=None):
  """``(q [B, T, G, I], pool [P, I], w, starts, ends, pool scales or None, key_rows [B, S],
  float64 truth [B, T, S] before any fp8 quantization)``; fp8 queries and keys are quantized
  the way the model does (``quantize_indexer_queries``, ``quantize_keys``)."""
  rng = np.random.default_rng(seed)
  B = len(POOL_LENGTHS)
  key_rows, pool_size = paged_key_rows(rng, page_size, POOL_LENGTHS, POOL_S)
  q = rng.standard_normal((B, POOL_T, POOL_G, POOL_I))
  pool = rng.standard_normal((pool_size, POOL_I))
  w = rng.standard_normal((B, POOL_T, POOL_G))
  starts, ends = zip(*(ragged_windows(rng, POOL_T, POOL_S) for _ in range(B)))
  starts, ends = np.stack(starts), np.stack(ends)
  truth = np.stack([numpy_pooled_indexer_logits(q[b], pool, w[b], starts[b], ends[b], None,
                                                key_rows[b]) for b in range(B)])
  if dtype == FP8:
    q, w = quantize_indexer_queries(jnp.asarray(q, F32), jnp.asarray(w, F32))
    pool, scales = quantize_keys(jnp.asarray(pool, F32))
  else:
    q, pool, w = jnp.asarray(q, dtype), jnp.asarray(pool, pool_dtype or dtype), jnp.asarray(w, F32)
    scales = None
  return (q, pool, w, jnp.asarray(starts), jnp.asarray(ends), scales, jnp.asarray(key_rows),
          truth)


POOL_CASES = (  # (name, page size, query dtype, pool dtype)
    ("page1_float32", 1, F32, None),
    ("page16_float32", 16, F32, None),
    ("page64_float32", 64, F32, None),
    ("page16_bfloat16", 16, BF16, None),
    ("page16_fp8", 16, FP8, None),
    ("page16_bfloat16_pool_float32_queries", 16, F32, BF16),
)
POOL_RTOL = {F32: 1e-5, BF16: 2e-2, FP8: 1e-5}  # fp8: vs the dequantized values
FP8_QUANTIZATION_RTOL = 6e-2  # fp8 against the float keys before quantization


class IndexerLogitsTestBase(common.KernelTestBase):

  KERNEL = staticmethod(indexer_logits)
  REFERENCE = staticmethod(indexer_logits_reference)
  POSITIONAL = ("q", "k", "w", "starts", "ends")

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{jnp.dtype(dt).name}", dtype=dt)
      for c in CASES for dt in (jnp.float32, jnp.bfloat16, FP8)
      if dt == jnp.float32 or c["testcase_name"] in ("t3_s100_random_windows", "t64_s1000")
  )
  def test_matches_float64_and_reference(self, T, G, S, dtype, window="causal"):
    I = 32
    q, k, w, starts, ends, k_scale = make_inputs(T + S, T, G, I, S, dtype, window)
    got = self.fn()(q, k, w, starts, ends, k_scale_S=k_scale)
    chex.assert_shape(got, (T, S))
    chex.assert_type(got, jnp.float32)
    got = np.asarray(got, np.float64)
    want = numpy_indexer_logits(q, k, w, starts, ends, k_scale)
    self.assertFalse(np.isnan(got).any())  # NaN-poisoned output: every tile was written
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    inside = np.isfinite(want)
    if inside.any():
      err = np.linalg.norm(got[inside] - want[inside]) / np.linalg.norm(want[inside])
      self.assertLess(err, RTOL[dtype])
    ref = self.reference()(q, k, w, starts, ends, k_scale_S=k_scale)
    np.testing.assert_allclose(got, np.asarray(ref, np.float64), rtol=2e-2, atol=2e-2)

  @parameterized.named_parameters(("float32", jnp.float32, 1e-5), ("bfloat16", jnp.bfloat16, 2e-2))
  def test_matches_loop_on_ragged_windows(self, dtype, tol):
    rng = np.random.default_rng(5)
    t, g, i, s = 7, 4, 32, 23
    q, k, w = rng.standard_normal((t, g, i)), rng.standard_normal((s, i)), rng.standard_normal((t, g))
    starts = np.array([0, 0, 3, 5, 0, 10, 22], np.int32)
    ends = np.array([1, 5, 9, 5, 23, 12, 23], np.int32)
    out = self.fn()(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(w, jnp.float32),
                    jnp.asarray(starts), jnp.asarray(ends))
    ref = numpy_indexer_logits(q, k, w, starts, ends, None)
    out = np.asarray(out, np.float64)
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    finite = np.isfinite(ref)
    assert relative_error(out[finite], ref[finite]) < tol

  def test_applies_fp8_key_scales(self):
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float8_e4m3fn)
    k = jnp.asarray(rng.standard_normal((5, 16)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 5), jnp.float32)
    starts, ends = jnp.zeros(3, jnp.int32), jnp.full(3, 5, jnp.int32)
    plain = self.fn()(q, k, w, starts, ends)
    scaled = self.fn()(q, k, w, starts, ends, k_scale_S=scale)
    np.testing.assert_allclose(scaled, plain * scale[None, :], rtol=1e-6)

  def test_backend_batched_matches_reference(self):
    args = [make_inputs(b, 5, 4, 32, 40, jnp.bfloat16, "random")[:5] for b in range(2)]
    batched = [jnp.stack(xs) for xs in zip(*args)]
    got = self.backend().indexer_logits(*batched)
    chex.assert_trees_all_close(got, jax.jit(jax.vmap(self.REFERENCE))(*batched), rtol=1e-5,
                                atol=1e-5)

  # ---- pool mode ---------------------------------------------------------------------------

  @parameterized.named_parameters(*POOL_CASES)
  def test_pooled_rows_match_float64(self, page_size, dtype, pool_dtype):
    q, pool, w, starts, ends, scales, key_rows, truth = pool_inputs(page_size, page_size,
                                                                    dtype, pool_dtype)
    fn = self.jitted()
    for b in range(len(POOL_LENGTHS)):
      got = fn(q[b], pool, w[b], starts[b], ends[b], k_scale_S=scales, key_rows_S=key_rows[b])
      chex.assert_shape(got, (POOL_T, POOL_S))
      chex.assert_type(got, jnp.float32)
      got = np.asarray(got, np.float64)
      want = numpy_pooled_indexer_logits(q[b], pool, w[b], starts[b], ends[b], scales,
                                         key_rows[b])
      self.assertFalse(np.isnan(got).any())
      np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
      inside = np.isfinite(want)
      self.assertTrue(inside.any())
      self.assertLess(relative_error(got[inside], want[inside]), POOL_RTOL[dtype])
      if dtype == FP8:
        self.assertLess(relative_error(got[inside], truth[b][inside]), FP8_QUANTIZATION_RTOL)

  def test_pooled_rows_equal_the_gathered_keys(self):
    """Pool mode scores what the contiguous call scores on the gathered rows."""
    q, pool, w, starts, ends, _, key_rows, _ = pool_inputs(7, 16, F32)
    rows = np.asarray(key_rows[1])
    has_key = rows >= 0
    ends = jnp.minimum(ends[1], int(has_key.sum()))  # the contiguous keys end at the length
    got = self.jitted()(q[1], pool, w[1], starts[1], ends, key_rows_S=key_rows[1])
    want = self.fn()(q[1], pool[rows[has_key]], w[1], starts[1], ends)
    np.testing.assert_allclose(np.asarray(got)[:, has_key], np.asarray(want), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[:, ~has_key], -np.inf)

  @parameterized.named_parameters(common.named_product(poison=common.POISONS))
  def test_pool_rows_no_column_names_stay_hidden(self, poison):
    """NaN/inf in pool rows a sequence does not name (row 0, which its -1 columns read, and
    the other sequences' pages) never reach its logits."""
    q, pool, w, starts, ends, scales, key_rows, _ = pool_inputs(8, 16, FP8)
    named = np.unique(np.asarray(key_rows[2]))
    unnamed = np.setdiff1d(np.arange(pool.shape[0]), named)
    self.assertIn(0, unnamed)
    bad_pool = pool.at[unnamed].set(poison)
    bad_scales = scales.at[unnamed].set(poison)
    fn = self.jitted()
    args = (q[2], w[2], starts[2], ends[2])
    call = lambda p, sc: np.asarray(fn(args[0], p, *args[1:], k_scale_S=sc,
                                       key_rows_S=key_rows[2]))
    np.testing.assert_array_equal(call(bad_pool, bad_scales), call(pool, scales))

  def test_backend_pooled_rows_match_per_sequence(self):
    q, pool, w, starts, ends, scales, key_rows, _ = pool_inputs(9, 16, FP8)
    got = self.backend().indexer_logits(q, pool, w, starts, ends, k_scale_BS=scales,
                                        key_rows_BS=key_rows)
    chex.assert_shape(got, (len(POOL_LENGTHS), POOL_T, POOL_S))
    fn = self.jitted()
    for b in range(len(POOL_LENGTHS)):
      want = fn(q[b], pool, w[b], starts[b], ends[b], k_scale_S=scales, key_rows_S=key_rows[b])
      np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want))

  @parameterized.named_parameters(
      ("int16", sds((2, 20), jnp.int16), TypeError),
      ("unbatched", sds((20,), I32), ValueError),
      ("other_batch", sds((3, 20), I32), ValueError),
  )
  def test_backend_refuses_bad_key_rows(self, key_rows, error):
    args = (sds((2, 3, 4, 32), F32), sds((50, 32), F32), sds((2, 3, 4), F32), sds((2, 3), I32),
            sds((2, 3), I32), key_rows)
    fn = lambda *a: self.backend().indexer_logits(*a[:5], key_rows_BS=a[5])
    with self.assertRaisesRegex(error, "key_rows_BS"):
      jax.eval_shape(fn, *args)

  def test_valid_pool_arguments_pass(self):
    names = ("q", "k", "w", "starts", "ends", "key_rows_S")
    fn = lambda *a: self.fn(jit=False)(*a[:5], key_rows_S=a[5])
    out = jax.eval_shape(fn, *(VALID_POOL[name] for name in names))
    self.assertEqual((out.shape, out.dtype), ((3, 20), F32))

  def test_empty_pool_scores_nothing(self):
    args = (jnp.ones((3, 4, 32), F32), jnp.ones((0, 32), F32), jnp.ones((3, 4), F32),
            jnp.zeros((3,), I32), jnp.full((3,), 5, I32))
    logits = self.fn()(*args, key_rows_S=jnp.full((5,), -1, I32))
    np.testing.assert_array_equal(np.asarray(logits), np.full((3, 5), -np.inf))

  # ---- NaN and inf in keys outside a query's window never reach it -------------------------

  @parameterized.named_parameters(common.named_product(
      case={c: c for c in MASKING_CASES}, poison=common.POISONS))
  def test_keys_outside_a_window_stay_hidden(self, case, poison):
    which, rows, affected_rows = MASKING_CASES[case]
    fn = self.jitted(MASKING_CONFIG)
    clean_in = masking_inputs()
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

  # ---- bad inputs and degenerate sizes -----------------------------------------------------

  @parameterized.named_parameters(common.bad_input_cases(VALID, BAD_INPUTS))
  def test_refuses_bad_input(self, args, error, argument):
    self.assert_refused_like_the_reference(args, error, argument)

  def test_valid_arguments_pass(self):
    self.assert_accepted(VALID)

  @parameterized.named_parameters(("no_keys", 3, 0), ("no_tokens", 0, 20))
  def test_degenerate_sizes(self, T, S):
    args = (jnp.ones((T, 4, 32), F32), jnp.ones((S, 32), F32), jnp.ones((T, 4), F32),
            jnp.zeros((T,), I32), jnp.full((T,), S, I32))
    logits = self.fn()(*args)
    assert logits.shape == (T, S) and logits.dtype == F32


class IndexerLogitsKernelTestBase(IndexerLogitsTestBase):
  """The suite, and what only the kernel has: a block config, refused if another op's."""

  def test_refuses_a_foreign_config(self):
    self.assert_kernel_refuses_config(VALID, SparseMQAKernelConfig())
