"""Jit-compiled generation: one prefill program and a decode program per cache bucket.

A decode program runs several steps per dispatch (a ``lax.scan``) and reads only the cache
rows the live context can reach, rounded up to a power-of-two bucket; it is compiled once per
(model structure, batch, capacity, sampling settings, bucket) and reused, so a generation
never retraces per token. The caches are donated to every program and updated in place.
Prefill takes the route its layers resolve for a fresh cache (dense MHA only where both the
layer class and the backend allow it); every decode step is MQA, because the cached length
is traced.

The parts: ``requests`` checks a call's arguments before anything is built, ``programs``
holds the compiled programs (a bounded cache) and their public tracing entry point, and
``loop`` runs ``generate``: prefill, then the decode dispatches.
"""

from mla_jax.generation.loop import DEFAULT_STEPS_PER_DISPATCH, GenerationResult, generate
from mla_jax.generation.programs import DecodeSettings, PrefillSettings, trace_counts
from mla_jax.generation.sampling import SamplingConfig, sample

__all__ = ["DEFAULT_STEPS_PER_DISPATCH", "DecodeSettings", "GenerationResult",
           "PrefillSettings", "SamplingConfig", "generate", "sample", "trace_counts"]
