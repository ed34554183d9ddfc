"""Compile GPU kernels for an H200 (sm_90a) on a host without a GPU, and read what ptxas makes
of each one: registers, spills, shared memory, the grid, wgmma and setmaxnreg
(docs/kernels.md, "Mosaic GPU kernels"). Used by ``tests/kernels/test_mosaic_compile.py`` and
``benchmarks/compile_report.py``.

How: XLA compiles ahead of time for a GPU *topology* instead of a device (the CUDA PJRT
plugin's ``target_config``: the H200's facts below); no CUDA driver is touched.
- Mosaic GPU's compiler runs inside that compile and dumps each kernel's PTX and resources
  where ``MOSAIC_GPU_DUMP_TO`` points.
- XLA compiles the Pallas-Triton kernels with its own Triton fork and runs ptxas as a program.
  :func:`capture_triton_ptx` points XLA at a wrapper that keeps a copy of each PTX. XLA reads
  its flags once per process, so that must happen before jax compiles anything.
Then a chosen ptxas (``ptxas -arch=sm_90a -v``) reports on each PTX, so one compile serves any
number of ptxas versions. Needs the CUDA PJRT plugin of exactly the installed jaxlib (the
topology options are private to it; ``PINNED_JAXLIB``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import math
import os
import re
import shutil
import subprocess
import tempfile

import jax
from jax._src import config

# The jaxlib whose CUDA plugin this was written against (jax-cuda13-pjrt / -plugin 0.12.0.1).
PINNED_JAXLIB = "0.12.0.1"
SMEM_LIMIT = 232448  # bytes a block may opt into on sm_90

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
class Kernel:
  """One GPU kernel of a compiled program."""
  name: str                 # its PTX entry function
  backend: str              # "mosaic" or "triton"
  ptx: str
  shared_bytes: int         # Mosaic's SMEM scratch, Triton's dynamic shared memory
  grid: tuple[int, ...]
  threads: int              # per CTA

  @property
  def ctas(self) -> int:
    return math.prod(self.grid)

  @property
  def wgmma(self) -> int:
    """``wgmma.mma_async`` instructions in the PTX (0 when the dots are ``mma.sync``)."""
    return self.ptx.count("wgmma.mma_async")

  @property
  def mma_sync(self) -> int:
    return len(re.findall(r"\bmma\.sync", self.ptx))

  @property
  def setmaxnreg(self) -> tuple[str, ...]:
    """Each ``setmaxnreg`` in the PTX, e.g. ``("inc 240", "dec 24")``."""
    return tuple(f"{op} {n}" for op, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+)",
                                                      self.ptx))


@dataclasses.dataclass(frozen=True)
class PtxasReport:
  ptxas: str                # its release, e.g. "13.0"
  registers: int
  spill_store_bytes: int
  spill_load_bytes: int
  arch: str

  @property
  def spill_bytes(self) -> int:
    return self.spill_store_bytes + self.spill_load_bytes


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
  if default_ptxas() is None:
    return "no ptxas (neither jax's pip CUDA nor /usr/local/cuda/bin/ptxas)"
  return None


def default_ptxas() -> str | None:
  """jax's pip CUDA's ptxas, else /usr/local/cuda's, else one on PATH."""
  from jax._src import lib

  root = lib.cuda_path or os.environ.get("MOSAIC_GPU_CUDA_ROOT") or "/usr/local/cuda"
  path = os.path.join(root, "bin", "ptxas")
  return path if os.path.exists(path) else shutil.which("ptxas")


@functools.cache
def ptxas_version(ptxas: str) -> str:
  out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
  found = re.search(r"release ([\d.]+)", out)
  return found.group(1) if found else "?"


