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

import logging

import pytest

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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  """Keeps ``--dist loadgroup`` grouping on pytest 9.2: xdist 3.8 groups by an ``@group``
  suffix it writes to ``item._nodeid``, which pytest 9.2 no longer reads (the id lives in
  ``item._id``), so every xdist_group was spread over the workers and its module fixtures
  (servers, compiled engines, the recall probe) were built once per worker."""
  if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
    return
  for item in items:
    names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
             for mark in item.iter_markers("xdist_group")}
    suffix = "@" + "_".join(sorted(names))
    if names and hasattr(item, "_id") and not item.nodeid.endswith(suffix):
      item._id = type(item._id).parse(item.nodeid + suffix)
