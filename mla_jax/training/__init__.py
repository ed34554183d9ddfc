"""Training for mla_jax models: the DeepSeek-V3.2 sparse-attention (DSA) recipe with optax.

Modules (imported on their own, so that ``mla_jax.attention`` can use the loss math without
pulling in optax):

* ``losses``  - next-token loss and the indexer's dense and sparse KL losses (pure jnp)
* ``data``    - a seeded key-value lookup task over the byte vocabulary, and its evaluators
* ``train``   - stages, the jit-compiled train step, the loop with evaluation and checkpoints
* ``recipes`` - named recipes (``smoke``, ``recall``) and ``run_recipe``
"""
