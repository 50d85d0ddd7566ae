"""The GGUF container, read with every count, length and offset checked against the file first.

    header = read_header("model.gguf")     # SourceError (one line: the field, its value, the fix) on damage
    header.version          2 or 3
    header.fields           {key: Field}: Field.value a Python int / float / bool / str, or a list of them
                            for an array (Field.item_type: its elements' GGUF value type)
    header.tensors          (TensorInfo, ...) in file order: name, dims (GGUF order, ne0 first), ggml type,
                            start (absolute byte offset of its data), nbytes
    header.alignment, header.data_start, header.size

Layout (GGUF v2 / v3, little-endian): b"GGUF", u32 version, u64 tensor_count, u64 kv_count; kv_count
key-values (u64-length UTF-8 key, u32 value type, the value: a scalar, a u64-length string, or an array:
u32 element type, u64 length, the elements); tensor_count tensor infos (u64-length name, u32 n_dims,
n_dims u64 dims, u32 ggml type, u64 offset into the data section); padding to general.alignment (32 unless
given); the data section.

Why our own reader: every number the file claims is compared with the bytes left before anything is read
or allocated from it, so a damaged header is refused in time proportional to the file, never to a count it
claims (gguf.GGUFReader trusts the counts: a huge array length loops for ever, and it builds one object per
array element, 4 s for a 49k-token vocabulary). The gguf package still supplies the ggml type table
(block sizes) and the dequantization (tensor.py).
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any

import gguf
import numpy as np

from ..errors import SourceError

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_NAME = 63                   # GGML_MAX_NAME - 1: llama.cpp's limit on tensor names (bytes)
STRING, ARRAY = 8, 9
# GGUF value type -> (struct format, name); STRING and ARRAY are read apart
SCALARS = {0: ("<B", "uint8"), 1: ("<b", "int8"), 2: ("<H", "uint16"), 3: ("<h", "int16"), 4: ("<I", "uint32"),
           5: ("<i", "int32"), 6: ("<f", "float32"), 7: ("<?", "bool"), 10: ("<Q", "uint64"), 11: ("<q", "int64"),
           12: ("<d", "float64")}
TYPE_NAMES = {**{t: name for t, (_, name) in SCALARS.items()}, STRING: "string", ARRAY: "array"}
_MIN_KV = 8 + 4 + 1             # key length, value type, the smallest value
_MIN_TENSOR = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
DAMAGED = "the file is damaged or truncated: download or convert it again"


@dataclasses.dataclass(frozen=True)
class Field:
    """One metadata key-value: `type` and `item_type` are GGUF value types (see TYPE_NAMES)."""
    key: str
    type: int
    value: Any
    item_type: int | None = None

    def describe(self) -> str:
        """The field's type in words: "uint32", "array of 49152 string"."""
        if self.type == ARRAY:
            return f"array of {len(self.value)} {TYPE_NAMES[self.item_type]}"
        return TYPE_NAMES[self.type]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor info, checked: a known ggml type, its data inside the file, aligned, overlapping none."""
    name: str
    dims: tuple[int, ...]       # GGUF order: ne0 (the contiguous dim) first
    ggml_type: int
    type_name: str
    block_size: int
    type_size: int
    start: int                  # absolute offset of the data in the file
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A checked GGUF header: see the module docstring."""
    path: str
    size: int
    version: int
    fields: dict[str, Field]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_start: int


def show(text: str, limit: int = 60) -> str:
    """A name or value from the file, quoted and cut short for a one-line message."""
    r = repr(text)
    return r if len(r) <= limit else r[:limit - 4] + "...'"


