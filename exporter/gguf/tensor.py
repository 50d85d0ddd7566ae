"""One tensor of a GGUF file: its stored blocks, read in place (memory-mapped), their fields, and
their exact dequantization. exporter/gguf/checkpoint.py builds these from the file's tensor infos.

    t = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    t.gguf_name            "blk.0.attn_q.weight"
    t.ggml_type            "Q4_1" (gguf.GGMLQuantizationType name); t.ggml_type_id 3
    t.shape                (576, 576): torch order (out_features, in_features), HF row order
    t.block_size, t.type_size   elements per block along the last dim, bytes per block (Q4_1: 32, 20)
    t.raw                  read-only memory-mapped file data, file row order: uint8 [rows, row_bytes]
                           for block types, the float array itself for F32/F16/BF16
    t.nbytes, t.file_offset     stored size; offset of the data in the file
    t.row_perm             None, or int64 [rows]: HF row i is file row row_perm[i] (see below)
    t.blocks()             uint8 [*shape[:-1], shape[-1] // block_size, type_size], HF row order:
                           the quantized blocks exactly as stored, rows reordered (no float round trip)
    t.block_fields()       the blocks split into their fields, HF row order, [...] = shape[:-1]:
                           Q4_0/Q4_1/Q8_0: {"d": f16 [..., nb], "m": f16 (Q4_1), "q": [..., nb, 32] uint8
                           0..15 (Q4_*) or int8 (Q8_0)}; value = (q - 8) * d (Q4_0), q * d + m (Q4_1),
                           q * d (Q8_0). Q5_0: {"d", "q": uint8 0..31 [..., nb, 32]}, value (q - 16) * d.
                           Q4_K (super-blocks of 256): {"d", "dmin": f16 [..., nb], "sc", "m": uint8 0..63
                           [..., nb, 8] per sub-block of 32, "q": uint8 0..15 [..., nb, 256]}; value
                           (d * sc) * q - dmin * m. Q5_K: Q4_K's fields, q uint8 0..31. Q6_K: {"d": f16
                           [..., nb], "sc": int8 [..., nb, 16] per sub-block of 16, "q": int8 -32..31 [..., nb, 256]}; value (d * sc) * q. Each
                           formula, computed in float32 in that order, gives `dequantize()` exactly
    t.dequantize()         np.float32 array of t.shape, HF row order; bit-identical to
                           gguf.quants.dequantize(t.raw, type)[t.row_perm]

RoPE layout: llama.cpp's converter permutes the rows of attn_q / attn_k of "llama" models so its
interleaved-pair RoPE ("rope_type NORM") computes what HF's rotate_half RoPE computes on the original
rows: per head, HF row j of the first half and row j + head_dim/2 become adjacent rows 2j, 2j+1. We
undo it with `row_perm`; a row permutation moves whole rows of blocks, so quantized blocks survive it
exactly. Qwen2 files are not permuted (llama.cpp runs them with NEOX RoPE, the HF layout).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import SourceError


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block: uint8 [..., nb, size] -> float16 [..., nb]."""
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> uint8 [..., 2n]: the n low nibbles, then the n high nibbles (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_fields(kind: str, b: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_0 [d f16 | 16 bytes], Q4_1 [d f16 | m f16 | 16 bytes]: element j < 16 in the low nibble of
    byte j, element j + 16 in its high nibble."""
    out = {"d": _f16(b, 0)}
    if kind == "Q4_1":
        out["m"] = _f16(b, 2)
    out["q"] = _nibbles(b[..., 2 * len(out):])                            # [..., nb, 32]
    return out


def _q8_0_fields(kind: str, b: np.ndarray) -> dict[str, np.ndarray]:
    """Q8_0 [d f16 | 32 int8]."""
    return {"d": _f16(b, 0), "q": b[..., 2:].view(np.int8)}              # q: [..., nb, 32]


def _q5_0_fields(kind: str, b: np.ndarray) -> dict[str, np.ndarray]:
    """Q5_0 [d f16 | qh 4 bytes | 16 bytes]: low 4 bits as Q4_0's nibbles, bit 4 of element j is
    bit j of qh (a little-endian uint32)."""
    high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")        # [..., nb, 32]: bit j of qh
    return {"d": _f16(b, 0), "q": _nibbles(b[..., 6:]) | (high << 4)}   # q: [..., nb, 32] 0..31


def _q4_k_fields(kind: str, b: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K [d f16 | dmin f16 | 12 bytes of 6-bit sc, m for 8 sub-blocks of 32 | 128 bytes]: bytes
    0-3 of the 12 hold sc 0-3 in their low 6 bits, bytes 4-7 m 0-3; sub-block 4 + i takes its low
    4 bits from byte 8 + i (sc low nibble, m high nibble) and its top 2 bits from the top 2 bits of
    byte i (sc) or 4 + i (m). Quants: 4 runs of 32 bytes, run r holding sub-block 2r in its low
    nibbles and 2r + 1 in its high ones."""
    s = b[..., 4:16]                                                      # [..., nb, 12]
    lo_sc, lo_m, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (mix & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)   # [..., nb, 8]
    m = np.concatenate([lo_m & 0x3F, (mix >> 4) | ((lo_m >> 6) << 4)], axis=-1)        # [..., nb, 8]
    runs = b[..., 16:].reshape(*b.shape[:-1], 4, 32)                      # [..., nb, 4, 32]
    q = np.stack([runs & 0x0F, runs >> 4], axis=-2)                       # [..., nb, 4, 2, 32]
    return {"d": _f16(b, 0), "dmin": _f16(b, 2), "sc": sc, "m": m, "q": q.reshape(*b.shape[:-1], 256)}


def _q5_k_fields(kind: str, b: np.ndarray) -> dict[str, np.ndarray]:
    """Q5_K [d f16 | dmin f16 | 12 bytes of sc, m (as Q4_K) | qh 32 bytes | 128 bytes]: the low 4 bits
    as Q4_K's quants, bit 4 of element 32 i + j is bit i of qh byte j; value (d * sc) * q - dmin * m."""
    fields = _q4_k_fields(kind, np.concatenate([b[..., :16], b[..., 48:]], axis=-1))
    qh = b[..., 16:48][..., None, :]                                     # [..., nb, 1, 32]
    high = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 0x01          # [..., nb, 8, 32]
    fields["q"] = fields["q"] | (high.reshape(*b.shape[:-1], 256) << 4)  # [..., nb, 256] 0..31
    return fields


def _q6_k_fields(kind: str, b: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K [ql 128 bytes | qh 64 bytes | 16 int8 sc | d f16], two halves of 128 elements: half h's
    low 4 bits are ql bytes 64h..64h+63 (elements 0-63 of the half in the low nibbles, 64-127 in the
    high ones), its top 2 bits qh bytes 32h..32h+31 (bits 2k..2k+1 for elements 32k..32k+31 of the
    half); q = those 6 bits - 32, one scale per 16 elements."""
    lead = b.shape[:-1]
    ql = b[..., :128].reshape(*lead, 2, 64)                               # [..., nb, half, 64]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)                   # [..., nb, half, 128]
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)                         # [..., nb, half, 1, 32]
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03       # [..., nb, half, 4, 32]
    q = (low | (high.reshape(*lead, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    return {"d": _f16(b, 208), "sc": b[..., 192:208].view(np.int8), "q": q.reshape(*lead, 256)}


# ggml block type -> its field decoder (uint8 blocks [..., nb, type_size] -> fields; GGUFTensor.block_fields)
_BLOCK_FIELDS = {"Q4_0": _q4_fields, "Q4_1": _q4_fields, "Q8_0": _q8_0_fields, "Q5_0": _q5_0_fields,
                 "Q4_K": _q4_k_fields, "Q5_K": _q5_k_fields, "Q6_K": _q6_k_fields}


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor of the file. See the module docstring for the fields."""
    name: str
    gguf_name: str
    ggml_type: str
    ggml_type_id: int
    shape: tuple[int, ...]
    block_size: int
    type_size: int
    raw: np.ndarray
    row_perm: np.ndarray | None
    file_offset: int

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def blocks(self) -> np.ndarray:
        """The stored blocks in HF row order: uint8 [*shape[:-1], shape[-1] // block_size, type_size]."""
        data = np.asarray(self.raw).view(np.uint8)
        data = data.reshape(*self.shape[:-1], self.shape[-1] // self.block_size, self.type_size)
        return data[self.row_perm] if self.row_perm is not None else data.copy()

    def block_fields(self) -> dict[str, np.ndarray]:
        """The blocks of a Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K / Q5_K / Q6_K tensor split into their fields, HF row order.

        See the module docstring for each type's fields and the formula that gives `dequantize()`
        exactly; quantized values come in element order (nibble and bit-plane packing undone).
        """
        if self.ggml_type not in _BLOCK_FIELDS:
            raise SourceError(f"{self.gguf_name}: block fields are defined for {sorted(_BLOCK_FIELDS)}, "
                              f"not {self.ggml_type}; use dequantize()")
        return _BLOCK_FIELDS[self.ggml_type](self.ggml_type, self.blocks())

    def dequantize(self) -> np.ndarray:
        """float32 values of `shape` in HF row order (gguf.quants' own dequantization, rows reordered)."""
        import gguf

        values = gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType(self.ggml_type_id))
        values = np.asarray(values, dtype=np.float32).reshape(self.shape)
        if self.row_perm is not None:
            return values[self.row_perm]
        # copy: F32 "dequantization" is a view of the read-only file mapping
        return values.copy() if not values.flags.writeable or np.shares_memory(values, self.raw) else values
