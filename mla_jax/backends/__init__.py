"""Attention backends: ``XlaBackend`` (anywhere), ``PallasTritonBackend`` (NVIDIA GPUs),
``MosaicGpuBackend`` (Hopper; Pallas-Triton for what it lacks)."""

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
    ValueError: an unknown name.
    gpu_support.BackendUnavailable (a NotImplementedError): a GPU backend this jax does not
      support (or ``"mosaic-gpu"`` on a GPU other than Hopper), with the reason.
  """
  if isinstance(name, Backend):
    return name
  if name not in BACKEND_NAMES:
    raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
  if name == "xla":
    return XlaBackend()
  gpu = _nvidia_gpu()
  if name == "auto":
    name = _auto_gpu_backend(gpu)
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
  if gpu is not None and (reason := gpu_support.mosaic_refuses(gpu)) is not None:
    raise gpu_support.BackendUnavailable(f"backend 'mosaic-gpu': {reason}")
  from mla_jax.backends.mosaic_gpu import MosaicGpuBackend

  return MosaicGpuBackend(interpret=gpu is None)


def _auto_gpu_backend(gpu) -> str:
  """``"auto"``: Pallas-Triton on an NVIDIA GPU while jax has it, Mosaic GPU on Hopper once it
  does not, XLA everywhere else (said once when a GPU is left to XLA)."""
  if gpu is None:
    return "xla"
  if gpu_support.pallas_triton().available:
    return "pallas"
  if gpu_support.mosaic_gpu().available and gpu_support.mosaic_refuses(gpu) is None:
    return "mosaic-gpu"
  _say_once(f"backend 'auto': {gpu.device_kind} runs the XLA references: "
            f"{gpu_support.pallas_triton().reason}")
  return "xla"


__all__ = ["BACKEND_NAMES", "Backend", "XlaBackend", "get_backend"]
