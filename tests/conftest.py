"""Shared fixtures: CPU only, float32 defaults, and the backends every module test runs on."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
