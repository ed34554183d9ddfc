"""Attention backends: ``XlaBackend`` (anywhere), ``PallasTritonBackend`` (NVIDIA GPUs)."""

from __future__ import annotations

import jax

from mla_jax.backends.base import Backend
from mla_jax.backends.xla import XlaBackend

BACKEND_NAMES = ("auto", "xla", "pallas")


def _on_nvidia_gpu() -> bool:
  devices = jax.devices()
  return devices[0].platform == "gpu" and "nvidia" in devices[0].device_kind.lower()


def get_backend(name: str | Backend = "auto") -> Backend:
  """Resolves ``"auto" | "xla" | "pallas"`` (or passes a Backend instance through).

  ``"auto"`` is Pallas-Triton on an NVIDIA GPU and XLA everywhere else. An explicit
  ``"pallas"`` off an NVIDIA GPU runs the kernels in interpret mode (slow; for testing).
  """
  if isinstance(name, Backend):
    return name
  if name not in BACKEND_NAMES:
    raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
  if name == "xla" or (name == "auto" and not _on_nvidia_gpu()):
    return XlaBackend()
  from mla_jax.backends.pallas import PallasTritonBackend  # imports Pallas only when asked for

  return PallasTritonBackend(interpret=not _on_nvidia_gpu())


__all__ = ["BACKEND_NAMES", "Backend", "XlaBackend", "get_backend"]
