"""The decode stack ``generate`` and the engine share: sampling, speculative drafting and
acceptance, the stop rule and incremental text, the cache of compiled programs, and request
settings checks. ``mla_jax.generation`` and ``mla_jax.serving`` both build on it and never on
each other."""
