"""Structure-aware mutants of a real GGUF file.

    base = Base.parse(path)                   # the file's key-values and tensor infos (gguf.GGUFReader)
    name, layout = make(base, seed, "17")     # mutant 17 of `seed`: the same one every run
    name, layout = make(base, seed, "named:block_count")   # a NAMED mutation
    layout.write(out)                         # the mutated header, then the original data section

A mutant changes the file's structure, not random bytes alone: a header count, a key-value's value,
type, length or key, an array's length, element type or one element, a tensor info's name, rank,
dims, ggml type or offset, a deleted or duplicated entry, a truncation, or one byte of the header
(the kinds in KINDS, taken in turn; the details drawn from random.Random(f"{seed}:{i}")). The file is
rewritten from those parts, so everything after the change stays well formed. tests/support/gguf_fuzz.py
loads them in a worker process under a deadline.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import struct
from typing import Any, Callable, Iterable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
INTS = (0, 1, 2, 3, 4, 5, 10, 11)
HUGE = (2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1)


@dataclasses.dataclass
class Raw:
    """Bytes written as they are in place of an encoded value or name (a length that lies, say)."""
    data: bytes


@dataclasses.dataclass
class KV:
    key: str | bytes | Raw
    type: int
    value: Any
    item_type: int | None = None
    encoded: bytes | None = None    # the original bytes of type + value, while unchanged


@dataclasses.dataclass
class TensorInfo:
    name: str | bytes | Raw
    dims: list[int]
    ggml_type: int
    offset: int
    n_dims: int | None = None       # written in place of len(dims) when set


@dataclasses.dataclass
class Layout:
    """A GGUF file as parts: what `write` puts back together."""
    source: str
    data_start: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    magic: bytes = b"GGUF"
    version: int = 3
    tensor_count: int | None = None  # written in place of len(tensors) when set
    kv_count: int | None = None
    flip: tuple[int, int] | None = None   # (offset into the header, new byte)
    truncate: int | None = None      # the file's length, when cut

    def header(self) -> bytes:
        out = [self.magic, _u32(self.version), _u64(_given(self.tensor_count, len(self.tensors))),
               _u64(_given(self.kv_count, len(self.kvs)))]
        for kv in self.kvs:
            out.append(_name(kv.key))
            out.append(kv.encoded if kv.encoded is not None else _u32(kv.type) + _value(kv.type, kv.value, kv.item_type))
        for t in self.tensors:
            out += [_name(t.name), _u32(_given(t.n_dims, len(t.dims))), *(_u64(d) for d in t.dims),
                    _u32(t.ggml_type), _u64(t.offset)]
        head = bytearray(b"".join(out))
        head += bytes(-len(head) % 32)
        if self.flip is not None:
            head[self.flip[0] % len(head)] = self.flip[1]
        return bytes(head)

    def write(self, path: str) -> None:
        head = self.header()
        with open(self.source, "rb") as src, open(path, "wb") as dst:
            dst.write(head)
            size = os.fstat(src.fileno()).st_size - self.data_start
            done = 0
            while done < size:
                n = os.copy_file_range(src.fileno(), dst.fileno(), size - done, self.data_start + done)
                if n == 0:
                    break
                done += n
            if self.truncate is not None:
                dst.truncate(min(self.truncate, len(head) + size))


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


def _u32(v: int) -> bytes:
    return struct.pack("<I", v % 2**32)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v % 2**64)


def _name(s: str | bytes | Raw) -> bytes:
    if isinstance(s, Raw):
        return s.data
    b = s.encode() if isinstance(s, str) else s
    return _u64(len(b)) + b


def _scalar(t: int, v: Any) -> bytes:
    fmt = FORMATS[t]
    if t in INTS:   # wrap into the type's range: the mutation picks the bits, not the meaning
        bits = 8 * struct.calcsize(fmt)
        v = int(v) % 2**bits
        v = v - 2**bits if fmt[1].islower() and v >= 2**(bits - 1) else v
    elif t == 7:
        v = bool(v)
    else:
        v = float(v)
    return struct.pack(fmt, v)


def _value(t: int, v: Any, item: int | None) -> bytes:
    if isinstance(v, Raw):
        return v.data
    if t == STRING:
        return _name(v)
    if t == ARRAY:
        return _u32(item) + _u64(len(v)) + b"".join(_value(item, x, None) for x in v)
    return _scalar(t, v)


@dataclasses.dataclass(frozen=True)
class Base:
    """The parsed source file: a Layout to copy per mutant."""
    layout: Layout

    @classmethod
    def parse(cls, path: str) -> "Base":
        import gguf
        r = gguf.GGUFReader(path)
        kvs = []
        for key, f in r.fields.items():
            if key.startswith("GGUF."):
                continue
            types = [int(t) for t in f.types]
            encoded = b"".join(p.tobytes() for p in f.parts[2:])   # type tag + value, as stored
            kvs.append(KV(key, types[0], f.contents(), types[-1] if types[0] == ARRAY else None, encoded))
        tensors = [TensorInfo(t.name, [int(d) for d in t.shape], int(t.tensor_type), t.data_offset - r.data_offset)
                   for t in r.tensors]
        return cls(Layout(path, r.data_offset, kvs, tensors, version=int(r.fields["GGUF.version"].contents())))


# -- the mutations: each changes a copy of the layout and says what it did ---------------------------
def _pick_kv(rng: random.Random, lay: Layout, types: Iterable[int] | None = None) -> KV:
    kinds = set(types) if types is not None else None
    return rng.choice([kv for kv in lay.kvs if kinds is None or kv.type in kinds])


def _set(kv: KV, value: Any, type_: int | None = None, item: int | None = None) -> None:
    kv.value, kv.encoded = value, None
    kv.type = kv.type if type_ is None else type_
    kv.item_type = kv.item_type if item is None else item


def m_magic(rng, lay):
    lay.magic = rng.choice([b"GGUG", b"FUGG", b"\0\0\0\0", bytes(rng.randrange(256) for _ in range(4))])
    return f"magic = {lay.magic!r}"


def m_version(rng, lay):
    lay.version = rng.choice([0, 1, 4, 0x03000000, 2**32 - 1])
    return f"version = {lay.version}"


def m_counts(rng, lay):
    which = rng.choice(["tensor_count", "kv_count"])
    n = len(lay.tensors) if which == "tensor_count" else len(lay.kvs)
    value = rng.choice([n + 1, n - 1, 0, n * 2, *HUGE])
    setattr(lay, which, value)
    return f"{which} = {value} (holds {n})"


def m_truncate(rng, lay):
    head = len(lay.header())
    lay.truncate = rng.choice([rng.randrange(24, head), rng.randrange(head, head + 50_000_000), head + 90_000_000])
    return f"truncated to {lay.truncate} bytes"


def m_int(rng, lay):
    kv = _pick_kv(rng, lay, INTS)
    old, value = kv.value, rng.choice([0, 1, -1, kv.value + 1, kv.value - 1, 2 * kv.value, 1_000_000, *HUGE])
    _set(kv, value)
    return f"{kv.key} = {value} (was {old})"


def m_float(rng, lay):
    kv = _pick_kv(rng, lay, (6, 12))
    _set(kv, rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30, 1e-30, 2.0]))
    return f"{kv.key} = {kv.value}"


def m_string(rng, lay):
    kv = _pick_kv(rng, lay, (STRING,))
    _set(kv, rng.choice(["", "gpt2", "llama", "qwen2", "none", "mistral", "x" * 100_000, b"\xff\xfe\xfd",
                         "\u00e9\u6f22\U0001f600", "{% for %}"]))
    return f"{kv.key} = {kv.value!r:.40}"


def m_retype(rng, lay):
    kv = _pick_kv(rng, lay)
    new = rng.choice([t for t in range(13) if t not in (kv.type, ARRAY)] + [13, 99, 2**32 - 1])
    if new in FORMATS:
        value = rng.choice([0, 1, 7, 2**31]) if new in INTS or new == 7 else rng.choice([0.5, math.nan])
    elif new == STRING:
        value = "7"
    else:
        value = Raw(b"\x01\x02\x03\x04")
    _set(kv, value, new)
    return f"{kv.key}: value type -> {new}"


def m_length(rng, lay):
    kv = _pick_kv(rng, lay, (STRING, ARRAY))
    stored = kv.encoded[4:] if kv.encoded is not None else _value(kv.type, kv.value, kv.item_type)
    at = 4 if kv.type == ARRAY else 0     # an array's u64 length follows its element type
    true = struct.unpack_from("<Q", stored, at)[0]
    claim = rng.choice([true + 1, max(true - 1, 0), *HUGE])
    _set(kv, Raw(stored[:at] + _u64(claim) + stored[at + 8:]))
    return f"{kv.key}: length field {true} -> {claim}"


def m_array_len(rng, lay):
    kv = _pick_kv(rng, lay, (ARRAY,))
    value = list(kv.value)
    how = rng.choice(["empty", "half", "drop last", "repeat last"])
    value = {"empty": [], "half": value[:len(value) // 2], "drop last": value[:-1],
             "repeat last": value + value[-1:]}[how]
    _set(kv, value)
    return f"{kv.key}: {how} ({len(kv.value)} elements)"


def m_item_type(rng, lay):
    kv = _pick_kv(rng, lay, (ARRAY,))
    stored = kv.encoded[4:] if kv.encoded is not None else _value(kv.type, kv.value, kv.item_type)
    new = rng.choice([t for t in range(13) if t != kv.item_type] + [99])
    _set(kv, Raw(_u32(new) + stored[4:]))
    return f"{kv.key}: element type {kv.item_type} -> {new}"


def m_element(rng, lay):
    kv = _pick_kv(rng, lay, (ARRAY,))
    value = list(kv.value)
    if not value:
        return m_delete_kv(rng, lay)
    i = rng.randrange(len(value))
    if kv.item_type == STRING:
        value[i] = rng.choice(["", "x y", "zz", value[rng.randrange(len(value))], b"\xc3\x28", "Ġ Ġ Ġ"])
    elif kv.item_type in INTS:
        value[i] = rng.choice([0, 99, -1, 2**31 - 1])
    else:
        value[i] = rng.choice([math.nan, -1.0, 1e38])
    _set(kv, value)
    return f"{kv.key}[{i}] = {value[i]!r:.30}"


def m_delete_kv(rng, lay):
    kv = lay.kvs.pop(rng.randrange(len(lay.kvs)))
    return f"deleted {kv.key}"


def m_duplicate_kv(rng, lay):
    kv = copy.deepcopy(rng.choice(lay.kvs))
    lay.kvs.insert(rng.randrange(len(lay.kvs) + 1), kv)
    return f"duplicated {kv.key}"


def m_key(rng, lay):
    kv = rng.choice(lay.kvs)
    old = kv.key
    kv.key = rng.choice(["", "qwen2.block_count", "llama.block_count " + "x", b"\xff\xfe", "k" * 5000,
                         Raw(_u64(2**40) + b"abc"), str(old).upper()])
    return f"key {old} -> {kv.key!r:.40}"


def m_add_kv(rng, lay):
    kv = KV(rng.choice(["general.comment", "llama.expert_count", "hloserve.fuzz"]), rng.choice([4, 8, 6]), None)
    kv.value = {4: 3, 8: "fuzz", 6: 0.25}[kv.type]
    lay.kvs.append(kv)
    return f"added {kv.key} = {kv.value!r}"


def m_dims(rng, lay):
    t = rng.choice(lay.tensors)
    if len(t.dims) > 1 and rng.random() < 0.2:
        t.dims.reverse()
        return f"{t.name}: dims reversed -> {t.dims}"
    i = rng.randrange(len(t.dims))
    old = t.dims[i]
    t.dims[i] = rng.choice([0, 1, old + 32, max(old - 32, 0), 2 * old, *HUGE])
    return f"{t.name}: dims[{i}] {old} -> {t.dims[i]}"


def m_rank(rng, lay):
    t = rng.choice(lay.tensors)
    how = rng.choice(["add 1", "drop", "claim"])
    if how == "add 1":
        t.dims.append(1)
    elif how == "drop" and len(t.dims) > 1:
        t.dims.pop()
    else:
        t.n_dims = rng.choice([0, 5, 2**32 - 1])
    return f"{t.name}: rank {how} -> {t.n_dims if t.n_dims is not None else len(t.dims)}"


def m_ggml_type(rng, lay):
    t = rng.choice(lay.tensors)
    old, t.ggml_type = t.ggml_type, rng.choice([4, 5, 99, 2**32 - 1, 0, 1, 8, 12, 26, 30])
    return f"{t.name}: ggml type {old} -> {t.ggml_type}"


def m_offset(rng, lay):
    t = rng.choice(lay.tensors)
    old = t.offset
    t.offset = rng.choice([old + 1, old + 32, max(old - 32, 0), rng.choice(lay.tensors).offset, 2**62, 2**64 - 32,
                           100_000_000])
    return f"{t.name}: offset {old} -> {t.offset}"


def m_tensor_name(rng, lay):
    t = rng.choice(lay.tensors)
    old = t.name
    t.name = rng.choice(["blk.30.attn_q.weight", "blk.999999.attn_q.weight", "blk.007.ffn_up.weight", "",
                         "output.weight", "x" * 200, b"blk.1\xff", rng.choice(lay.tensors).name,
                         "blk.3.ffn_gate_exps.weight", Raw(_u64(2**50))])
    return f"tensor {old} renamed {t.name!r:.40}"


def m_tensor_count(rng, lay):
    i = rng.randrange(len(lay.tensors))
    if rng.random() < 0.5:
        return f"deleted tensor {lay.tensors.pop(i).name}"
    lay.tensors.insert(i, copy.deepcopy(lay.tensors[i]))
    return f"duplicated tensor {lay.tensors[i].name}"


def m_flip(rng, lay):
    head = len(lay.header())
    at = rng.choice([rng.randrange(4, 2048), rng.randrange(head - 20_000, head)])
    lay.flip = (at, rng.randrange(256))
    return f"header byte {at} = {lay.flip[1]}"


KINDS: tuple[Callable[[random.Random, Layout], str], ...] = (
    m_int, m_tensor_name, m_dims, m_string, m_counts, m_retype, m_ggml_type, m_length, m_offset, m_array_len,
    m_element, m_rank, m_key, m_delete_kv, m_item_type, m_tensor_count, m_float, m_truncate, m_duplicate_kv,
    m_version, m_flip, m_add_kv, m_magic)


def set_value(key: str, value: Any) -> Callable[[random.Random, Layout], str]:
    """A named mutation: metadata `key` set to `value` (its type kept)."""
    def apply(rng, lay):
        kv = next(kv for kv in lay.kvs if kv.key == key)
        _set(kv, value)
        return f"{key} = {value}"
    return apply


def mutant(base: Base, seed: int, index: int, kind: Callable | None = None) -> tuple[str, Layout]:
    """Mutant `index` of `seed`: its kind taken in turn from KINDS (or `kind`), its details seeded."""
    rng = random.Random(f"{seed}:{index}")
    lay = copy.deepcopy(base.layout)
    kind = kind or KINDS[index % len(KINDS)]
    return f"{kind.__name__[2:] if kind.__name__.startswith('m_') else 'named'}: {kind(rng, lay)}", lay


NAMED = {"block_count": set_value("llama.block_count", 1_000_000),
         "head_count": set_value("llama.attention.head_count", 0),
         "context_length": set_value("llama.context_length", 0)}


def make(base: Base, seed: int, spec: str) -> tuple[str, Layout]:
    """Spec "17": mutant 17 of `seed`; "named:block_count": a NAMED mutation."""
    if spec.startswith("named:"):
        return mutant(base, seed, 0, NAMED[spec[len("named:"):]])
    return mutant(base, seed, int(spec))
