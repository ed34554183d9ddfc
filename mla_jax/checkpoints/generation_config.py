"""``generation_config.json`` of a checkpoint: sampling defaults and special token ids.

HF's ``GenerationConfig`` rules: sampling happens only with ``do_sample: true`` (its default
is false, and then ``temperature`` / ``top_p`` are ignored: greedy); ``temperature`` and
``top_p`` default to 1.0; ``eos_token_id`` may be one id or a list of them.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.reading import read_json_object

GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
  temperature: float = 0.0  # greedy
  top_p: float = 1.0
  bos_id: int | None = None
  eos_ids: tuple[int, ...] | None = None


def token_ids(file: Path, key: str, value) -> tuple[int, ...] | None:
  """One id or a list of ids (null: none)."""
  if value is None:
    return None
  ids = value if isinstance(value, list) else [value]
  if not ids or not all(type(i) is int and i >= 0 for i in ids):
    raise CheckpointError(f"{file}: {key} must be an id >= 0 or a non-empty list of them, "
                          f"got {value!r}")
  return tuple(ids)


def _number(file: Path, gc: dict, key: str, low: float, high: float) -> float:
  value = gc.get(key, 1.0)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
      or not low <= value <= high or (key == "top_p" and value == 0):
    raise CheckpointError(f"{file}: {key} must be a number in "
                          f"{'(0, 1]' if key == 'top_p' else f'[{low:g}, {high:g}]'}, got "
                          f"{value!r}")
  return float(value)


def read_generation_config(directory: str | Path) -> GenerationDefaults:
  """What a checkpoint's ``generation_config.json`` says (the defaults without one)."""
  file = Path(directory) / GENERATION_CONFIG
  gc = read_json_object(file)
  if gc is None:
    return GenerationDefaults()
  do_sample = gc.get("do_sample", False)
  if not isinstance(do_sample, bool):
    raise CheckpointError(f"{file}: do_sample must be true or false, got {do_sample!r}")
  temperature = _number(file, gc, "temperature", 0.0, math.inf)
  top_p = _number(file, gc, "top_p", 0.0, 1.0)
  bos = token_ids(file, "bos_token_id", gc.get("bos_token_id"))
  if bos is not None and len(bos) != 1:
    raise CheckpointError(f"{file}: bos_token_id must be one id, got {gc['bos_token_id']!r}")
  return GenerationDefaults(temperature=temperature if do_sample else 0.0,
                            top_p=top_p if do_sample else 1.0,
                            bos_id=None if bos is None else bos[0],
                            eos_ids=token_ids(file, "eos_token_id", gc.get("eos_token_id")))
