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
from mla_jax.v4.plan import abstract_model, cache_bytes, param_bytes


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("capacity", [64, 128])
def test_cache_bytes_are_what_init_cache_allocates(capacity):
  config = tiny_v4_config()
  model = V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla", param_dtype=jnp.bfloat16)
  per_token, per_sequence = cache_bytes(config, itemsize=2)
  assert _bytes(model.init_cache(1, capacity).layers) == per_sequence + capacity * per_token


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
  with pytest.raises(SystemExit, match="--cache-dtype fp8 and --lower"):
    cli.main(["plan", "--model", "deepseek_v4_flash", "--lower"])
