"""Lazy, memory-mapped reads of safetensors checkpoints with the ``safetensors`` library.

``open_checkpoint(directory)`` maps each tensor name to a ``TensorHandle``: ``.shape``,
``.dtype`` (NumPy or ml_dtypes) and ``handle[index]``, which reads just that slice. A sharded
checkpoint opens a shard the first time one of its tensors is touched, so a caller that reads
some tensors opens only their files (``opened_files`` says which; opening reads the header
alone). ``bytes_read`` counts the tensor data each file has given, per file.

The library validates each file as it opens it (header, dtypes, offsets, coverage). When it
refuses one, the header is read here again to say which tensor and what is wrong, since its
own messages rarely name either. Its NumPy backend cannot build float8 arrays (safetensors
0.6 to 0.8 fail with "module 'numpy' has no attribute 'float8_e4m3fn'"), so float8 tensors
are viewed from the memory-mapped bytes at the header's offsets with ml_dtypes; every other
dtype is read with the library's ``get_slice``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from mla_jax.checkpoints.errors import CheckpointError

# safetensors dtype names -> little-endian NumPy dtypes (bf16 and fp8 come from ml_dtypes).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("bool"),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_RAW_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0"})  # beyond the library's NumPy backend
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def safetensors_dtype(dtype) -> str | None:
  """The safetensors name of a NumPy dtype (either byte order), None if it has none."""
  dtype = np.dtype(dtype)
  return _NAMES.get(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)


# ---- explaining a refused file --------------------------------------------------------------

def _entry_problem(entry) -> str | None:
  if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
    return f"header entry must hold dtype, shape and data_offsets, got {entry!r}"
  dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
  if dtype not in DTYPES:
    return f"unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})"
  if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
    return f"shape must be a list of ints >= 0, got {shape!r}"
  if not (isinstance(offsets, list) and len(offsets) == 2
          and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
    return f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}"
  nbytes = math.prod(shape) * DTYPES[dtype].itemsize
  if offsets[1] - offsets[0] != nbytes:
    return (f"shape {tuple(shape)} of {dtype} needs {nbytes} bytes but data_offsets {offsets} "
            f"span {offsets[1] - offsets[0]}")
  return None


def _layout_problem(header: dict, buffer_size: int) -> str | None:
  """The tensors must tile the data buffer: no overlap, no gap, nothing past its end."""
  pos, prev = 0, None
  for name, (begin, end) in sorted(((n, tuple(e["data_offsets"])) for n, e in header.items()),
                                   key=lambda item: item[1]):
    if end > buffer_size:
      return (f"tensor {name!r}: data_offsets [{begin}, {end}] run past the data buffer "
              f"({buffer_size} bytes; truncated file?)")
    if begin < pos:
      return (f"tensor {name!r} overlaps tensor {prev!r} (begins at byte {begin}, {prev!r} "
              f"ends at {pos})")
    if begin > pos:
      return f"bytes [{pos}, {begin}) of the data buffer belong to no tensor (before {name!r})"
    pos, prev = end, name
  if pos != buffer_size:
    return f"the data buffer holds {buffer_size} bytes but the tensors cover only {pos}"
  return None


def _diagnose(path: Path) -> str | None:
  """What is wrong with a file the library refused (None: nothing found here)."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      return (f"truncated file ({size} bytes; a safetensors file starts with an 8-byte header "
              "length)")
    header_len = int.from_bytes(prefix, "little")
    if header_len > size - 8:
      return (f"header length {header_len} exceeds the file ({size} bytes; truncated or not a "
              "safetensors file)")
    raw = f.read(header_len)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    return f"corrupt JSON header: {e}"
  if not isinstance(header, dict):
    return f"the header must be a JSON object, got {type(header).__name__}"
  metadata = header.pop("__metadata__", None) or {}
  if not (isinstance(metadata, dict)
          and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
    return "__metadata__ must map strings to strings"
  for name, entry in header.items():
    problem = _entry_problem(entry)
    if problem:
      return f"tensor {name!r}: {problem}"
  return _layout_problem(header, size - 8 - header_len)


# ---- one file, one tensor -------------------------------------------------------------------

def _blocks(index, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple]:
  """A basic NumPy index -> (the contiguous block to read, the index to apply to it).

  The library reads step-1 blocks with in-range bounds only (0.6 ignores steps), so steps,
  negative bounds and integers are applied to the block after the read.
  """
  items = index if isinstance(index, tuple) else (index,)
  ellipses = sum(item is Ellipsis for item in items)
  if ellipses > 1:
    raise IndexError("an index can only have a single ellipsis ('...')")
  if len(items) - ellipses > len(shape):
    raise IndexError(f"too many indices for a tensor of shape {shape}")
  if ellipses:
    at = next(i for i, item in enumerate(items) if item is Ellipsis)
    items = items[:at] + (slice(None),) * (len(shape) - len(items) + 1) + items[at + 1:]
  items += (slice(None),) * (len(shape) - len(items))
  block, after = [], []
  for item, dim in zip(items, shape):
    if isinstance(item, slice):
      start, stop, step = item.indices(dim)
      if step > 0:
        block.append(slice(start, max(stop, start)))
        after.append(slice(None, None, step))
      else:
        block.append(slice(0, dim))
        after.append(item)
    elif isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
      if not -dim <= item < dim:
        raise IndexError(f"index {item} is out of bounds for an axis of size {dim}")
      block.append(slice(int(item) % dim, int(item) % dim + 1))
      after.append(0)
    else:
      raise IndexError(f"tensor handles take ints, slices and '...' only, got {item!r}")
  return tuple(block), tuple(after)


class SafetensorsFile:
  """One safetensors file, opened (and validated by the library) on first use."""

  def __init__(self, path: str | os.PathLike, *, missing: str | None = None):
    self.path = Path(path)
    self._missing = missing or f"{self.path} does not exist"
    self._file = None
    self._keys: frozenset[str] | None = None
    self._info: dict[str, tuple[str, tuple[int, ...]]] = {}
    self._offsets: dict[str, tuple[int, int]] | None = None  # for float8 reads
    self._mapped = None  # our own memory map of the data buffer, for float8 reads
    self.bytes_read = 0  # tensor data read so far (headers not counted)

  @property
  def opened(self) -> bool:
    """Whether the file has been opened (its header read), whatever ``release`` did since."""
    return self._keys is not None

  def release(self) -> None:
    """Unmaps the file; its pages leave this process (the page cache may keep them). The
    header stays known, and the next read maps the file again."""
    self._file = self._mapped = None

  def _library(self):
    if self._file is None:
      if not self.path.is_file():
        raise CheckpointError(self._missing)
      try:
        self._file = safe_open(str(self.path), framework="numpy")
      except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{self.path}: {_diagnose(self.path) or e}") from None
      self._keys = frozenset(self._file.keys())
    return self._file

  def keys(self) -> list[str]:
    return list(self._library().keys())

  def __contains__(self, name: str) -> bool:
    self._library()
    return name in self._keys

  def metadata(self) -> dict[str, str]:
    return self._library().metadata() or {}

  def info(self, name: str) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype name, shape) of one tensor."""
    if name not in self._info:
      try:
        view = self._library().get_slice(name)
      except SafetensorError as e:
        raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None
      self._info[name] = view.get_dtype(), tuple(view.get_shape())
    return self._info[name]

  def _raw_view(self, name: str, dtype: np.dtype, shape) -> np.ndarray:
    if self._mapped is None:
      with open(self.path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
      header.pop("__metadata__", None)
      start, size = 8 + header_len, self.path.stat().st_size - 8 - header_len
      self._mapped = np.memmap(self.path, np.uint8, "r", offset=start, shape=(size,))
      self._offsets = {n: tuple(e["data_offsets"]) for n, e in header.items()}
    begin, end = self._offsets[name]
    return self._mapped[begin:end].view(dtype).reshape(shape)

  def read(self, name: str, index=()) -> np.ndarray:
    """``tensor[index]`` as a NumPy array that owns its memory (basic indexing only)."""
    st_dtype, shape = self.info(name)
    if st_dtype not in DTYPES:
      raise CheckpointError(f"{self.path}: tensor {name!r}: dtype {st_dtype} has no NumPy "
                            f"equivalent here (supported: {', '.join(DTYPES)})")
    dtype = DTYPES[st_dtype]
    block, after = _blocks(index, shape)
    block_shape = tuple(s.stop - s.start for s in block)
    if math.prod(block_shape) == 0:
      data = np.empty(block_shape, dtype)
    elif st_dtype in _RAW_DTYPES:
      data = self._raw_view(name, dtype, shape)[block]
    else:
      try:
        data = self._library().get_slice(name)[block]
      except SafetensorError as e:
        raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None
      if data.dtype != dtype:  # bf16 arrives as ml_dtypes.bfloat16; a raw uint16 is viewed
        data = data.view(dtype)
    data = np.array(data[after], copy=True, order="C")
    self.bytes_read += data.nbytes
    return data


class TensorHandle:
  """One tensor of a checkpoint: ``.shape``, ``.dtype``, ``handle[index]`` reads that slice.

  Nothing is read (and, in a sharded checkpoint, no file is opened) until one of these is
  used. ``dtype`` is None for a safetensors dtype without a NumPy equivalent here.
  """

  def __init__(self, file: SafetensorsFile, name: str, *, misplaced: str | None = None):
    self.file, self.name = file, name
    self._misplaced = misplaced

  def _info(self) -> tuple[str, tuple[int, ...]]:
    if self._misplaced is not None and self.name not in self.file:
      raise CheckpointError(self._misplaced)
    return self.file.info(self.name)

  @property
  def st_dtype(self) -> str:
    """The safetensors dtype name, e.g. ``"BF16"`` or ``"F8_E4M3"``."""
    return self._info()[0]

  @property
  def dtype(self) -> np.dtype | None:
    return DTYPES.get(self.st_dtype)

  @property
  def shape(self) -> tuple[int, ...]:
    return self._info()[1]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize

  def __getitem__(self, index) -> np.ndarray:
    self._info()
    return self.file.read(self.name, index)

  def read(self) -> np.ndarray:
    """The whole tensor."""
    return self[...]

  def __repr__(self) -> str:
    return f"TensorHandle({self.name!r} in {self.file.path.name})"


class CheckpointTensors(Mapping):
  """Tensor name -> ``TensorHandle`` over one file or the shards of an index."""

  def __init__(self, handles: dict[str, TensorHandle], files: list[SafetensorsFile]):
    self._handles, self._files = handles, files

  def __getitem__(self, name: str) -> TensorHandle:
    return self._handles[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._handles)

  def __len__(self) -> int:
    return len(self._handles)

  @property
  def opened_files(self) -> list[str]:
    """Names of the files opened so far (a header read, for shapes and dtypes)."""
    return [f.path.name for f in self._files if f.opened]

  def release(self) -> None:
    """Unmaps every file opened so far (``SafetensorsFile.release``)."""
    for file in self._files:
      file.release()

  @property
  def bytes_read(self) -> dict[str, int]:
    """File name -> bytes of tensor data read from it so far (files with none left out)."""
    return {f.path.name: f.bytes_read for f in self._files if f.bytes_read}


def open_safetensors(path: str | os.PathLike) -> CheckpointTensors:
  """Every tensor of one safetensors file (opened and validated now, read lazily)."""
  file = SafetensorsFile(path)
  return CheckpointTensors({name: TensorHandle(file, name) for name in file.keys()}, [file])


def read_json_object(file: Path) -> dict | None:
  """A JSON object file (a config), or None when it does not exist; anything else is a clear
  error naming the file."""
  try:
    value = json.loads(Path(file).read_text(encoding="utf-8"))
  except FileNotFoundError:
    return None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file}: invalid JSON: {e}") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{file}: must hold a JSON object, got a JSON {type(value).__name__}")
  return value


def _read_index(path: Path) -> dict[str, str]:
  try:
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
      raise TypeError("weight_map must map tensor names to file names")
  except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointError(f"{path / INDEX_FILE}: not a safetensors index ({e!r})") from None
  for file in set(weight_map.values()):
    if Path(file).name != file or file in ("", ".", ".."):
      raise CheckpointError(f"{path / INDEX_FILE}: shard {file!r} is not a file name in {path}")
  return weight_map


def open_checkpoint(path: str | os.PathLike) -> CheckpointTensors:
  """The tensors of an HF checkpoint directory: ``model.safetensors`` (preferred, as in HF)
  or the shards of ``model.safetensors.index.json``, opened when first needed.

  Pickle-based weights (``*.bin``, ``*.pt``, ...) can run code when loaded and are refused.
  """
  path = Path(path)
  if (path / SINGLE_FILE).is_file():
    return open_safetensors(path / SINGLE_FILE)
  if (path / INDEX_FILE).is_file():
    weight_map = _read_index(path)
    shards = {file: SafetensorsFile(path / file, missing=f"{path / INDEX_FILE}: shard {file!r} "
                                                         f"does not exist in {path}")
              for file in sorted(set(weight_map.values()))}
    handles = {name: TensorHandle(shards[file], name,
                                  misplaced=f"{path / INDEX_FILE} places tensor {name!r} in "
                                            f"{file}, which does not hold it")
               for name, file in weight_map.items()}
    return CheckpointTensors(handles, list(shards.values()))
  pickles = sorted(p.name for pattern in _PICKLE_PATTERNS for p in path.glob(pattern))
  if pickles:
    raise CheckpointError(f"{path}: only pickle-based weights ({', '.join(pickles)}); "
                          "safetensors only: pickle files can run code when loaded. Convert "
                          "them to model.safetensors with a trusted tool first")
  raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")