class _Cursor:
    """Reads the header front to back; every read first checks that the file holds it."""

    def __init__(self, buf: mmap.mmap, size: int, where: str):
        self.buf, self.size, self.where, self.pos = buf, size, where, 0

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise SourceError(f"{self.where}: {what} at byte {self.pos} takes {n} bytes, but the file ends at byte "
                              f"{self.size}; {DAMAGED}")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"the length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(f"{self.where}: {what} is not UTF-8 (starts {raw[:24]!r}); {DAMAGED}") from None

    def strings(self, n: int, what: str) -> list[str]:
        """n length-prefixed strings; the loop is bounded by the file (each takes at least 8 bytes)."""
        self.need(8 * n, f"{what}: {n} strings of at least 8 bytes each")
        buf, pos, size, out = self.buf, self.pos, self.size, []
        for i in range(n):
            length = struct.unpack_from("<Q", buf, pos)[0] if pos + 8 <= size else None
            if length is None or length > size - pos - 8:
                self.pos = pos
                self.need(8 if length is None else 8 + length, f"{what}[{i}]")
            raw = buf[pos + 8:pos + 8 + length]
            pos += 8 + length
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise SourceError(f"{self.where}: {what}[{i}] is not UTF-8 (starts {raw[:24]!r}); {DAMAGED}") from None
        self.pos = pos
        return out

    def numbers(self, item_type: int, n: int, what: str) -> list:
        fmt = SCALARS[item_type][0]
        item = struct.calcsize(fmt)
        self.need(item * n, f"{what}: {n} x {TYPE_NAMES[item_type]}")
        dtype = np.dtype(np.uint8 if item_type == 7 else fmt)
        values = np.frombuffer(self.buf[self.pos:self.pos + item * n], dtype=dtype)   # a copy: the map closes
        self.pos += item * n
        return (values != 0).tolist() if item_type == 7 else values.tolist()


