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
from mla_jax.v4.plan import cache_bytes, param_bytes


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("capacity", [64, 128])
def test_cache_bytes_are_what_init_cache_allocates(capacity):
  config = tiny_v4_config()
  model = V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla", param_dtype=jnp.bfloat16)
  per_token, per_sequence = cache_bytes(config, itemsize=2)
  assert _bytes(model.init_cache(1, capacity)) == per_sequence + capacity * per_token


def test_param_bytes_are_the_models():
  config = tiny_v4_config()
  model = V4CausalLM(config, rngs=nnx.Rngs(0), backend="xla", param_dtype=jnp.bfloat16)
  assert param_bytes(config) == _bytes(nnx.state(model))


@pytest.mark.slow
def test_cli_plans_v4_flash(capsys):
  assert cli.main(["plan", "--model", "deepseek_v4_flash"]) == 0
  out = capsys.readouterr().out
  assert "43 layers (2 sliding, 21 CSA, 20 HCA)" in out
  assert "6,880 B per token" in out  # 21 x (512 + 128) x 2 / 4 + 20 x 512 x 2 / 128
  with pytest.raises(SystemExit, match="--mesh"):
    cli.main(["plan", "--model", "deepseek_v4_flash", "--mesh", "tensor=8"])
