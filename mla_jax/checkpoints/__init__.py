"""Hugging Face checkpoints: ``config.json`` plus safetensors <-> ``CausalLM``.

- ``hf_config``: HF's config rules (``config_from_hf``); ``hf_export``: ``config_to_hf``.
- ``hf_rope``: one HF RoPE dict -> ``RopeConfig`` (this family's configs and V4's).
- ``reading``: lazy, memory-mapped tensor handles over single or sharded safetensors.
- ``loading``: ``load_pretrained`` (all mismatches reported before anything is read; each
  device's piece of each parameter is then read on its own, fp8 weights kept or dequantized).
- ``writing``: ``save_pretrained`` (validated first, staged, then moved into place).
- ``mapping``: tensor names <-> model parameters, the only layout-specific part.
- ``generation_config``: a checkpoint's sampling defaults and special token ids.

Only safetensors are read: pickle-based ``*.bin`` / ``*.pt`` files can run code on load and
are refused.
"""

from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.hf_config import SUPPORTED_MODEL_TYPES, config_from_hf
from mla_jax.checkpoints.hf_export import config_to_hf
from mla_jax.checkpoints.loading import dequantize_fp8_blocks, load_pretrained
from mla_jax.checkpoints.reading import (CheckpointTensors, TensorHandle, open_checkpoint,
                                         open_safetensors)
from mla_jax.checkpoints.writing import save_pretrained, write_safetensors

__all__ = ["CheckpointError", "CheckpointTensors", "SUPPORTED_MODEL_TYPES", "TensorHandle",
           "config_from_hf", "config_to_hf", "dequantize_fp8_blocks", "load_pretrained",
           "open_checkpoint", "open_safetensors", "save_pretrained", "write_safetensors"]
