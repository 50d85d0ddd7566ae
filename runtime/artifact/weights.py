"""Streaming safetensors I/O.

The writer emits one tensor at a time (header first, then each tensor's bytes),
so exporting never holds a second copy of the model in memory; it returns the
sha256 of every tensor as it goes. The reader memory-maps the file and hands
out numpy views (bf16 and int4 through ml_dtypes), no copy.

File layout (the safetensors format): u64 little-endian header size N, N bytes
of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {}},
then the data. Offsets are relative to the end of the header.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Mapping

import numpy as np

from . import dtypes
from .errors import ArtifactError

_ALIGN = 64  # pad the header so tensor data starts aligned (fast mmap views)


def _nbytes(dtype: str, shape: Iterable[int]) -> int:
    n = int(np.prod(list(shape), dtype=np.int64))
    return n * dtypes.NUMPY[dtype].itemsize


def write(path: str, specs: Mapping[str, tuple[str, tuple[int, ...]]], produce: Callable[[str], np.ndarray],
          metadata: Mapping[str, str] | None = None, progress: Callable[[int], None] | None = None) -> dict[str, str]:
    """Write tensors named in `specs` {name: (dtype, shape)}; `produce(name)` returns each array when needed.

    Returns {name: sha256 hex} (each tensor hashed on a thread while it is written).
    """
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, (dtype, shape) in specs.items():
        if dtype not in dtypes.SAFETENSORS:
            raise ArtifactError(f"weight {name!r} has dtype {dtype}, which safetensors cannot store")
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": dtypes.SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw) - 8) % _ALIGN)
    digests: dict[str, str] = {}
    tmp = path + ".partial"
    with open(tmp, "wb") as f, ThreadPoolExecutor(1) as hasher:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (dtype, shape) in specs.items():
            arr = np.asarray(produce(name))
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
            if arr.dtype != dtypes.NUMPY[dtype] or tuple(arr.shape) != tuple(shape):
                raise ArtifactError(f"weight {name!r}: produced {arr.dtype}{list(arr.shape)}, declared {dtype}{list(shape)}")
            buf = memoryview(arr.reshape(-1).view(np.uint8))
            digest = hasher.submit(_sha256, buf)     # hashed on a second core while it is written
            f.write(buf)
            digests[name] = digest.result()
            if progress:
                progress(buf.nbytes)
            del arr, buf
    os.replace(tmp, path)
    return digests


def _sha256(buf: memoryview) -> str:
    return hashlib.sha256(buf).hexdigest()      # releases the GIL on large buffers


class Reader:
    """Memory-mapped safetensors file; `reader[name]` is a read-only numpy view."""

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise ArtifactError(f"weights file {path} is missing; re-export the artifact")
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:   # checked before reading: a corrupted length must not allocate n bytes
                    raise ValueError(f"its header length {n} is beyond the file's {size} bytes")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
            offsets = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
            if any(not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e) for b, e in offsets):
                raise ValueError("a tensor's data_offsets are not two increasing non-negative integers")
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise ArtifactError(f"weights file {path} is not valid safetensors ({e}); re-export the artifact") from None
        self.path = path
        self.metadata = header.pop("__metadata__", {})
        self.header = header
        self._data_start = 8 + n
        need = max((e for _, e in offsets), default=0) + self._data_start
        if size < need:
            raise ArtifactError(f"weights file {path} is truncated ({size} bytes, header needs {need}); re-export the artifact")
        self._mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def names(self) -> list[str]:
        return list(self.header)

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = dtypes.NUMPY[dtypes.NAME_OF_SAFETENSORS[info["dtype"]]]
        b, e = info["data_offsets"]
        raw = self._mm[self._data_start + b:self._data_start + e]
        return raw.view(dtype).reshape(info["shape"])

    def sha256(self, name: str) -> str:
        return hashlib.sha256(memoryview(np.ascontiguousarray(self[name]).reshape(-1).view(np.uint8))).hexdigest()
