"""Mosaic GPU (Hopper, sm_90a) kernels: ``jax.experimental.pallas.mosaic_gpu`` (issue 36)."""
