"""Pallas kernels (Triton backend) for sparse MLA, each beside its plain-jnp reference.

Every kernel module exposes ``<name>`` (the Pallas kernel, ``interpret=`` selectable) and
``<name>_reference`` with the same signature. The reference is the specification: the XLA
backend of :mod:`mla_jax` runs it, and the kernel tests compare against it.

Axis letters (SPEC.md section 0): T query tokens, S key tokens, H heads, D qk width,
V value width, G indexer heads, I indexer dim, K top-k.
"""

from pallas_kernels.dense_mha import dense_mha_reference
from pallas_kernels.indexer_logits import indexer_logits_reference
from pallas_kernels.sparse_mqa import sparse_mqa_reference

__all__ = ["dense_mha_reference", "indexer_logits_reference", "sparse_mqa_reference"]
