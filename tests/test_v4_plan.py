"""DeepSeek-V4 plans: the cache bytes are those ``init_cache`` allocates, the parameter bytes
those a model holds; the full-size plan through the CLI (slow: two full-size eval_shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from mla_jax import cli
from mla_jax.v4.config import tiny_v4_config
from mla_jax.v4.model import V4CausalLM
from mla_jax.serving.engine import page_bytes
from mla_jax.v4.plan import V4_SIZES, abstract_model, cache_bytes, param_bytes


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8"])
def test_cache_bytes_are_what_init_cache_and_an_engines_pools_allocate(cache_dtype):
  """Per sequence the rings, per token the entries (fp8: V3.2's layouts); an engine's page is
  a page of entries and of token ids (``page_bytes``, on the same abstract pools). Entries
  of 28 + 8 values: 48 B in fp8, whole bytes a token in every layer."""
  config = tiny_v4_config(head_dim=36)
  model = V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla", param_dtype=jnp.bfloat16)
  per_token, per_sequence = cache_bytes(config, cache_dtype)
  for capacity in (64, 128):
    caches = model.init_cache(1, capacity, cache_dtype)
    assert _bytes(caches.layers) == per_sequence + capacity * per_token
  assert page_bytes(model, 64, cache_dtype) == 64 * (per_token + 4)  # + the token ids


def test_cache_bytes_of_the_full_sizes():
  """docs/models.md's figures: V4-Flash caches 6,880 B a token in bf16, 3,958 in fp8; the
  rings stay bf16 (11.2 MiB a sequence)."""
  flash, pro = V4_SIZES["deepseek_v4_flash"], V4_SIZES["deepseek_v4_pro"]
  assert cache_bytes(flash, "bf16") == (6880, 11739136)
  assert cache_bytes(flash, "fp8") == (3958, 11739136)
  assert cache_bytes(pro, "bf16")[0] == 9536 and cache_bytes(pro, "fp8")[0] == 5487
  with pytest.raises(ValueError, match="cache_dtype must be one of"):
    cache_bytes(flash, "float16")


def test_param_bytes_are_the_models():
  config = tiny_v4_config()
  model = V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla", param_dtype=jnp.bfloat16)
  assert param_bytes(abstract_model(config)) == (_bytes(nnx.state(model)),) * 2


@pytest.mark.slow  # a full-size eval_shape (about 10 s)
def test_cli_plans_v4_flash_as_released(capsys):
  assert cli.main(["plan", "--model", "deepseek_v4_flash", "--dtype", "fp8",
                   "--mesh", "tensor=8", "--mesh", "data=2,tensor=2,expert=1"]) == 0
  out = capsys.readouterr().out
  assert "43 layers (2 sliding, 21 CSA, 20 HCA)" in out
  assert "fp8 projections, fp4 (MXFP4) routed experts" in out
  assert "6,880 B per token" in out  # 21 x (512 + 128) x 2 / 4 + 20 x 512 x 2 / 128
  assert "| tensor=8 | 8 | 19.2 |" in out
  assert "| H200 141GB | 1 | none: the weights do not fit |" in out
  assert "| H200 141GB | 4 | data=2,tensor=2,expert=1 | 73.2 | 124 |" in out
  assert "`self_attn\\.o_a_proj\\.weight(_scale_inv)?$` | `P('tensor', None)`" in out
  with pytest.raises(SystemExit, match="--lower is not supported for deepseek_v4_flash"):
    cli.main(["plan", "--model", "deepseek_v4_flash", "--lower"])