def capture_triton_ptx(ptxas: str) -> str:
  """Points XLA's ptxas at a wrapper of ``ptxas`` that keeps each PTX it compiles, and dumps
  XLA's thunks (the Triton kernels' shared memory); returns the directory of both. Must run
  before jax compiles anything in this process (XLA reads ``XLA_FLAGS`` once)."""
  root = tempfile.mkdtemp(prefix="sm90_compile_")
  os.makedirs(os.path.join(root, "bin"))
  os.makedirs(os.path.join(root, "ptx"))
  wrapper = os.path.join(root, "bin", "ptxas")
  with open(wrapper, "w") as f:
    f.write(f'#!/bin/sh\n[ -f "$1" ] && cp "$1" "{root}/ptx/$$.ptx"\nexec "{ptxas}" "$@"\n')
  os.chmod(wrapper, 0o755)
  os.environ["XLA_FLAGS"] = " ".join([
      os.environ.get("XLA_FLAGS", ""), "--xla_gpu_enable_libnvptxcompiler=false",
      f"--xla_gpu_cuda_data_dir={root}", f"--xla_dump_to={root}/xla"]).strip()
  global _triton_capture
  _triton_capture = root
  return root


_triton_capture: str | None = None


@functools.cache
def _sm90_device():
  # The plugin checks the pip CUDA libraries' versions when it loads; a compile-only use
  # needs none of them.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  from jax.experimental import topologies

  topology = topologies.get_topology_desc("", platform="cuda", topology="1x1x1",
                                          target_config=H200_TARGET_CONFIG)
  return topology.devices[0]


def compile_kernels(fn, *shapes) -> list[Kernel]:
  """Compiles ``jax.jit(fn)`` on ``jax.ShapeDtypeStruct`` arguments (``None`` passes through)
  for the H200; returns its GPU kernels: every Mosaic GPU one, and the Triton ones when
  :func:`capture_triton_ptx` ran first."""
  device = _sm90_device()
  sharding = jax.sharding.SingleDeviceSharding(device)
  args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
  grids = _grids(fn, shapes)
  saved = os.environ.get("MOSAIC_GPU_DUMP_TO")
  seen = set(glob.glob(f"{_triton_capture}/ptx/*.ptx")) if _triton_capture else set()
  with tempfile.TemporaryDirectory() as dump, _mosaic_smem() as smem:
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump
    try:
      # The Triton lowering reads the device's kind. A cached lowering or executable would
      # skip the steps whose dumps are read here.
      jax.clear_caches()
      with jax.default_device(device), config.enable_compilation_cache(False):
        jax.jit(fn).trace(*args).lower().compile()
    finally:
      os.environ.pop("MOSAIC_GPU_DUMP_TO") if saved is None else os.environ.update(
          MOSAIC_GPU_DUMP_TO=saved)
    # The dumps' stems are the kernel names and a counter in lowering order.
    stems = sorted((name[:-len(".ptx")] for name in os.listdir(dump) if name.endswith(".ptx")),
                   key=lambda stem: int(stem.rsplit("_", 1)[1]))
    if len(stems) != len(smem):
      raise RuntimeError(f"{len(stems)} Mosaic GPU kernels compiled, {len(smem)} lowered: "
                         "compiled before in this process (Mosaic then reuses its kernel)?")
    kernels = [_mosaic_kernel(dump, stem, grids, bytes_) for stem, bytes_ in zip(stems, smem)]
  if _triton_capture:
    for path in sorted(set(glob.glob(f"{_triton_capture}/ptx/*.ptx")) - seen):
      kernels += _triton_kernels(open(path).read(), grids)
  return kernels


def _grids(fn, shapes) -> dict[str, tuple[tuple[int, ...], int]]:
  """Kernel name -> (grid, threads a CTA), read from the jaxpr."""
  found = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "mpmd_map":  # plgpu.kernel
        mesh, = eqn.params["meshes"]
        found[eqn.params["name"]] = (tuple(mesh.grid), 128 * (mesh.num_threads or 1))
      elif eqn.primitive.name == "pallas_call":
        params = eqn.params["compiler_params"]
        warps = getattr(params, "num_warps", None) or 4
        found[eqn.params["name"]] = (tuple(eqn.params["grid_mapping"].grid), 32 * warps)
      for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
          inner = getattr(v, "jaxpr", v)
          if hasattr(inner, "eqns"):
            walk(inner)
  walk(jax.make_jaxpr(fn)(*shapes).jaxpr)
  return found


