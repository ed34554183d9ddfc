"""``gpu_support``, the one place that says which Pallas GPU backends this jax runs, and how
``get_backend`` follows it: Triton's deprecation stated, its removal handled, Mosaic GPU
refused clearly where this jax or GPU cannot run it. A fake device stands in for a GPU."""

import dataclasses
import importlib

import pytest

from mla_jax import backends
from mla_jax.backends import gpu_support


@dataclasses.dataclass
class FakeGpu:
  compute_capability: str
  device_kind: str = "NVIDIA H200"
  platform: str = "gpu"


@pytest.fixture
def fresh_support():
  gpu_support.pallas_triton.cache_clear()
  gpu_support.mosaic_gpu.cache_clear()
  yield
  gpu_support.pallas_triton.cache_clear()
  gpu_support.mosaic_gpu.cache_clear()


def test_the_table_follows_the_installed_jax(fresh_support):
  triton, mosaic = gpu_support.gpu_backends()
  assert triton.available  # every supported jax still has it
  deprecated = gpu_support.jax_version()[:2] >= gpu_support.TRITON_DEPRECATED_SINCE
  assert ("deprecated by JAX" in triton.note) is deprecated
  # Mosaic GPU needs the GPU interpreter its checks run on: jax 0.11 and later.
  assert mosaic.available is deprecated
  if not mosaic.available:
    assert "needs jax 0.11 or newer" in mosaic.reason
    with pytest.raises(gpu_support.BackendUnavailable,
                       match="backend 'mosaic-gpu': .*0.11 or newer"):
      backends.get_backend("mosaic-gpu")


def test_the_cli_names_an_unavailable_backend(fresh_support, monkeypatch, capsys):
  from mla_jax import cli

  monkeypatch.setattr(gpu_support, "mosaic_gpu", lambda: gpu_support.GpuBackendSupport(
      "mosaic-gpu", "jax 9.9: plgpu.kernel is missing; needs jax 0.11 or newer"))
  assert cli.main(["generate", "--preset", "recall", "--prompt", "aQ", "--max-new-tokens", "1",
                   "--backend", "mosaic-gpu", "--quiet"]) == 2
  assert "error: backend 'mosaic-gpu': jax 9.9" in capsys.readouterr().err


def test_without_triton_pallas_is_refused_and_auto_moves_to_mosaic(fresh_support, monkeypatch):
  """When jax removes Pallas Triton: 'pallas' names the reason, 'auto' on Hopper takes Mosaic
  GPU (where this jax has it)."""
  real_import = importlib.import_module

  def no_triton(name, *args):
    if name == "jax.experimental.pallas.triton":
      raise ImportError("No module named 'jax.experimental.pallas.triton'")
    return real_import(name, *args)

  monkeypatch.setattr(importlib, "import_module", no_triton)
  monkeypatch.setattr(backends, "_nvidia_gpu", lambda: FakeGpu("9.0"))
  assert not gpu_support.pallas_triton().available
  with pytest.raises(NotImplementedError, match="no Pallas Triton backend.*'mosaic-gpu'"):
    backends.get_backend("pallas")
  if gpu_support.mosaic_gpu().available:
    from mla_jax.backends.mosaic_gpu import MosaicGpuBackend

    assert backends.get_backend("auto") == MosaicGpuBackend(interpret=False)


def test_auto_stays_pallas_triton_while_jax_has_it(fresh_support, monkeypatch):
  from mla_jax.backends.pallas import PallasTritonBackend

  monkeypatch.setattr(backends, "_nvidia_gpu", lambda: FakeGpu("9.0"))
  assert type(backends.get_backend("auto")) is PallasTritonBackend


@pytest.mark.parametrize("value, expected", [("9.0", (9, 0)), ("10.0", (10, 0)), (None, None)])
def test_compute_capability(value, expected):
  assert gpu_support.compute_capability(FakeGpu(value)) == expected


