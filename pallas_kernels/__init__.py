"""Pallas kernels (Triton backend) for sparse MLA, each beside its plain-jnp reference.

Every kernel module exposes ``<name>`` (the Pallas kernel, ``interpret=`` selectable) and
``<name>_reference`` with the same signature. The reference is the specification: the XLA
backend of :mod:`mla_jax` runs it, and the kernel tests compare against it. Both call the
module's one ``validate_<name>`` first, so they refuse the same inputs with the same errors.

Tensor names use the axis letters of ``mla_jax`` (the legend in ``mla_jax/__init__.py``); the
kernels use T query tokens, S key tokens, H heads, L latent row (the absorbed MQA q/kv width),
Q qk head width of the MHA form, V value width, G indexer heads, I indexer head dim, K top-k.
"""

from pallas_kernels.dense_mha import dense_mha_reference
from pallas_kernels.indexer_logits import indexer_logits_reference
from pallas_kernels.sparse_mqa import sparse_mqa_reference

__all__ = ["dense_mha_reference", "indexer_logits_reference", "sparse_mqa_reference"]