def read_header(path: str) -> Header:
    """Read and check a GGUF file's header, key-values and tensor infos (the data stays on disk)."""
    where = os.path.basename(path)
    size = os.path.getsize(path)
    if size < 24:
        raise SourceError(f"{path} is not a readable GGUF file: {size} bytes, fewer than a GGUF header's 24")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf, size, where)
        magic = bytes(buf[:4])
        if magic != b"GGUF":
            raise SourceError(f"{path} is not a readable GGUF file: it starts with {magic!r}, not b'GGUF'")
        cur.pos = 4
        version = _version(cur.unpack("<I", "GGUF.version"), where)
        tensor_count = cur.unpack("<Q", "GGUF.tensor_count")
        kv_count = cur.unpack("<Q", "GGUF.kv_count")
        _check_counts(tensor_count, kv_count, size - cur.pos, where)
        fields: dict[str, Field] = {}
        for i in range(kv_count):
            field = _read_field(cur, i)
            if field.key in fields:
                raise SourceError(f"{where}: metadata key {show(field.key)} appears twice; {DAMAGED}")
            fields[field.key] = field
        raw = [_read_tensor_info(cur, i) for i in range(tensor_count)]
        alignment = _alignment(fields, where)
        data_start = -(-cur.pos // alignment) * alignment
        tensors = tuple(_place(*info, data_start, alignment, size, where) for info in raw)
    finally:
        buf.close()
    _check_overlaps(tensors, where)
    return Header(path, size, version, fields, tensors, alignment, data_start)


def _version(version: int, where: str) -> int:
    if version not in VERSIONS and version & 0xFFFF == 0 and version:
        raise SourceError(f"{where}: GGUF.version reads {version}, i.e. a big-endian file; hloserve reads "
                          f"little-endian GGUF files: convert the model again without --bigendian")
    if version == 1:
        raise SourceError(f"{where}: GGUF.version = 1 (llama.cpp before August 2023) is not supported; convert the "
                          f"model again with a current llama.cpp (versions {VERSIONS} are read)")
    if version not in VERSIONS:
        raise SourceError(f"{where}: GGUF.version = {version}, but GGUF versions are {VERSIONS}; the file is "
                          f"damaged, or newer than this reader: upgrade hloserve or convert the model again")
    return version


def _check_counts(tensor_count: int, kv_count: int, left: int, where: str) -> None:
    """Both counts fit in the bytes left, so reading them is bounded by the file."""
    if kv_count * _MIN_KV > left:
        raise SourceError(f"{where}: GGUF.kv_count = {kv_count}, but the {left} bytes after the header hold at most "
                          f"{left // _MIN_KV} key-values; {DAMAGED}")
    if tensor_count * _MIN_TENSOR + kv_count * _MIN_KV > left:
        raise SourceError(f"{where}: GGUF.tensor_count = {tensor_count}, but the {left} bytes after the header hold "
                          f"at most {(left - kv_count * _MIN_KV) // _MIN_TENSOR} tensor infos besides "
                          f"{kv_count} key-values; {DAMAGED}")


def _read_field(cur: _Cursor, index: int) -> Field:
    key = cur.string(f"the key of metadata entry #{index}")
    vtype = cur.unpack("<I", f"the value type of {show(key)}")
    if vtype in SCALARS:
        return Field(key, vtype, cur.unpack(SCALARS[vtype][0], show(key)))
    if vtype == STRING:
        return Field(key, vtype, cur.string(show(key)))
    if vtype != ARRAY:
        raise SourceError(f"{cur.where}: metadata {show(key)} has value type {vtype}, which is no GGUF value type "
                          f"(0..12); {DAMAGED}")
    item = cur.unpack("<I", f"the element type of {show(key)}")
    n = cur.unpack("<Q", f"the length of {show(key)}")
    if item == STRING:
        return Field(key, vtype, cur.strings(n, show(key)), item)
    if item in SCALARS:
        return Field(key, vtype, cur.numbers(item, n, show(key)), item)
    kind = "arrays of arrays are not used by llama.cpp models" if item == ARRAY else "that is no GGUF value type"
    raise SourceError(f"{cur.where}: metadata {show(key)} is an array of element type {item} ({kind}); {DAMAGED}")


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    """(name, dims, ggml type, offset) of tensor info #index, its name and rank checked."""
    name = cur.string(f"the name of tensor #{index}")
    if not name or len(name.encode()) > MAX_NAME:
        raise SourceError(f"{cur.where}: tensor #{index} is named {show(name)} ({len(name.encode())} bytes); GGUF "
                          f"tensor names have 1..{MAX_NAME} bytes; {DAMAGED}")
    n_dims = cur.unpack("<I", f"the rank of tensor {show(name)}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise SourceError(f"{cur.where}: tensor {show(name)} has {n_dims} dimensions; GGUF tensors have 1..{MAX_DIMS}; "
                          f"{DAMAGED}")
    cur.need(8 * n_dims, f"the dims of tensor {show(name)}")
    dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
    cur.pos += 8 * n_dims
    ggml_type = cur.unpack("<I", f"the ggml type of tensor {show(name)}")
    offset = cur.unpack("<Q", f"the data offset of tensor {show(name)}")
    return name, tuple(int(d) for d in dims), ggml_type, offset


def _alignment(fields: dict[str, Field], where: str) -> int:
    f = fields.get("general.alignment")
    if f is None:
        return DEFAULT_ALIGNMENT
    if f.type != 4 or f.value == 0 or f.value & (f.value - 1):
        raise SourceError(f"{where}: general.alignment = {f.value!r} ({f.describe()}); it must be a power of two "
                          f"stored as uint32 (llama.cpp writes 32); {DAMAGED}")
    return f.value


def _place(name: str, dims: tuple[int, ...], ggml_type: int, offset: int, data_start: int, alignment: int,
           size: int, where: str) -> TensorInfo:
    """The tensor's type looked up, its byte size computed and its data checked to lie inside the file."""
    try:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise SourceError(f"{where}: tensor {show(name)} has ggml type {ggml_type}, which the gguf package does "
                          f"not know; the file is damaged, or needs a newer gguf package (pip install -U gguf)") from None
    if dims[0] % block_size:
        raise SourceError(f"{where}: tensor {show(name)} has rows of {dims[0]} elements, not a multiple of its "
                          f"{qtype.name} block of {block_size}; {DAMAGED}")
    nbytes = math.prod(dims) // block_size * type_size
    if offset % alignment:
        raise SourceError(f"{where}: tensor {show(name)} has data offset {offset}, not a multiple of the file's "
                          f"alignment {alignment}; {DAMAGED}")
    start = data_start + offset
    if start + nbytes > size:
        raise SourceError(f"{where}: tensor {show(name)} ({qtype.name} {list(dims)}, {nbytes} bytes at byte {start}) "
                          f"ends past the end of the file ({size} bytes); {DAMAGED}")
    return TensorInfo(name, dims, int(qtype), qtype.name, block_size, type_size, start, nbytes)


def _check_overlaps(tensors: tuple[TensorInfo, ...], where: str) -> None:
    names: set[str] = set()
    for t in tensors:
        if t.name in names:
            raise SourceError(f"{where}: tensor {show(t.name)} appears twice; {DAMAGED}")
        names.add(t.name)
    by_start = sorted(tensors, key=lambda t: t.start)
    for a, b in zip(by_start, by_start[1:]):
        if b.start < a.start + a.nbytes:
            raise SourceError(f"{where}: the data of tensors {show(a.name)} and {show(b.name)} overlap (bytes "
                              f"{a.start}+{a.nbytes} and {b.start}); {DAMAGED}")
