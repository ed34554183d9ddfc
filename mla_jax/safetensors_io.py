"""A dependency-free reader and writer of the safetensors format, in NumPy.

Layout: an unsigned 64-bit little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``),
then the data buffer; offsets are relative to the buffer's start. A file is validated in
full when it is opened (before any tensor is read): every problem is a ``CheckpointError``
that names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype names -> little-endian NumPy dtypes (bf16 and fp8 come from ml_dtypes).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("bool"),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit


class CheckpointError(ValueError):
  """A checkpoint file or directory that cannot be loaded as it stands."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  dtype: str  # the safetensors name, e.g. "BF16"
  shape: tuple[int, ...]
  begin: int  # byte offsets into the data buffer
  end: int

  @property
  def np_dtype(self) -> np.dtype:
    return DTYPES[self.dtype]


def _parse_entry(path, name: str, entry) -> TensorInfo:
  def fail(problem):
    raise CheckpointError(f"{path}: tensor {name!r}: {problem}")

  if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
    fail(f"header entry must hold exactly dtype, shape and data_offsets, got {entry!r}")
  dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
  if dtype not in DTYPES:
    fail(f"unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})")
  if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
    fail(f"shape must be a list of ints >= 0, got {shape!r}")
  if not (isinstance(offsets, list) and len(offsets) == 2
          and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
    fail(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
  nbytes = math.prod(shape) * DTYPES[dtype].itemsize
  if offsets[1] - offsets[0] != nbytes:
    fail(f"shape {tuple(shape)} of {dtype} needs {nbytes} bytes but data_offsets {offsets} "
         f"span {offsets[1] - offsets[0]}")
  return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(path, tensors: dict[str, TensorInfo], buffer_size: int) -> None:
  """The tensors must tile the buffer exactly: no overlap, no gap, nothing past its end."""
  pos, prev = 0, None
  for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
    if info.end > buffer_size:
      raise CheckpointError(f"{path}: tensor {name!r}: data_offsets [{info.begin}, {info.end}] "
                            f"run past the data buffer ({buffer_size} bytes; truncated file?)")
    if info.begin < pos:
      raise CheckpointError(f"{path}: tensor {name!r} overlaps tensor {prev!r} "
                            f"(begins at byte {info.begin}, {prev!r} ends at {pos})")
    if info.begin > pos:
      raise CheckpointError(f"{path}: bytes [{pos}, {info.begin}) of the data buffer belong "
                            f"to no tensor (before {name!r})")
    pos, prev = info.end, name
  if pos != buffer_size:
    raise CheckpointError(f"{path}: the data buffer holds {buffer_size} bytes but the tensors "
                          f"cover only {pos}")


class SafetensorsFile:
  """One validated file: ``keys()``, ``info(name)``, ``get(name)`` and ``metadata``.

  With ``mmap=True`` (default) ``get`` returns a read-only view into a memory map, so a
  loader touches one tensor's pages at a time; otherwise it reads the bytes into memory.
  """

  def __init__(self, path: str | os.PathLike, *, mmap: bool = True):
    self.path = Path(path)
    size = self.path.stat().st_size
    with open(self.path, "rb") as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise CheckpointError(f"{self.path}: truncated file ({size} bytes; a safetensors file "
                              "starts with an 8-byte header length)")
      header_len = int.from_bytes(prefix, "little")
      if header_len > size - 8 or header_len > _MAX_HEADER_BYTES:
        raise CheckpointError(f"{self.path}: header length {header_len} exceeds the file "
                              f"({size} bytes; truncated or not a safetensors file)")
      raw = f.read(header_len)
    try:
      header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{self.path}: corrupt JSON header: {e}") from None
    if not isinstance(header, dict):
      raise CheckpointError(f"{self.path}: the header must be a JSON object, got "
                            f"{type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
      raise CheckpointError(f"{self.path}: __metadata__ must map strings to strings")
    self.metadata: dict[str, str] = metadata
    self._tensors = {name: _parse_entry(self.path, name, entry) for name, entry in header.items()}
    self._data_start = 8 + header_len
    self._buffer_size = size - self._data_start
    _check_layout(self.path, self._tensors, self._buffer_size)
    self._mmap = (np.memmap(self.path, np.uint8, "r", offset=self._data_start,
                            shape=(self._buffer_size,))
                  if mmap and self._buffer_size else None)

  def keys(self) -> list[str]:
    return list(self._tensors)

  def __contains__(self, name: str) -> bool:
    return name in self._tensors

  def info(self, name: str) -> TensorInfo:
    return self._tensors[name]

  def get(self, name: str) -> np.ndarray:
    info = self._tensors[name]
    if self._mmap is not None:
      data = self._mmap[info.begin:info.end]
    else:
      with open(self.path, "rb") as f:
        f.seek(self._data_start + info.begin)
        data = f.read(info.end - info.begin)
      if len(data) != info.end - info.begin:  # the file shrank after it was opened
        raise CheckpointError(f"{self.path}: tensor {name!r}: short read (truncated file)")
    return np.frombuffer(data, info.np_dtype).reshape(info.shape)


def load_file(path: str | os.PathLike, *, mmap: bool = False) -> dict[str, np.ndarray]:
  """Every tensor of one file (copies unless ``mmap``)."""
  f = SafetensorsFile(path, mmap=mmap)
  return {name: f.get(name) for name in f.keys()}


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> None:
  """Writes ``tensors`` in sorted key order with a space-padded, 8-byte aligned header.

  The file is written beside ``path`` and renamed over it, so a crash never leaves a
  half-written checkpoint under the final name.
  """
  header: dict = {}
  if metadata:
    header["__metadata__"] = dict(metadata)
  arrays, pos = [], 0
  for name in sorted(tensors):
    array = np.asarray(tensors[name])
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype not in _NAMES:
      raise CheckpointError(f"{path}: tensor {name!r}: dtype {array.dtype} has no safetensors "
                            f"name (supported: {', '.join(DTYPES)})")
    array = np.ascontiguousarray(array, dtype)
    header[name] = {"dtype": _NAMES[dtype], "shape": list(array.shape),
                    "data_offsets": [pos, pos + array.nbytes]}
    arrays.append(array)
    pos += array.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)
  path = Path(path)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for array in arrays:
      f.write(array.tobytes())
  os.replace(tmp, path)
