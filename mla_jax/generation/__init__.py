"""Jit-compiled generation: one prefill program and a decode program per cache bucket.

A decode program runs several steps per dispatch (a ``lax.scan``) and reads only the cache
rows the live context can reach, rounded up to a power-of-two bucket; it is compiled once per
(model structure, batch, capacity, sampling settings, bucket) and reused, so a generation
never retraces per token. The caches are donated to every program and updated in place.
Prefill takes the route its layers resolve for a fresh cache (dense MHA only where both the
layer class and the backend allow it); every decode step is MQA, because the cached length
is traced.

With ``speculative_tokens=k`` the prefill also runs the first MTP layer, and each decode
dispatch runs several speculative iterations (draft k tokens with the MTP layers, verify them
in one forward of k + 1, accept, roll back) as one program per bucket, all on the MQA route.

The parts: ``arguments`` checks a call's arguments before anything is built, ``programs``
holds the compiled programs (a bounded cache) and their public tracing entry point,
``speculative`` the math of a speculative iteration, and ``loop`` runs ``generate``: prefill,
then the decode dispatches.
"""

from mla_jax.decoding.sampling import SamplingConfig, sample
from mla_jax.decoding.speculative import MAX_SPECULATIVE_TOKENS
from mla_jax.generation.loop import DEFAULT_STEPS_PER_DISPATCH, GenerationResult, generate
from mla_jax.generation.programs import (DecodeSettings, PrefillSettings,
                                         SpeculativePrefillSettings, SpeculativeSettings,
                                         trace_counts)

__all__ = ["DEFAULT_STEPS_PER_DISPATCH", "DecodeSettings", "GenerationResult",
           "MAX_SPECULATIVE_TOKENS", "PrefillSettings", "SamplingConfig",
           "SpeculativePrefillSettings", "SpeculativeSettings", "generate", "sample",
           "trace_counts"]
