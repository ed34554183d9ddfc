"""Trained weights shipped with the package (HF format, loaded with ``load_pretrained``).

``recall``: a 2-layer DSA model (top-k 16) trained on key-value lookups by the ``recall``
recipe (``benchmarks/train_recipe.py --recipe recall`` reproduces it from its seed); its
model card is ``recall/MODEL_CARD.md``. It ships one MTP layer (``model.layers.2``, for
speculative decoding) trained with the main model frozen by ``benchmarks/train_mtp.py``;
``load_pretrained(RECALL_CHECKPOINT, mtp=False)`` loads the main model alone.
"""

from pathlib import Path

RECALL_CHECKPOINT = Path(__file__).parent / "recall"
