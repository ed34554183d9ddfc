"""Compile Mosaic GPU kernels for an H200 (sm_90a) on a host without a GPU, and read ptxas's
registers, spills and shared memory (docs/kernels.md, "Mosaic GPU kernels").

How: XLA compiles ahead of time for a GPU *topology* instead of a device (the CUDA PJRT
plugin's ``target_config``: the H200's facts below), and Mosaic GPU's compiler, which runs
inside that compile, dumps ptxas's report where ``MOSAIC_GPU_DUMP_TO`` points. No CUDA driver
is touched. Needs the CUDA PJRT plugin of exactly the installed jaxlib (the topology options
are private to it; ``PINNED_JAXLIB``) and a ptxas: jax's pip CUDA, else /usr/local/cuda.

    python -m tests.kernels.test_mosaic_compile      # the table of docs/kernels.md
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile

import jax

# The jaxlib whose CUDA plugin this was written against (jax-cuda13-pjrt / -plugin 0.12.0.1).
PINNED_JAXLIB = "0.12.0.1"

# stream_executor.GpuTargetConfigProto of an H200 SXM: what the compile reads of the device.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""


@dataclasses.dataclass(frozen=True)
class PtxasReport:
  registers: int
  spill_store_bytes: int
  spill_load_bytes: int
  smem_bytes: int  # the kernel's SMEM scratch as Mosaic GPU allocates it
  arch: str


def unavailable_reason() -> str | None:
  """Why the compile check cannot run here, or ``None``."""
  import jaxlib

  if jaxlib.__version__ != PINNED_JAXLIB:
    return f"the compile check is pinned to jaxlib {PINNED_JAXLIB}, found {jaxlib.__version__}"
  try:
    _sm90_device()
  except Exception as e:  # noqa: BLE001 -- any failure here means: no CUDA plugin to compile
    return (f"no CUDA PJRT plugin to compile with ({type(e).__name__}: {str(e)[:160]}); "
            f"pip install jax-cuda13-pjrt=={PINNED_JAXLIB} jax-cuda13-plugin=={PINNED_JAXLIB}")
  if ptxas_path() is None:
    return "no ptxas (neither jax's pip CUDA nor /usr/local/cuda/bin/ptxas)"
  return None


def ptxas_path() -> str | None:
  from jax._src import lib

  root = lib.cuda_path or os.environ.get("MOSAIC_GPU_CUDA_ROOT") or "/usr/local/cuda"
  path = os.path.join(root, "bin", "ptxas")
  return path if os.path.exists(path) else shutil.which("ptxas")


def ptxas_version() -> str:
  out = subprocess.run([ptxas_path(), "--version"], capture_output=True, text=True).stdout
  found = re.search(r"release ([\d.]+)", out)
  return found.group(1) if found else "?"


@functools.cache
def _sm90_device():
  # The plugin checks the pip CUDA libraries' versions when it loads; a compile-only use
  # needs none of them.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  from jax.experimental import topologies

  topology = topologies.get_topology_desc("", platform="cuda", topology="1x1x1",
                                          target_config=H200_TARGET_CONFIG)
  return topology.devices[0]


def compile_kernels(fn, *shapes) -> dict[str, PtxasReport]:
  """Compiles ``jax.jit(fn)`` on ``jax.ShapeDtypeStruct`` arguments for the H200; returns
  ptxas's report per Mosaic GPU kernel in it (by kernel name)."""
  sharding = jax.sharding.SingleDeviceSharding(_sm90_device())
  args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) if s is not None else None
          for s in shapes]
  saved = {k: os.environ.get(k) for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS")}
  with tempfile.TemporaryDirectory() as dump:
    os.environ.update(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1")
    try:
      jax.jit(fn).trace(*args).lower().compile()
    finally:
      for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return {name[:-len(".ptxas")]: _parse(dump, name) for name in sorted(os.listdir(dump))
            if name.endswith(".ptxas")}


def _parse(dump: str, name: str) -> PtxasReport:
  text = open(os.path.join(dump, name)).read()
  stem = name[:-len(".ptxas")]
  resources = open(os.path.join(dump, stem + ".resources.txt")).read()
  number = lambda pattern, source=text: int(re.search(pattern, source).group(1))
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
  return PtxasReport(
      registers=number(r"Used (\d+) registers"),
      spill_store_bytes=int(spills.group(1)) if spills else 0,
      spill_load_bytes=int(spills.group(2)) if spills else 0,
      smem_bytes=number(r"smem_scratch_bytes=(\d+)", resources),
      arch=re.search(r"for '(sm_\w+)'", text).group(1))
