"""Small builders shared by the module tests: layers, models, caches, the layer-by-layer
forward, HF config edits and a free port for multi-process tests."""

import dataclasses
import functools
import socket
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

import mla_jax as m
from mla_jax import testing as mt
from mla_jax.backends import XlaBackend
from mla_jax.models.lm import CausalLM


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
  cached = int(np.asarray(cache.num_cached_B).max())
  return _jitted_call(layer, x, cache, jnp.asarray(new_lens, jnp.int32), cached, force_mqa)


@functools.lru_cache(maxsize=None)
def lm(config, backend="xla", seed=None) -> CausalLM:
  """A ``CausalLM`` built once per session (read-only in the tests): ``Rngs(0)`` weights,
  randomized with ``seed`` (``testing.randomize_params``) unless it is None."""
  model = CausalLM(config, rngs=nnx.Rngs(0), backend=backend)
  if seed is not None:
    mt.randomize_params(model, seed)
  return model


def layer_by_layer(model, ids_BT, capacity, shared_topk_BTK=None):
  """Logits with every layer run as a module of its own (no scan), the top-k passed by hand.

  A layer that shares its top-k gets the last full layer's, or ``shared_topk_BTK`` if given.
  """
  caches = model.init_cache(ids_BT.shape[0], capacity)
  plan = model.step_plan(ids_BT.shape[1], 0, capacity=capacity)
  h, topk = model.model.embed_tokens(ids_BT), None
  for i in range(model.config.num_layers):
    layer = model.layer_module(i)
    shared = layer.self_attn.shares_topk
    given = (topk if shared_topk_BTK is None else shared_topk_BTK) if shared else None
    h, _, layer_topk = layer(h, caches.layer(i), plan, shared_topk_BTK=given)
    if not shared:
      topk = layer_topk
  return model.lm_head(model.model.norm(h))


MISSING = object()


def patch_hf_config(hf: dict, missing=MISSING, **changes) -> dict:
  """A copy of the HF config dict ``hf`` with ``changes``; a value ``is missing`` removes its key."""
  hf = dict(hf)
  for key, value in changes.items():
    if value is missing:
      hf.pop(key, None)
    else:
      hf[key] = value
  return hf


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now (for a jax.distributed coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def two_process_engine(tmp_path, mesh_spec: str):
  """Runs ``multiprocess_worker.py``'s engine job in two processes (gloo) over ``mesh_spec``:
  the worker's output (``tokens``, ``devices``) and its prompts as lists."""
  port, out = free_port(), tmp_path / "out.npz"
  worker = Path(__file__).with_name("multiprocess_worker.py")
  procs = [subprocess.Popen([sys.executable, str(worker), str(port), "2", str(i), mesh_spec,
                             str(out), "engine"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
  logs = [p.communicate(timeout=400)[0].decode() for p in procs]
  assert all(p.returncode == 0 for p in procs), logs
  got = np.load(out)
  prompts = [p.tolist() for p in np.split(got["prompt_ids"], np.cumsum(got["prompt_lens"])[:-1])]
  return got, prompts


def routed_case(rng, num_experts: int, d: int, tokens: int = 16, top: int = 2):
  """Inputs of a grouped expert matmul: ``x`` [T, D], expert ids [T, top] in which expert 2
  is never picked and expert 1 by many, and combine weights."""
  x = rng.standard_normal((tokens, d)).astype(np.float32)
  idx = np.stack([rng.permutation([0, 1, 3])[:top] for _ in range(tokens)]).astype(np.int32)
  idx[:6, 0] = 1
  combine = rng.uniform(0.1, 1.0, (tokens, top)).astype(np.float32)
  return x, idx, combine


def routed_reference(x, idx, combine, gate, up, down, limit=None):
  """float64 ``sum_k combine * down(silu(gate x) * up x)`` of each token's experts (gate and
  up clipped at ``limit`` first, as DeepSeek-V4's SwiGLU)."""
  expected = np.zeros((x.shape[0], down.shape[1]))
  for t in range(x.shape[0]):
    for e, w in zip(idx[t], combine[t]):
      g, u = gate[e] @ x[t], up[e] @ x[t]
      if limit is not None:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
      expected[t] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
  return expected

