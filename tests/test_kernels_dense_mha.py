"""Dense causal MHA kernel (interpret mode) vs a float64 NumPy computation and the jnp reference."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from mla_jax.backends.pallas import PallasTritonBackend
from mla_jax.backends.xla import XlaBackend
from pallas_kernels.dense_mha import dense_mha, dense_mha_reference
from tests.numpy_kernels import assert_attention_matches, numpy_dense_mha

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_inputs(seed, T, S, H, D, V, dtype):
  rng = np.random.default_rng(seed)
  return tuple(
      jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((T, H, D), (S, H, D), (S, H, V))
  )


def assert_matches(out, lse, q, k, v, sm_scale, q_offset, kv_len, dtype):
  assert_attention_matches(out, lse, *numpy_dense_mha(q, k, v, sm_scale, q_offset, kv_len),
                           rtol=RTOL[dtype], lse_rtol=1e-5, lse_atol=1e-4)


# (T, S, H, q_offset, kv_len); the tiny MLA widths are qk 48 = 32 nope + 16 rope, v 32.
CASES = (
    dict(testcase_name="t1_kv1_h1", T=1, S=1, H=1, q_offset=0, kv_len=1),
    dict(testcase_name="t3_kv100_h4_decode_like", T=3, S=100, H=4, q_offset=97, kv_len=100),
    dict(testcase_name="t64_kv100_h4_padded_keys", T=64, S=128, H=4, q_offset=36, kv_len=100),
    dict(testcase_name="t257_kv257_h4_prefill", T=257, S=257, H=4, q_offset=0, kv_len=257),
    dict(testcase_name="t64_kv1000_h16_context", T=64, S=1000, H=16, q_offset=936, kv_len=1000),
    dict(testcase_name="t3_kv0_h4_empty_rows", T=3, S=16, H=4, q_offset=0, kv_len=0),
)


class DenseMHAKernelTest(chex.TestCase):

  @parameterized.named_parameters(
      dict(c, testcase_name=f"{c['testcase_name']}_{dt.__name__}", dtype=dt)
      for c in CASES for dt in (jnp.float32, jnp.bfloat16)
      if dt == jnp.float32 or c["testcase_name"] in ("t3_kv100_h4_decode_like", "t257_kv257_h4_prefill")
  )
  def test_matches_float64_and_reference(self, T, S, H, q_offset, kv_len, dtype):
    D, V, sm_scale = 48, 32, 48**-0.5
    q, k, v = make_inputs(T + S, T, S, H, D, V, dtype)
    out, lse = dense_mha(q, k, v, sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len, interpret=True)
    chex.assert_shape((out, lse), ((T, H, V), (T, H)))
    chex.assert_type(out, dtype)
    assert_matches(out, lse, q, k, v, sm_scale, q_offset, kv_len, dtype)
    ref = dense_mha_reference(q, k, v, sm_scale=sm_scale, q_offset=q_offset, kv_len=kv_len)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    chex.assert_trees_all_close(
        (out.astype(jnp.float32), lse), (ref[0].astype(jnp.float32), ref[1]), rtol=tol, atol=tol
    )

  @parameterized.named_parameters(
      ("deepseek_qk192_v128", 192, 128), ("glm_qk256_v256", 256, 256)
  )
  def test_model_widths_bf16(self, D, V):
    q, k, v = make_inputs(0, 40, 70, 2, D, V, jnp.bfloat16)
    out, lse = dense_mha(q, k, v, sm_scale=D**-0.5, q_offset=30, kv_len=70, interpret=True)
    assert_matches(out, lse, q, k, v, D**-0.5, 30, 70, jnp.bfloat16)

  def test_traced_offsets_under_jit(self):
    q, k, v = make_inputs(1, 9, 40, 2, 48, 32, jnp.float32)
    fn = jax.jit(functools.partial(dense_mha, sm_scale=0.2, interpret=True))
    for q_offset, kv_len in ((0, 9), (31, 40), (5, 12)):
      out, lse = fn(q, k, v, q_offset=jnp.int32(q_offset), kv_len=jnp.int32(kv_len))
      assert_matches(out, lse, q, k, v, 0.2, q_offset, kv_len, jnp.float32)

  def test_backend_batched_matches_xla(self):
    q, k, v = (jnp.stack([x, x[::-1]]) for x in make_inputs(2, 9, 20, 2, 48, 32, jnp.float32))
    offsets, lengths = jnp.array([0, 11], jnp.int32), jnp.array([9, 20], jnp.int32)
    kwargs = dict(sm_scale=0.2, q_offset_B=offsets, kv_len_B=lengths)
    got = PallasTritonBackend(interpret=True).dense_mha(q, k, v, **kwargs)
    chex.assert_trees_all_close(got, XlaBackend().dense_mha(q, k, v, **kwargs), rtol=1e-5, atol=1e-5)