_WITHOUT_TRITON = r"""
import importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):  # jax as it will be once Pallas Triton is gone
  def find_spec(self, name, path, target=None):
    if name == "jax.experimental.pallas.triton":
      raise ImportError("No module named 'jax.experimental.pallas.triton'")

sys.meta_path.insert(0, NoTriton())
from mla_jax.backends import get_backend, gpu_support
result = {}
try:
  get_backend("pallas")
except NotImplementedError as e:
  result["pallas"] = str(e)
if gpu_support.mosaic_gpu().available:
  import jax, jax.numpy as jnp
  from tests.test_mosaic_gpu_backend import _step_summaries
  backend = get_backend("mosaic-gpu")
  result["dense"] = backend.supports_dense_mha_prefill or backend.supports_masked_mha_prefill
  result["triton_ops"] = sorted(backend.TRITON_OPS)
  for attention in ("mqa-only", "dense-capable"):
    steps = _step_summaries(attention, backend).values()
    result[attention] = [sorted({route for route, _ in steps}),
                         sorted(set().union(*(s.kernels for _, s in steps)))]
  try:
    backend.kernel_for("sparse_mqa", jax.ShapeDtypeStruct((1, 64, 576), jnp.float32),
                       jax.ShapeDtypeStruct((8, 576), jnp.float32), 512)
  except NotImplementedError as e:
    result["float32"] = str(e)
  loss = lambda q: backend.sparse_mqa(q, jnp.ones((1, 8, 192), jnp.bfloat16),
                                      jnp.zeros((1, 1, 64), jnp.int32), sm_scale=0.1,
                                      d_v=128)[0].astype(jnp.float32).sum()
  try:
    jax.eval_shape(jax.grad(loss), jax.ShapeDtypeStruct((1, 1, 64, 192), jnp.bfloat16))
  except gpu_support.BackendUnavailable as e:
    result["grad"] = str(e)
print(json.dumps(result))
"""


def test_without_pallas_triton_mosaic_gpu_serves_with_no_dense_path():
  """A fresh process whose jax lacks Pallas Triton: 'pallas' is refused with the reason; the
  Mosaic backend declares no dense or masked MHA, so both model kinds compile every engine
  step on the two Mosaic kernels alone (routing never builds a path it cannot run), and an
  input only Triton could take is refused naming both reasons."""
  import json
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True,
                        cwd=root, env={**os.environ, "PYTHONPATH": root}, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert "no Pallas Triton backend" in result["pallas"]
  if not gpu_support.mosaic_gpu().available:
    return
  mosaic_kernels = ["indexer_logits_mosaic", "sparse_mqa_mosaic_ws"]
  assert result["dense"] is False and result["triton_ops"] == []
  assert result["mqa-only"] == result["dense-capable"] == [["SPARSE_MQA"], mosaic_kernels]
  assert "bf16 or f16 queries only" in result["float32"]
  assert "no Pallas Triton to run it instead" in result["float32"]
  assert "no backward kernels without Pallas Triton" in result["grad"]


def test_the_deprecation_is_said_once_where_it_applies(fresh_support, caplog):
  backends._say_once.cache_clear()
  with caplog.at_level("INFO", logger="mla_jax.backends"):
    backends.get_backend("pallas")
    backends.get_backend("pallas")
  said = [r.getMessage() for r in caplog.records if "deprecated by JAX" in r.getMessage()]
  deprecated = gpu_support.jax_version()[:2] >= gpu_support.TRITON_DEPRECATED_SINCE
  assert len(said) == (1 if deprecated else 0)


def test_mosaic_gpu_on_a_gpu_other_than_hopper_is_refused(fresh_support, monkeypatch):
  """wgmma is sm_90a's alone: an A100 and a B200 are both refused, naming the GPU."""
  monkeypatch.setattr(gpu_support, "mosaic_gpu",
                      lambda: gpu_support.GpuBackendSupport("mosaic-gpu", None))
  for capability, kind in (("8.0", "NVIDIA A100"), ("10.0", "NVIDIA B200")):
    monkeypatch.setattr(backends, "_nvidia_gpu", lambda: FakeGpu(capability, kind))
    with pytest.raises(gpu_support.BackendUnavailable,
                       match=f"need Hopper .*{kind} is sm_{capability.replace('.', '')}"):
      backends.get_backend("mosaic-gpu")


def test_auto_without_triton_off_hopper_is_xla(fresh_support, monkeypatch):
  monkeypatch.setattr(gpu_support, "pallas_triton", lambda: gpu_support.GpuBackendSupport(
      "pallas", "jax 9.9 has no Pallas Triton backend"))
  monkeypatch.setattr(gpu_support, "mosaic_gpu",
                      lambda: gpu_support.GpuBackendSupport("mosaic-gpu", None))
  monkeypatch.setattr(backends, "_nvidia_gpu", lambda: FakeGpu("8.0", "NVIDIA A100"))
  assert backends.get_backend("auto") == backends.XlaBackend()
  monkeypatch.setattr(backends, "_nvidia_gpu", lambda: FakeGpu("9.0"))
  assert backends.get_backend("auto").name == "mosaic_gpu"
