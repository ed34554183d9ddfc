"""Shared fixtures: CPU only, 8 host devices, and the backends every module test runs on."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Sharding tests need several devices; the flag must be set before jax creates its backend.
# Everything else runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
# Tests compile far more than they run: with LLVM's optimisation passes off, test_decode.py and
# test_masked_mha.py took 201 s instead of 244 s in one process on 2 cores; XLA's own passes
# (fusion, layout) still run as in production.
# Benchmarks and the main job keep the default; set the flag in XLA_FLAGS to override.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU gives its thread pool max(NPROC, device count) threads, and a device that runs
# several collectives of one program at once holds a thread in each rendezvous: with 8 devices
# on a 2-core machine the pool ran dry while devices waited for each other (the speculative
# engine on a data x tensor x expert mesh deadlocked 4 runs in 5, then aborted). Blocked
# threads only sleep, so a larger pool costs nothing.
os.environ.setdefault("PJRT_NPROC", "32")
# No persistent compilation cache by default: XLA:CPU segfaults now and then while it serializes
# or loads an executable (5 times in one run of the suite over a warm cache, in
# ``put_executable_and_time`` / ``get_executable_and_time``), and a crash near the end of a run
# cannot be rerun. From a cold cache, as CI starts, it saved about 5% (415 s against 438 s for
# the engine, server, generation and CLI tests). Set JAX_COMPILATION_CACHE_DIR to share one
# between runs anyway: every process the tests start then writes its entries atomically.
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import importlib.util
import logging

import pytest


def _share_the_cache_safely_with_child_processes() -> None:
  """Atomic cache writes here and in every Python process the tests start (servers,
  multi-process workers): ``child_site/sitecustomize.py`` on their ``PYTHONPATH``."""
  site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_site")
  paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
  if site not in paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([site, *filter(None, paths)])
  spec = importlib.util.spec_from_file_location("_tests_child_site",
                                                os.path.join(site, "sitecustomize.py"))
  spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  _share_the_cache_safely_with_child_processes()

logging.getLogger("mla_jax").setLevel(logging.ERROR)  # the MQA-only notice is tested directly


def module_backends():
  """XLA always; Pallas-Triton in interpret mode once the kernels package provides it."""
  from mla_jax.backends import XlaBackend

  backends = [pytest.param(XlaBackend(), id="xla")]
  try:
    from mla_jax.backends.pallas import PallasTritonBackend
  except ImportError:
    return backends
  backends.append(pytest.param(PallasTritonBackend(interpret=True), id="pallas_interpret"))
  return backends
