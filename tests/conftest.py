"""Shared fixtures: CPU only, 8 host devices, and the backends every module test runs on."""

import os
import tempfile

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
# One persistent compilation cache for the run's workers, the servers and processes they start,
# and later runs: every model build compiles dozens of small eager initializers, and the two
# workers (and the slow cases after them) compile many of the same programs. Entries are keyed
# by the program, the jax version and the flags, so a stale one is never read.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "mla_jax_tests_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import logging

import pytest


def _write_cache_entries_atomically() -> None:
  """JAX's file cache writes an entry in place (``Path.write_bytes``) unless its size cap is
  set, which turns on a lock that scans the whole directory at every write: a worker reading
  an entry another worker is writing loads half an executable and crashes in native code
  (segfaults in ``compilation_cache.get_executable_and_time``). Write each entry beside its
  place and rename it there: readers see it whole or not at all."""
  from jax._src import lru_cache

  def put(self, key: str, value: bytes) -> None:
    if self.eviction_enabled:
      return original(self, key, value)
    path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if path.exists():
      return None
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(value)
    os.replace(partial, path)
    return None

  original = lru_cache.LRUCache.put
  lru_cache.LRUCache.put = put


_write_cache_entries_atomically()

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
