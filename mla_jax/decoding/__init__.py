"""The decode stack ``generate`` and the engine share: sampling, speculative drafting and
acceptance, the stop rule and incremental text, the device decode loop (``steps``) and the
host one (``driver``), the cache of compiled programs, and the prompt checks
(``prompt_checks``). ``mla_jax.generation`` and ``mla_jax.serving`` both build on it and
never on each other."""

# Decode steps one dispatch runs (generate's decode programs, the engine's decode-only
# dispatches): benchmarks/decode.py measured little per-token gain beyond about 8.
DECODE_STEPS_PER_DISPATCH = 8
