"""Attention backends: ``XlaBackend`` (anywhere), ``PallasTritonBackend`` (NVIDIA GPUs),
``MosaicGpuBackend`` (Hopper and newer; Pallas-Triton for what it lacks)."""

from __future__ import annotations

import functools
import logging

import jax

from mla_jax.backends import gpu_support
from mla_jax.backends.base import Backend
from mla_jax.backends.xla import XlaBackend

BACKEND_NAMES = ("auto", "xla", "pallas", "mosaic-gpu")
logger = logging.getLogger(__name__)


@functools.cache
def _say_once(note: str) -> None:
  logger.info(note)


def _nvidia_gpu():
  """The first device when it is an NVIDIA GPU, else ``None``."""
  device = jax.devices()[0]
  return device if device.platform == "gpu" and "nvidia" in device.device_kind.lower() else None


def get_backend(name: str | Backend = "auto") -> Backend:
  """Resolves ``"auto" | "xla" | "pallas" | "mosaic-gpu"`` (or passes a Backend through).

  ``"auto"`` is Pallas-Triton on an NVIDIA GPU while this jax has it (Mosaic GPU on Hopper
  once it does not; ``gpu_support``) and XLA everywhere else. An explicit ``"pallas"`` or
  ``"mosaic-gpu"`` off an NVIDIA GPU runs the kernels in interpret mode (slow; for testing).

  Raises:
    ValueError: an unknown name, or ``"mosaic-gpu"`` on a GPU older than Hopper.
    gpu_support.BackendUnavailable (a NotImplementedError): a GPU backend this jax does not
      support, with the reason.
  """
  if isinstance(name, Backend):
    return name
  if name not in BACKEND_NAMES:
    raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
  gpu = _nvidia_gpu()
  if name == "auto":
    if gpu is None:
      return XlaBackend()
    name = "pallas" if gpu_support.pallas_triton().available else "mosaic-gpu"
  if name == "xla":
    return XlaBackend()
  support = gpu_support.pallas_triton() if name == "pallas" else gpu_support.mosaic_gpu()
  if not support.available:
    raise gpu_support.BackendUnavailable(f"backend {name!r}: {support.reason}")
  if support.note:
    _say_once(f"backend {name!r}: {support.note}")
  if name == "pallas":
    from mla_jax.backends.pallas import PallasTritonBackend  # imports Pallas only when asked for

    return PallasTritonBackend(interpret=gpu is None)
  capability = None if gpu is None else gpu_support.compute_capability(gpu)
  if capability is not None and capability < gpu_support.MOSAIC_MIN_COMPUTE_CAPABILITY:
    raise ValueError(f"backend 'mosaic-gpu' needs an sm_90 (Hopper) GPU or newer; "
                     f"{gpu.device_kind} is sm_{capability[0]}{capability[1]}: use 'pallas'")
  from mla_jax.backends.mosaic_gpu import MosaicGpuBackend

  return MosaicGpuBackend(interpret=gpu is None)


__all__ = ["BACKEND_NAMES", "Backend", "XlaBackend", "get_backend"]
