"""The inference engine: continuous batching over paged caches (docs/serving.md)."""

from mla_jax.serving.engine import Engine
from mla_jax.serving.sequence import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
