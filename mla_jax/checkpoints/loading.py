"""Loading an HF checkpoint directory into a ``CausalLM``, streamed piece by piece.

Before anything is read the loader checks every tensor against the model and reports all
missing, unexpected and mis-shaped ones in one ``CheckpointError`` (the mesh and the splits
are checked before that, when the abstract model is built).

Multi-token-prediction layers (``model.layers.{L}.*`` with L >= num_hidden_layers: layer 61
of DeepSeek-V3.2, 78 of GLM-5; ``num_nextn_predict_layers`` of them) load into
``CausalLM.mtp`` like the main layers (fp8 weights included) when the checkpoint holds them
(``mtp=True`` requires them), unless ``mtp=False`` skips them as HF's model does. Their copies of the embedding and the LM head are checked to equal the
main tensors and not held again (``mla_jax.models.mtp``); saving writes them back.

Each parameter is then made with ``jax.make_array_from_callback``: every device's piece is
read from the memory-mapped files as a slice of the HF tensors it covers, so a process reads
only what its own devices hold, and a stacked parameter (scanned layers) is filled one layer
at a time into an array allocated on the devices (``mapping.fill_parameters``).

fp8 weights (``weight_scale_inv`` per 128 x 128 block unless the config says otherwise) are
either kept fp8 (``dtype="fp8"``: ``quant.BlockScaledWeight``, dequantized inside the
matmuls) or dequantized slice by slice while loading.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import quant, sharding
from mla_jax.backends import Backend, get_backend
from mla_jax.checkpoints.errors import CheckpointError
from mla_jax.checkpoints.hf_config import config_from_hf, fp8_block_size
from mla_jax.checkpoints.mapping import expected_tensors, fill_parameters
from mla_jax.checkpoints.reading import TensorHandle, open_checkpoint, read_json_object
from mla_jax.models.config import ATTENTION_KINDS
from mla_jax.models import hf_layout
from mla_jax.models.hf_layout import param_layouts
from mla_jax.models.lm import CausalLM, state_shardings
from mla_jax.models.moe import resolve_grouped_matmul

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_MAX_LISTED = 50  # per problem kind, to keep one error readable
_PARAM_DTYPES = ("bfloat16", "float16", "float32", "float64")
FP8 = "fp8"  # keep the checkpoint's float8 weights (everything else in the compute dtype)


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray,
                          block: tuple[int, int] = (128, 128),
                          offset: tuple[int, int] = (0, 0)) -> np.ndarray:
  """float32 ``weight * scale_inv`` per [block] tile; edge tiles may be ragged.

  ``offset`` is where ``weight[0, 0]`` sits inside the first block of ``scale_inv`` (for a
  slice of a larger weight).
  """
  rows, cols = weight.shape
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0),
                    block[1], axis=1)
  return weight.astype(np.float32) * scale[offset[0]:offset[0] + rows,
                                           offset[1]:offset[1] + cols]


def _dequantized_slice(weight: TensorHandle, scale_inv: TensorHandle, tail: tuple[slice, ...],
                       block: tuple[int, int]) -> np.ndarray:
  """``dequantize(weight)[tail]``, reading only the weight slice and the scales it needs."""
  (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(tail, weight.shape))
  first = (r0 // block[0], c0 // block[1])
  scales = scale_inv[first[0]:-(-r1 // block[0]), first[1]:-(-c1 // block[1])]
  return dequantize_fp8_blocks(weight[tail], scales, block,
                               (r0 - first[0] * block[0], c0 - first[1] * block[1]))


def _is_mtp(name: str, num_layers: int) -> bool:
  """A key of a multi-token-prediction layer (``model.layers.{L}``, L >= num_layers)."""
  m = _LAYER_KEY.match(name)
  return m is not None and int(m.group(1)) >= num_layers


_COMPARE_BYTES = 64 << 20  # per slice, to bound the host memory of the comparison


def _check_shared_copies(path: Path, available: dict[str, TensorHandle],
                         copies: dict[str, str]) -> None:
  """Each MTP layer's stored copy of the embedding or head equals the main tensor bitwise
  (compared slice by slice), since the model holds the main one only."""
  for copy, original in copies.items():
    a, b = available[copy], available[original]
    same = a.st_dtype == b.st_dtype and a.shape == b.shape and len(a.shape) == 2
    if same:
      rows = max(1, _COMPARE_BYTES * a.shape[0] // max(a.nbytes, 1))
      same = all(a[r:r + rows, :].tobytes() == b[r:r + rows, :].tobytes()
                 for r in range(0, a.shape[0], rows))
    if not same:
      raise CheckpointError(f"{path}: {copy} differs from {original}; mla_jax's MTP layers "
                            "share the main model's embedding and LM head (DeepSeek-V3 §2.2) "
                            "and cannot hold another; load with mtp=False to skip them")


def is_float8(handle: TensorHandle) -> bool:
  return handle.st_dtype.startswith("F8_")


def _keep_fp8(path: Path, model: CausalLM, available: dict[str, TensorHandle],
              block: tuple[int, int]) -> None:
  """Turns every weight that the checkpoint stores as float8 with a ``weight_scale_inv``
  into an abstract ``BlockScaledWeight`` (Linear weights and stacked expert matrices; an fp8
  embedding would be dequantized while loading). A stacked parameter takes its first HF
  tensor's dtype; ``_check_tensors`` checks the others against it."""
  params = nnx.state(model, nnx.Param)
  kept = 0
  for p, layout in param_layouts(params).items():
    name = layout.rule_name
    if (name in available and is_float8(available[name]) and name + "_scale_inv" in available
        and quant.is_block_scalable(model, p)):
      quant.block_scale_abstract(model, p, available[name].dtype, block,
                                 available[name + "_scale_inv"].dtype)
      kept += 1
  if not kept:
    raise CheckpointError(f"{path}: dtype='fp8' keeps a checkpoint's float8 weights, but no "
                          "weight is stored as float8 with a weight_scale_inv; load it with "
                          "dtype='bfloat16' or 'float32'")


