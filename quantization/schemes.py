"""Quantization schemes as data: the one source of truth for how a weight is stored.

A weight W [..., out, in] (a Linear's [out, in], a stacked Llama weight [L, out, in], an
embedding table [vocab, hidden]) is stored as up to three tensors:

    NAME          qweight  int8 [..., out, in]         bits=8: q in [-128, 127]
                           uint8 [..., out, in // 2]   bits=4: two values per byte, element 2k in
                                                       the low nibble, 2k+1 in the high nibble;
                                                       symmetric: signed two's complement [-8, 7],
                                                       asymmetric: unsigned [0, 15]
    NAME_scale    scale    [..., out, in // group]     (group) or [..., out] (per output channel)
    NAME_min      min      same shape as scale         asymmetric only

    symmetric:   W = q * scale
    asymmetric:  W = q * scale + min          (a zero point z is min = -z * scale; storing the
                                               float `min` keeps llama.cpp's Q4_1 exact)

All arithmetic is float32 (scale and min are widened first), which is exactly what the gguf
package computes for Q8_0 / Q4_0 / Q4_1, so an imported GGUF tensor dequantizes bit-identically.
The scheme of each stored tensor is recorded in the artifact manifest (WeightSpec.quant, see
`WeightScheme.manifest_entry`), never inferred from names.

GGUF Q5_0 blocks are kept as 5-bit values (bits 5: group 32, symmetric, the file's f16 d as the
scale), W = q * scale with q in [-16, 15]. A linear layer stores them interleaved by 16 rows (the
`hloserve.quant_linear` version 4 kernel: each 32-element block of 16 rows is the int4 layout's 256
bytes of low nibbles of q + 16, then 64 bytes of their fifth bits; primitives.interleave_rows); row
by row (where a weight is not interleaved, or before it is) they are int8 [..., out, in], one value
a byte, which is exactly int8's layout, so such a weight is stored as int8 (WeightScheme.for_linear).

GGUF K-quant blocks (`block` "Q4_K", "Q5_K", "Q6_K": super-blocks of 256 elements) are kept as
they are, in two tensors (a lossless repack of each block's bytes, exporter/gguf/quant.py):

    NAME          qweight  Q4_K: uint8 [..., out, in // 2], int4 unsigned packed as above
                           Q5_K: int8 [..., out, in], q in [0, 31]; Q6_K: int8, q in [-32, 31]
    NAME_scale    blocks   uint8 [..., out, in // 256 * BLOCKS[block][3]]: each super-block's own
                           header bytes: Q4_K / Q5_K [d f16 | dmin f16 | 12 bytes of 6-bit sub-block
                           scales sc and mins m], Q6_K [16 int8 sub-block scales sc | d f16]

    W = q * (d * sc_j) - dmin * m_j        per sub-block j (`group`: 32, Q6_K 16; no min for Q6_K)

with d * sc and dmin * m exact in float32, which is gguf's own arithmetic (bit-identical values);
runtime/artifact/kernels.py `block_scales` (the contract's own) decodes the headers. A linear layer
whose rows are a multiple of 16 stores its quants interleaved by 16 rows as version 2's (rows=16: Q4_K
as int4's unsigned nibbles, Q5_K / Q6_K as int8's bytes, `[..., out / 16, 16 * row bytes]`; the
`hloserve.quant_linear` version 5 kernel), the headers row by row as above.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Mapping

from hloserve.runtime.artifact.errors import HloserveError
from hloserve.runtime.artifact.kernels import KQUANT_HEADER


class QuantizationError(HloserveError):
    """A quantization spec or tensor that cannot be used; the message says what to change."""


SCALE_SUFFIX = "_scale"
MIN_SUFFIX = "_min"
SCALE_DTYPES = ("f32", "f16")
ROUNDINGS = ("minmax", "mse")


INTERLEAVE = 16   # rows of a matrix interleaved for the quant_linear version 2 kernel
FIVE_BIT_GROUP = 32    # bits 5 (GGUF Q5_0): elements per scale
FIVE_BIT_BYTES = 320   # bits 5 interleaved: bytes of one 32-element block of 16 rows (256 of nibbles, 64 of fifth bits)

# GGUF K-quant block type -> (bits of its stored q, sub-block size, symmetric, header bytes per 256 elements)
BLOCKS = {"Q4_K": (4, 32, False, KQUANT_HEADER["Q4_K"]), "Q5_K": (8, 32, False, KQUANT_HEADER["Q5_K"]),
          "Q6_K": (8, 16, True, KQUANT_HEADER["Q6_K"])}
SUPER_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How one weight is quantized.

    Attributes:
      bits: 8 (int8), 4 (int4, stored packed two per byte) or 5 (GGUF Q5_0's values, group 32,
        symmetric: linear layers only, interleaved by 16 rows; see the module docstring).
      group: elements of the input dim sharing one scale; None: one scale per output channel.
      symmetric: W = q * scale (True) or W = q * scale + min (False).
      scale_dtype: "f32" or "f16" storage of scale and min (GGUF blocks carry f16).
      rounding: how the quantizer picks each group's scale (the stored format is the same):
        "minmax" from the group's extremes (llama.cpp's Q8_0 / Q4_0 / Q4_1 rules), or "mse"
        (int4 symmetric only) the scale, among candidates around the minmax one, whose
        least-squares refit gives the smallest squared error of the group.
      rows: 0, the matrix stored row by row ([out, in | in/2], scales [out, G]), or 16: interleaved
        by 16 rows for the `hloserve.quant_linear` version 2 kernel (primitives.interleave_rows;
        linear layers only, see `for_linear`).
      block: "" (the layouts above), or a GGUF K-quant block type kept as it is ("Q4_K", "Q5_K",
        "Q6_K"; see the module docstring; `bits`, `group` and `symmetric` are then BLOCKS' entry;
        `rows` 16: its quants interleaved, the headers row by row).
    """
    bits: int = 8
    group: int | None = None
    symmetric: bool = True
    scale_dtype: str = "f32"
    rounding: str = "minmax"
    rows: int = 0
    block: str = ""

    @classmethod
    def of_block(cls, block: str) -> "WeightScheme":
        """The scheme of a GGUF K-quant block type kept as it is."""
        if block not in BLOCKS:
            raise QuantizationError(f"block {block!r}: K-quant blocks kept are {sorted(BLOCKS)}")
        bits, group, symmetric, _ = BLOCKS[block]
        return cls(bits, group, symmetric, "f16", block=block)

    def __post_init__(self):
        if self.block:
            if self.block not in BLOCKS or BLOCKS[self.block][:3] != (self.bits, self.group, self.symmetric) \
                    or self.rows not in (0, INTERLEAVE):
                raise QuantizationError(f"block {self.block!r}: use WeightScheme.of_block (blocks kept: {sorted(BLOCKS)})")
            return
        if self.bits not in (4, 5, 8):
            raise QuantizationError(f"bits={self.bits} is not supported; use 8 (int8) or 4 (int4)")
        if self.bits == 5 and (self.group != FIVE_BIT_GROUP or not self.symmetric):
            raise QuantizationError(f"bits=5 is GGUF Q5_0's layout: group {FIVE_BIT_GROUP}, symmetric "
                                    f"(got group {self.group}, symmetric {self.symmetric})")
        if self.group is not None and (self.group < 2 or self.group % 2):
            raise QuantizationError(f"group={self.group} must be an even number >= 2 (e.g. 32, 64, 128)")
        if self.bits == 4 and self.group is None:
            raise QuantizationError("int4 needs a group size (per-channel int4 collapses small LLMs); e.g. int4:32")
        if self.bits == 8 and not self.symmetric:
            raise QuantizationError("asymmetric int8 is not supported (q would not fit int8); use int8 or int4:GROUP (asymmetric)")
        if self.scale_dtype not in SCALE_DTYPES:
            raise QuantizationError(f"scale_dtype {self.scale_dtype!r}: use one of {SCALE_DTYPES}")
        if self.rounding not in ROUNDINGS:
            raise QuantizationError(f"rounding {self.rounding!r}: use one of {ROUNDINGS}")
        if self.rounding == "mse" and not (self.bits == 4 and self.symmetric):
            raise QuantizationError("rounding 'mse' is implemented for int4 symmetric only; use minmax")
        if self.rows not in (0, INTERLEAVE):
            raise QuantizationError(f"rows={self.rows}: stored matrices are row by row (0) or interleaved by {INTERLEAVE}")

    def for_linear(self, shape: tuple[int, ...]) -> "WeightScheme":
        """This scheme for a linear layer's weight [..., out, in]: interleaved by 16 rows (the
        quant_linear version 2 kernel) where out is a multiple of 16 and each group (or the row)
        whole 32-element blocks; else row by row."""
        *_, n_out, n_in = shape
        if self.block:   # K-quants: the quants interleaved by 16 rows (version 5) where the rows allow
            return dataclasses.replace(self, rows=INTERLEAVE if n_out % INTERLEAVE == 0 else 0)
        whole = (self.group or n_in) % 32 == 0
        rows = INTERLEAVE if n_out % INTERLEAVE == 0 and whole else 0
        if self.bits == 5 and not rows:   # 5-bit values row by row are int8's layout: stored as int8
            return dataclasses.replace(self, bits=8)
        return dataclasses.replace(self, rows=rows)

    def row_by_row(self) -> "WeightScheme":
        """This scheme for a weight stored row by row (an embedding table): 5-bit values become int8
        (the same bytes, see the module docstring); the others are unchanged."""
        return dataclasses.replace(self, bits=8, rows=0) if self.bits == 5 else self

    @property
    def name(self) -> str:
        return self.block or f"int{self.bits}"

    def describe(self) -> str:
        if self.block:
            return self.block
        parts = [self.name] + ([str(self.group)] if self.group else [])
        if not self.symmetric:
            parts.append("asym")
        elif self.bits == 4 and self.rounding != "mse":
            parts.append(f"sym:{self.rounding}")   # int4 symmetric defaults to mse
        return ":".join(parts)

    def fitted(self, n_in: int) -> "WeightScheme":
        """This scheme for an input dim of n_in: a group that does not divide n_in is replaced by
        the largest power of two that does and is smaller (576 with group 128 -> 64). The
        manifest records the group each weight actually uses."""
        if self.block or not self.group or n_in % self.group == 0:
            return self
        g = self.group
        while g > 2 and n_in % g:
            g //= 2
        return dataclasses.replace(self, group=g) if n_in % g == 0 and g >= 8 else self

    def check_shape(self, shape: tuple[int, ...], where: str) -> None:
        """Raise unless a float weight of `shape` can be stored in this scheme."""
        if len(shape) < 2:
            raise QuantizationError(f"{where}: shape {list(shape)} has no [out, in] dims to quantize")
        n_in = shape[-1]
        if self.block and n_in % SUPER_BLOCK:
            raise QuantizationError(f"{where}: input dim {n_in} is not a multiple of {SUPER_BLOCK} ({self.block} super-blocks)")
        if self.group and n_in % self.group:
            raise QuantizationError(f"{where}: input dim {n_in} is not a multiple of group {self.group}; "
                                    f"use a group dividing {n_in} or skip this module")
        if self.bits == 4 and n_in % 2:
            raise QuantizationError(f"{where}: input dim {n_in} is odd; int4 packs two values per byte")

    def stored_width(self, width: int) -> int:
        """The float input dim of a row-by-row qweight's last dim (int4 packs two per byte)."""
        return 2 * width if self.bits == 4 else width

    def stored_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """role -> shape of the stored tensors of a float weight of `shape`."""
        *lead, n_in = shape
        q = (*lead, n_in // 2) if self.bits == 4 else tuple(shape)
        if self.block:
            heads = (*lead, n_in // SUPER_BLOCK * BLOCKS[self.block][3])
            if self.rows:
                *outer, n_out = lead
                q = (*outer, n_out // INTERLEAVE, INTERLEAVE * q[-1])
            return {"qweight": q, "scale": heads}
        s = (*lead, n_in // self.group) if self.group else tuple(lead)
        if self.rows:
            *lead, n_out = lead
            width = FIVE_BIT_BYTES * n_in // FIVE_BIT_GROUP if self.bits == 5 else q[-1] * INTERLEAVE
            q, s = (*lead, n_out // INTERLEAVE, width), (*lead, n_out // INTERLEAVE, n_in // (self.group or n_in), INTERLEAVE)
        out = {"qweight": q, "scale": s}
        if not self.symmetric:
            out["min"] = s
        return out

    def to_json(self) -> dict[str, Any]:
        d = {"scheme": self.name, "group": self.group, "symmetric": self.symmetric,
             "scale_dtype": self.scale_dtype, "rounding": self.rounding}
        if self.block:
            d = {**d, "block": self.block}
        return {**d, "rows": self.rows} if self.rows else d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "WeightScheme":
        if d.get("block"):
            return dataclasses.replace(cls.of_block(str(d["block"])), rows=int(d.get("rows", 0)))
        return cls(int(str(d["scheme"]).removeprefix("int")), d.get("group"), bool(d.get("symmetric", True)),
                   d.get("scale_dtype", "f32"), d.get("rounding", "minmax"), int(d.get("rows", 0)))

    def manifest_entry(self, role: str, of: str, shape: tuple[int, ...]) -> dict[str, Any]:
        """WeightSpec.quant of one stored tensor: the scheme, its role, and the float weight it encodes."""
        return {**self.to_json(), "role": role, "of": of, "shape": list(shape)}


INT8 = WeightScheme(8, None, True, "f32")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What to quantize and how: parsed once from `--quantize` (see `parse`).

    Attributes:
      scheme: the scheme of every quantized weight.
      skip: fnmatch patterns of module / weight names left in float (e.g. "*embed*", "lm_head").
      spec: the user's spelling, for messages and the manifest.
      native: keep a GGUF file's own blocks (Q8_0 -> int8 g32, Q5_0 -> int5 g32 in linear layers whose
        every layer is Q5_0, else int8 g32, Q4_0 -> int4 g32, Q4_1 -> int4 g32
        asym; Q4_K / Q5_K / Q6_K linears kept as K-quant blocks, embeddings converted) instead of requantizing;
        `scheme` then applies to tensors of other ggml types.
    """
    scheme: WeightScheme
    skip: tuple[str, ...] = ()
    spec: str = ""
    native: bool = False

    def skipped(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.skip)

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec, **self.scheme.to_json(), "skip": list(self.skip), "native": self.native}

    @classmethod
    def parse(cls, spec: str, skip: tuple[str, ...] | list[str] = ()) -> "QuantConfig":
        """`int8[:GROUP|:channel]`, `int4[:GROUP[:asym|sym[:mse|minmax]]]` or `gguf` (the file's own blocks).

        int8 defaults to group 32 with f16 scales (llama.cpp's Q8_0 layout: with the int8
        activations of the quantized linear kernel, SmolLM2-135M +0.5% perplexity against +1.3% for
        one f32 scale per output channel, `int8:channel`); int4 to group 32, asymmetric (a min
        per group: Q4_1's layout), f16 scales. `sym` stores no min; its scales are searched for
        the least squared error (`mse`) unless `minmax` (llama.cpp's Q4_0 rule) is asked for.
        int4 without a group is refused: channel-wise int4 collapses small LLMs. Asymmetric is the
        default because it is the scheme that keeps quality on small models (SmolLM2-135M:
        +7% perplexity at g32 against +41% symmetric; docs/quantization.md) for 0.5 bit more a weight.
        """
        usage = ("use int8[:GROUP|:channel], int4[:GROUP[:asym|sym[:mse|minmax]]] (GROUP 32, 64, 128, ...) or gguf "
                 "(keep a GGUF file's own blocks: Q8_0/Q5_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K)")
        parts = [p.strip().lower() for p in spec.split(":")]
        kind = parts[0]
        if kind == "gguf" and len(parts) == 1:
            return cls(WeightScheme(8, 32, True, "f16"), tuple(skip), spec, native=True)
        if kind not in ("int8", "int4") or len(parts) > 4:
            raise QuantizationError(f"--quantize {spec!r} is not a quantization spec; {usage}")
        bits = int(kind[3:])
        group: int | None = 32
        symmetric = bits == 8
        if bits == 8 and len(parts) == 2 and parts[1] == "channel":
            group = None
        elif len(parts) >= 2 and parts[1]:
            if not parts[1].isdigit():
                raise QuantizationError(f"--quantize {spec!r}: group {parts[1]!r} is not a number; {usage}")
            group = int(parts[1])
        if len(parts) >= 3:
            if parts[2] not in ("asym", "sym"):
                raise QuantizationError(f"--quantize {spec!r}: {parts[2]!r} must be asym or sym; {usage}")
            symmetric = parts[2] == "sym"
        rounding = "mse" if bits == 4 and symmetric else "minmax"
        if len(parts) == 4:
            if parts[3] not in ROUNDINGS or not (bits == 4 and symmetric):
                raise QuantizationError(f"--quantize {spec!r}: {parts[3]!r} must be mse or minmax, after int4 sym; "
                                        f"{usage}")
            rounding = parts[3]
        scale_dtype = "f16" if group else "f32"
        return cls(WeightScheme(bits, group, symmetric, scale_dtype, rounding), tuple(skip), spec)
