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
    with pytest.raises(NotImplementedError, match="backend 'mosaic-gpu': .*0.11 or newer"):
      backends.get_backend("mosaic-gpu")


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


def test_mosaic_gpu_before_hopper_is_refused(fresh_support, monkeypatch):
  if not gpu_support.mosaic_gpu().available:
    pytest.skip(gpu_support.mosaic_gpu().reason)
  monkeypatch.setattr(backends, "_nvidia_gpu", lambda: FakeGpu("8.0", "NVIDIA A100"))
  with pytest.raises(ValueError, match="needs an sm_90.*A100 is sm_80: use 'pallas'"):
    backends.get_backend("mosaic-gpu")


@pytest.mark.parametrize("value, expected", [("9.0", (9, 0)), ("10.0", (10, 0)), (None, None)])
def test_compute_capability(value, expected):
  assert gpu_support.compute_capability(FakeGpu(value)) == expected
