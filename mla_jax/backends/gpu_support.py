"""Which Pallas GPU backends the installed jax supports: the one place that decides it.

=============  ===============================  ==================================
jax            ``"pallas"`` (Pallas-Triton)     ``"mosaic-gpu"`` (Hopper, sm_90a)
=============  ===============================  ==================================
0.10.x         supported                        no: no GPU interpreter to test on
0.11, 0.12     supported; deprecated by JAX     supported
Triton gone    unavailable (the reason named)   supported; ``"auto"`` moves to it
                                                (other GPUs: ``"auto"`` is XLA)
=============  ===============================  ==================================

JAX 0.11 deprecated the Pallas Triton backend ("will be removed in a future version"). This
project keeps it as ``"auto"``'s GPU backend while it imports, since it runs on every NVIDIA
generation and is what the GPU measurements so far are of; ``"auto"`` moves to Mosaic GPU on
Hopper only when Triton is gone or a measurement (``benchmarks/gpu_check.sh``) says so.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings

import jax

# The first jax whose Pallas says the Triton backend is deprecated.
TRITON_DEPRECATED_SINCE = (0, 11)
# The Mosaic GPU kernels' wgmma is sm_90a's alone (Blackwell's MMA is tcgen05): Hopper only.
MOSAIC_COMPUTE_CAPABILITY_MAJOR = 9


class BackendUnavailable(NotImplementedError):
  """A GPU backend this jax (or this GPU) cannot run; the message says why and what to use."""


@dataclasses.dataclass(frozen=True)
class GpuBackendSupport:
  """``reason`` is ``None`` when this jax runs the backend; ``note`` says what to know."""

  name: str
  reason: str | None
  note: str = ""

  @property
  def available(self) -> bool:
    return self.reason is None


def jax_version() -> tuple[int, ...]:
  return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


@functools.cache
def pallas_triton() -> GpuBackendSupport:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # stated below, once, not per import
    try:
      importlib.import_module("jax.experimental.pallas.triton")
    except ImportError as e:
      return GpuBackendSupport("pallas", f"jax {jax.__version__} has no Pallas Triton backend "
                               f"({e}); use backend='mosaic-gpu' on Hopper or 'xla'")
  note = ""
  if jax_version()[:2] >= TRITON_DEPRECATED_SINCE:
    note = (f"deprecated by JAX since {'.'.join(map(str, TRITON_DEPRECATED_SINCE))}; "
            "mla_jax keeps it until JAX removes it, then 'auto' uses 'mosaic-gpu' on Hopper")
  return GpuBackendSupport("pallas", None, note)


@functools.cache
def mosaic_gpu() -> GpuBackendSupport:
  from pallas_kernels.mosaic_gpu._compat import unsupported_reason

  reason = unsupported_reason()
  return GpuBackendSupport("mosaic-gpu", reason and f"{reason}; needs jax 0.11 or newer",
                           "Hopper (sm_90a) only; dense MHA and backward passes run on "
                           "Pallas-Triton")


def gpu_backends() -> tuple[GpuBackendSupport, ...]:
  """Each Pallas GPU backend and whether this jax runs it."""
  return pallas_triton(), mosaic_gpu()


def mosaic_refuses(device) -> str | None:
  """Why the Mosaic GPU kernels cannot run on this CUDA device, or ``None`` when they can
  (or when the device does not say its compute capability)."""
  capability = compute_capability(device)
  if capability is None or capability[0] == MOSAIC_COMPUTE_CAPABILITY_MAJOR:
    return None
  return (f"the Mosaic GPU kernels need Hopper (sm_90a: wgmma); {device.device_kind} is "
          f"sm_{capability[0]}{capability[1]}: use 'pallas'")


def compute_capability(device) -> tuple[int, int] | None:
  """``(major, minor)`` of a CUDA device, ``None`` when it does not say."""
  value = getattr(device, "compute_capability", None)
  try:
    major, minor = str(value).split(".")[:2]
    return int(major), int(minor)
  except ValueError:
    return None
