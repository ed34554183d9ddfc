"""Small builders shared by the module tests."""

import dataclasses
import functools
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

import mla_jax as m
from mla_jax import testing as mt
from mla_jax.backends import XlaBackend


@dataclasses.dataclass(frozen=True)
class XlaNoDenseBackend(XlaBackend):
  """An XLA backend configured without the dense-MHA prefill kernel."""

  name: ClassVar[str] = "xla_no_dense"
  supports_dense_mha_prefill: ClassVar[bool] = False


def tiny_no_indexer() -> m.MLAConfig:
  return dataclasses.replace(m.tiny(), indexer=None)


def make_pair(config=None, backend=None, seed=0):
  """An MLAAttention and a DeepseekV32Attention sharing the same random weights."""
  config = config or m.tiny()
  backend = backend or XlaBackend()
  dense = m.MLAAttention(config, rngs=nnx.Rngs(seed), backend=backend)
  mt.randomize_params(dense, seed + 1)
  mqa = m.DeepseekV32Attention(config, rngs=nnx.Rngs(seed), backend=backend)
  nnx.update(mqa, nnx.state(dense, nnx.Param))
  return dense, mqa


def fresh_cache(config, batch=1, capacity=96):
  return m.init_layer_cache(config, batch, capacity, jnp.float32)


@functools.partial(nnx.jit, static_argnames=("num_cached_tokens", "force_mqa"))
def _jitted_call(layer, x, cache, new_lens, num_cached_tokens, force_mqa):
  return layer(x, cache, new_lens_B=new_lens, num_cached_tokens=num_cached_tokens,
               force_mqa=force_mqa)


def call(layer, x, cache, *, new_lens=None, force_mqa=False):
  """A jitted layer call; the cached bound is read from the concrete cache, as eager does."""
  if new_lens is None:
    new_lens = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
  cached = int(np.asarray(cache.lengths_B).max())
  return _jitted_call(layer, x, cache, jnp.asarray(new_lens, jnp.int32), cached, force_mqa)