@contextlib.contextmanager
def _mosaic_smem():
  """Collects each Mosaic GPU kernel's SMEM scratch bytes as it is lowered, in order: what
  Mosaic's resources dump says, which is written once per process only (its dump options are
  read once). Private API (jaxlib 0.12.0.1, ``PINNED_JAXLIB``)."""
  from jax._src.pallas.mosaic_gpu import lowering

  original, found = lowering.lower_jaxpr_to_module, []

  def lower(jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes, jaxpr, params,
            *args, **kwargs):
    context = lowering.ResourceEstimatorContext(
        reduction_scratch_bytes=params.reduction_scratch_bytes, axis_names=axis_names,
        lowering_semantics=params.lowering_semantics)
    found.append(lowering._estimate_resources(context, jaxpr).smem_scratch_bytes)
    return original(jax_mesh, axis_names, grid, block, cluster, in_shapes, out_shapes, jaxpr,
                    params, *args, **kwargs)

  lowering.lower_jaxpr_to_module = lower
  try:
    yield found
  finally:
    lowering.lower_jaxpr_to_module = original


def _mosaic_kernel(dump: str, stem: str, grids, smem_bytes: int) -> Kernel:
  ptx = open(os.path.join(dump, stem + ".ptx")).read()
  grid, threads = grids[stem.rsplit("_", 1)[0]]
  return Kernel(_entries(ptx)[0], "mosaic", ptx, smem_bytes, grid, threads)


def _triton_kernels(ptx: str, grids) -> list[Kernel]:
  kernels = []
  for entry in _entries(ptx):
    if entry not in grids:
      continue  # one of XLA's own fusions
    grid, threads = grids[entry]
    kernels.append(Kernel(entry, "triton", ptx, _triton_shared_bytes(entry), grid, threads))
  return kernels


def _triton_shared_bytes(entry: str) -> int:
  """The dynamic shared memory XLA launches ``entry`` with (its thunk dump)."""
  pattern = re.compile(rf"kCustomKernel .*\b{re.escape(entry)}\b.*shared_memory: (\d+) bytes")
  for path in sorted(glob.glob(f"{_triton_capture}/xla/*thunk_sequence.txt"),
                     key=os.path.getmtime, reverse=True):
    if found := pattern.search(open(path).read()):
      return int(found.group(1))
  return -1


def _entries(ptx: str) -> list[str]:
  return re.findall(r"\.entry\s+(\w+)\s*\(", ptx)


def run_ptxas(ptxas: str, kernel: Kernel) -> PtxasReport:
  """``ptxas -arch=sm_90a -v`` on the kernel's PTX: its registers and spills."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ptx")
    with open(path, "w") as f:
      f.write(kernel.ptx)
    proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                          capture_output=True, text=True)
  log = proc.stdout + proc.stderr
  if proc.returncode:
    raise RuntimeError(f"{ptxas} failed on {kernel.name}: {log[-2000:]}")
  # ptxas reports every entry of the PTX in turn: keep this kernel's block.
  block = log.split(f"entry function '{kernel.name}'")[1].split("Compiling entry function")[0]
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
  return PtxasReport(
      ptxas=ptxas_version(ptxas),
      registers=int(re.search(r"Used (\d+) registers", block).group(1)),
      spill_store_bytes=int(spills.group(1)) if spills else 0,
      spill_load_bytes=int(spills.group(2)) if spills else 0,
      arch=re.search(r"for '(sm_\w+)'", log).group(1))
