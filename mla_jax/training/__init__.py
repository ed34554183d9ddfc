"""Training for mla_jax models: the DeepSeek-V3.2 sparse-attention (DSA) recipe with optax.

Modules (imported on their own; the loss math they train with is ``mla_jax.losses``, below
the models, so that no import runs from the attention layers back up to training):

* ``data``    - a seeded key-value lookup task over the byte vocabulary, a model's own greedy
  continuations (MTP training data), and their evaluators
* ``train``   - stages, the jit-compiled train step, the loop with evaluation and checkpoints
* ``recipes`` - named recipes (``smoke``, ``recall``) and ``run_recipe``; the MTP head's
  ``recall_mtp`` and ``run_mtp_recipe``
"""