def _check_tensors(path: Path, expected: dict, available: dict[str, TensorHandle],
                   block: tuple[int, int], missing_hint: str = "") -> dict[str, str]:
  """Each parameter stored as fp8 but held in a wider dtype -> its scale's name; raises
  listing every mismatch (and ``missing_hint`` when some tensor is missing)."""
  missing, wrong, scales = [], [], {}
  for name, target in sorted(expected.items()):
    if name not in available:
      missing.append(name)
      continue
    handle = available[name]
    keeps_fp8 = jnp.dtype(target.dtype).itemsize == 1  # a float8 parameter
    if handle.shape != tuple(target.shape):
      wrong.append(f"{name}: checkpoint shape {handle.shape} != model shape "
                   f"{tuple(target.shape)}")
    elif not handle.st_dtype.startswith(("F", "BF")) or handle.dtype is None:
      wrong.append(f"{name}: dtype {handle.st_dtype} cannot hold a parameter")
    elif keeps_fp8 and handle.dtype != target.dtype:
      wrong.append(f"{name}: dtype {handle.st_dtype}, but the model keeps this stacked "
                   f"parameter as {jnp.dtype(target.dtype).name} (its first layer's dtype)")
    if is_float8(handle) and not keeps_fp8:
      scale = name + "_scale_inv"
      want = tuple(-(-d // b) for d, b in zip(target.shape, block))
      if len(target.shape) != 2:
        wrong.append(f"{name}: fp8 ({handle.st_dtype}) is only supported for 2-D weights")
      elif scale not in available:
        missing.append(f"{scale} (the scale of fp8 weight {name})")
      elif available[scale].shape != want:
        wrong.append(f"{scale}: checkpoint shape {available[scale].shape} != expected {want} "
                     f"for {block} blocks of {tuple(target.shape)}")
      scales[name] = scale
  unexpected = sorted(set(available) - set(expected) - set(scales.values()))
  problems = [(f"missing ({len(missing)})", missing),
              (f"unexpected ({len(unexpected)})", unexpected),
              (f"wrong shape or dtype ({len(wrong)})", wrong)]
  lines = []
  for title, items in problems:
    if items:
      lines.append(f"  {title}:")
      lines += [f"    {item}" for item in items[:_MAX_LISTED]]
      if len(items) > _MAX_LISTED:
        lines.append(f"    ... and {len(items) - _MAX_LISTED} more")
  if missing and missing_hint:
    lines.append(f"  {missing_hint}")
  if lines:
    raise CheckpointError(f"{path}: checkpoint does not match the model:\n" + "\n".join(lines))
  return scales


def _float_dtype(value, name: str, none_means: str) -> jnp.dtype | None:
  """``value`` as one of ``_PARAM_DTYPES``; None stays None; anything else is refused by
  ``name``."""
  if value is None:
    return None
  try:
    resolved = None if isinstance(value, bool) else jnp.dtype(value)
  except TypeError:
    resolved = None
  if resolved is None or resolved.name not in _PARAM_DTYPES:
    extra = " or 'fp8'" if name == "dtype" else ""
    raise ValueError(f"{name} must be one of {', '.join(_PARAM_DTYPES)}{extra} (None: "
                     f"{none_means}), got {value!r}")
  return resolved


def resolve_dtypes(dtype, compute_dtype=None) -> tuple[jnp.dtype, bool]:
  """(dtype of the parameters that are not fp8, whether fp8 weights stay fp8).

  The model computes in the dtype of its parameters (activations follow the embedding), so
  with ``dtype="fp8"`` the compute dtype is the dtype of everything that is not float8; the
  float8 weights are dequantized to it inside each matmul. Without fp8 the parameters are
  the compute dtype, so a ``compute_dtype`` other than ``dtype`` is refused.
  """
  compute = _float_dtype(compute_dtype, "compute_dtype",
                         "bfloat16 with dtype='fp8', else the parameter dtype")
  if isinstance(dtype, str) and dtype == FP8:
    return compute or jnp.dtype(jnp.bfloat16), True
  resolved = _float_dtype(dtype, "dtype", "bfloat16") or jnp.dtype(jnp.bfloat16)
  if compute is not None and compute != resolved:
    raise ValueError(f"compute_dtype {compute.name} differs from dtype {resolved.name}: "
                     "without dtype='fp8' the model computes in its parameter dtype; pass "
                     "dtype=compute_dtype (or dtype='fp8' to keep float8 weights)")
  return resolved, False


def _shardings(params: nnx.State, mesh, block: tuple[int, int]) -> dict:
  """Where each parameter goes: the partition rules on a mesh, else the first local device."""
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return {p: device for p, _ in params.flat_state()}
  layouts = param_layouts(params)
  for p, var in params.flat_state():  # first: a cut block says more than an odd scale count
    if p[-1] == quant.VALUES:
      layout = layouts[p]
      spec = sharding.param_spec(layout.rule_name, layout.leading, len(var.shape))
      quant.check_block_split(layout.rule_name, var.shape, spec, mesh, block)
  return dict(state_shardings(params, mesh).flat_state())


def read_config(path: Path) -> dict:
  """The ``config.json`` of a checkpoint directory as a dict."""
  hf = read_json_object(path / "config.json")
  if hf is None:
    raise CheckpointError(f"{path}: no config.json")
  return hf


def load_pretrained(path: str | os.PathLike, *, dtype=None, compute_dtype=None,
                    attention: str = "mqa-only", backend: str | Backend = "auto",
                    mesh=None, mtp: bool | None = None,
                    grouped_matmul: str = "auto") -> CausalLM:
  """A ``CausalLM`` from an HF directory (``config.json`` + safetensors, single or sharded).

  Args:
    path: the checkpoint directory.
    dtype: parameter dtype (bfloat16, float16, float32 or float64; None is bfloat16), or
      ``"fp8"``: weights the checkpoint stores as float8 with a ``weight_scale_inv`` stay
      float8 with their block scales (dequantized to the compute dtype inside each matmul),
      the rest is held in ``compute_dtype``. Otherwise fp8 weights are dequantized while
      loading. The MoE router and the indexer's ``weights_proj`` stay float32 whatever is
      asked, as in HF.
    compute_dtype: with ``dtype="fp8"``, the dtype the model computes in and holds its other
      parameters in (bfloat16, float16, float32 or float64; None is bfloat16). float32 lets
      an fp8 checkpoint be checked against a float32 reference: it then differs from
      ``dtype=jnp.float32`` (dequantized at load) only by rounding order. Without fp8 it may
      only repeat ``dtype``.
    attention: ``"mqa-only"`` or ``"dense-capable"`` (``ModelConfig.attention``).
    backend: ``"auto" | "xla" | "pallas" | "mosaic-gpu"`` or a ``Backend``.
    mesh: a ``jax.sharding.Mesh`` (``mla_jax.sharding.make_mesh``): parameters are placed by
      the partition rules, each process reading only its own devices' pieces, and the model
      computes sharded. None: the first local device.
    mtp: load the ``num_nextn_predict_layers`` MTP layers (``CausalLM.mtp``, for speculative
      decoding); their tensors must then be there. None (the default): load them when the
      checkpoint holds MTP tensors, else skip them (HF transformers saves none, yet its
      DeepSeek-V3 config counts one). False skips their tensors, memory and the check of
      their embedding and head copies (one full read of each), and gives
      ``config.num_mtp_layers == 0``: enough for plain decoding.
    grouped_matmul: the MoE's grouped matmul, as ``CausalLM``'s
      (``models.moe.resolve_grouped_matmul``: ``"auto"``, ``"tiled"`` or ``"ragged_dot"``).

  Raises:
    CheckpointError: a bad config, file or tensor set; every tensor mismatch is listed
      together and nothing is read before all checks pass.
    ValueError: a bad ``dtype``, ``compute_dtype``, ``attention`` or ``grouped_matmul``, or a
      mesh the model cannot be split over.
  """
  param_dtype, keep_fp8 = resolve_dtypes(dtype, compute_dtype)
  grouped_matmul = resolve_grouped_matmul(grouped_matmul)
  if attention not in ATTENTION_KINDS:
    raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path} is not a directory")
  hf = read_config(path)
  if mtp is not None and not isinstance(mtp, bool):
    raise ValueError(f"mtp must be a bool or None, got {mtp!r}")
  try:
    config = config_from_hf(hf, attention=attention)
    block = fp8_block_size(hf)
  except CheckpointError as e:
    raise CheckpointError(f"{path / 'config.json'}: {e}") from None
  mtp_layers = config.num_mtp_layers
  if mtp is False:
    config = dataclasses.replace(config, num_mtp_layers=0)
  backend = get_backend(backend)
  # Shapes only; on a mesh this also refuses heads, experts or dimensions that do not split,
  # before the checkpoint is opened.
  shapes = lambda config: nnx.eval_shape(lambda: CausalLM(
      config, rngs=nnx.Rngs(0), backend=backend, param_dtype=param_dtype, mesh=mesh,
      grouped_matmul=grouped_matmul))
  abstract = shapes(config)
  tensors = open_checkpoint(path)
  if (mtp is None and config.num_mtp_layers
      and not any(_is_mtp(name, config.num_layers) for name in tensors)):
    config = dataclasses.replace(config, num_mtp_layers=0)  # counted but not stored (HF)
    abstract = shapes(config)
  # Layers past the MTP ones the config counts are skipped, as HF skips the MTP layers.
  available = {name: handle for name, handle in tensors.items()
               if not _is_mtp(name, config.num_layers + config.num_mtp_layers)}
  copies = {c: o for c, o in hf_layout.mtp_shared_copies(config).items() if c in available}
  stored_copies = {c: available.pop(c) for c in copies}
  if keep_fp8:
    _keep_fp8(path, abstract, available, block)
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  hint = (f"config.json says num_nextn_predict_layers={mtp_layers}; load_pretrained(..., "
          "mtp=False) skips the MTP layers" if config.num_mtp_layers else "")
  scales = _check_tensors(path, expected_tensors(params), available, block, hint)
  _check_shared_copies(path, {**available, **stored_copies}, copies)
  shardings = _shardings(params, mesh, block)

  def read(name, tail):
    if name in scales:
      return _dequantized_slice(available[name], available[scales[name]], tail, block)
    return available[name][tail]

  # Unmapping the files after each placed piece keeps the pages read for it from piling up
  # in this process's memory (re-mapping costs a header parse).
  state = fill_parameters(params, read, shardings, placed=tensors.release)
  return nnx.merge(graphdef, state, rest)
