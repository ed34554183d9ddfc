"""One Hugging Face RoPE parameter dict -> ``RopeConfig``, for every model family.

The rules are those of transformers' ``_compute_yarn_parameters``: ``rope_type`` (or the
legacy ``type``) is ``default`` or ``yarn``; a null ``factor`` is the implicit
``max_position_embeddings / original_max_position_embeddings``; a null or 0 ``beta_fast`` /
``beta_slow`` takes the default (32 / 1); the cos/sin magnitude is ``attention_factor`` when
given, else ``get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)`` when both are set, else
``get_mscale(f)``. ``RopeConfig`` holds the magnitude as that (mscale, mscale_all_dim) pair.

The families differ in one rule, ``mscale_all_dim_scales_softmax``: DeepSeek-V3 / V3.2 / GLM
also scale the softmax by ``mscale_all_dim``, so the pair is fixed by the config and an
``attention_factor`` must agree with it; V4 reads only the magnitude, so an ``attention_factor``
of 1 (what HF forces for V4's compressed RoPE) is the pair (1, 1). Which dict is the model's
(``rope_scaling`` over ``rope_parameters``, V4's ``main`` / ``compress``) is the caller's rule.
"""

from __future__ import annotations

import math

from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.config import RopeConfig, YarnConfig
from mla_jax.rope import rope_attention_factor

_BETA_DEFAULTS = (("beta_fast", 32.0), ("beta_slow", 1.0))


def finite_number(where: str, value, *, low: float | None = None,
                  positive: bool = False) -> float:
  """``value`` as a float, or a ``CheckpointError`` naming ``where``."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise CheckpointError(f"config field {where} must be a finite number, got {value!r}")
  if (positive and value <= 0) or (low is not None and value < low):
    raise CheckpointError(f"config field {where} must be "
                          f"{'> 0' if positive else f'>= {low:g}'}, got {value!r}")
  return float(value)


def rope_from_hf(params: dict, theta: float, *, where: str, max_positions: int,
                 mscale_all_dim_scales_softmax: bool) -> RopeConfig:
  """The ``RopeConfig`` of one HF RoPE dict over base ``theta`` (its ``rope_theta`` is the
  caller's to resolve); ``where`` names the dict in errors."""
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return RopeConfig(theta=theta)
  if rope_type != "yarn":
    raise CheckpointError(f"{where}.rope_type={rope_type!r} is not supported (only 'default' "
                          "and 'yarn')")
  if "factor" not in params:
    raise CheckpointError(f"{where}.factor is missing (HF requires it for YaRN)")
  original = params.get("original_max_position_embeddings", max_positions)
  if type(original) is not int or original <= 0:
    raise CheckpointError(f"config field original_max_position_embeddings must be a positive "
                          f"int, got {original!r}")
  mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
  if params["factor"] is None:
    if mscale_all_dim and mscale_all_dim_scales_softmax:
      raise CheckpointError(f"{where}.factor is null while mscale_all_dim is set; HF's "
                            "softmax scale needs the factor")
    factor = max_positions / original  # HF's implicit factor
  else:
    factor = finite_number(f"{where}.factor", params["factor"])
  if factor < 1:
    raise CheckpointError(f"{where}.factor={factor!r} < 1 (YaRN shrinking the context) is "
                          "not supported")
  for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
    if value is not None:
      finite_number(f"{where}.{key}", value, low=0)
  if mscale and mscale_all_dim:
    pair = (float(mscale), float(mscale_all_dim))
  elif not mscale_all_dim or not mscale_all_dim_scales_softmax:
    pair = (1.0, 0.0)  # HF's get_mscale(f)
  else:
    raise CheckpointError(f"{where}: YaRN with mscale_all_dim but without mscale is not "
                          "supported")
  if not params.get("truncate", True):
    raise CheckpointError(f"{where}: YaRN with truncate=false is not supported")
  betas = {key: finite_number(f"{where}.{key}", params.get(key) or default, positive=True)
           for key, default in _BETA_DEFAULTS}  # HF: `or`, so null and 0 take the default too
  if betas["beta_fast"] <= betas["beta_slow"]:
    raise CheckpointError(f"{where}.beta_fast ({betas['beta_fast']}) must exceed beta_slow "
                          f"({betas['beta_slow']})")

  def rope(pair):
    return RopeConfig(theta=theta, yarn=YarnConfig(
        factor=factor, original_max_position_embeddings=original, mscale=pair[0],
        mscale_all_dim=pair[1], **betas))

  if params.get("attention_factor") is None:
    return rope(pair)
  given = finite_number(f"{where}.attention_factor", params["attention_factor"])
  if math.isclose(given, rope_attention_factor(rope(pair)), rel_tol=1e-9):
    return rope(pair)
  if given == 1.0 and not mscale_all_dim_scales_softmax:
    return rope((1.0, 1.0))
  raise CheckpointError(f"{where}: attention_factor {given!r} differs from the magnitude "
                        "mscale / mscale_all_dim imply; not supported")
