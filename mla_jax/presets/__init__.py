"""Trained weights shipped with the package (HF format, loaded with ``load_pretrained``).

``recall``: a 2-layer DSA model (top-k 16) trained on key-value lookups by the ``recall``
recipe (``benchmarks/train_recipe.py --recipe recall`` reproduces it from its seed); its
model card is ``recall/MODEL_CARD.md``.
"""

from pathlib import Path

RECALL_CHECKPOINT = Path(__file__).parent / "recall"
