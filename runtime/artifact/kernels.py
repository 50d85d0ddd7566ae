"""Composites: named pieces of an artifact's StableHLO that a runtime may run with its own kernel.

An exported function may contain `stablehlo.composite` ops. Each carries a name, a version, its
attributes and a decomposition: a private function computing the same thing in plain StableHLO.
Every platform can run the decomposition (XLA inlines it); a runtime that has a kernel for the
composite's name and version may call that instead (see runtime/kernels/: C++ on CPU, Pallas on
TPU and GPU). So the artifact stays portable: nothing platform-specific is in it.

The contracts below are what a kernel must compute; the decomposition is the reference.
"""
from __future__ import annotations

import dataclasses
import enum

import numpy as np

from . import dtypes


class Holds(enum.IntEnum):
    """What the elements of a cache or weight stack are: the composites' `holds` attribute, also the
    C++ kernels' `Kind` (runtime/kernels/cpu/common.h; a test checks the two agree). 16-bit floats
    may be stored as their bits in an int16 buffer (an LLM step's KVCacheSpec.holds names them).
    INT8_ROWS, INT8_ZP_ROWS and FP8_E4M3_ROWS are quantized KV caches (KVCacheSpec.quant "int8",
    "int8_zp", "fp8_e4m3"): paged attention only."""
    OWN = 0     # the buffer's own dtype (f32)
    BF16 = 1    # bfloat16
    F16 = 2     # float16
    INT8_ROWS = 3   # int8 rows of head_dim + 2 bytes: the values, then the row's bf16 scale (INT8_ROW)
    INT8_ZP_ROWS = 4   # int8 rows of head_dim + 3 bytes: the values, the row's bf16 scale, its zero point (INT8_ZP_ROW)
    FP8_E4M3_ROWS = 5  # rows of head_dim fp8 e4m3 bytes, then the row's bf16 scale (FP8_E4M3_ROW)

    @property
    def row_extra(self) -> int:
        """Bytes a cache row holds past its head_dim elements (an int8 or fp8 row's scale, and zero point)."""
        return _ROW_EXTRA.get(self, 0)

    @property
    def dtype_name(self) -> str | None:
        """The float type held, as numpy/jax/torch name it ("bfloat16", "float16"); None for OWN.
        Every `holds` -> dtype table derives from this (jnp.dtype(h.dtype_name), getattr(torch, ...))."""
        return _DTYPE_NAMES[self]

    @classmethod
    def named(cls, name: str | None) -> "Holds":
        """The code of a manifest dtype name ("bf16", "f16"; None: the buffer's own dtype)."""
        return cls.OWN if name is None else cls.of_dtype(dtypes.NUMPY[name].name)

    @classmethod
    def of_dtype(cls, dtype_name: str) -> "Holds":
        """The code for an array of `dtype_name` ("bfloat16", "torch.float16", ...): OWN unless a 16-bit float."""
        return next((h for h, n in _DTYPE_NAMES.items() if n == dtype_name.removeprefix("torch.")), cls.OWN)


class Block(enum.IntEnum):
    """A GGUF K-quant block type kept as it is: the quant_linear version 3 composite's `kind`
    attribute, ggml's own type ids (also the C++ kernel's `Block`, runtime/kernels/cpu/quant_linear.cc)."""
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


_DTYPE_NAMES = {Holds.OWN: None, Holds.BF16: "bfloat16", Holds.F16: "float16", Holds.INT8_ROWS: None,
                Holds.INT8_ZP_ROWS: None, Holds.FP8_E4M3_ROWS: None}

# An int8 KV cache row (Holds.INT8_ROWS): one token's K or V of one KV head, head_dim int8 values q
# then the bf16 bits of its scale s (little-endian, 2 bytes); the values are q * s, where
# s = bf16(max|x| / 127) and q = clip(round_half_even(x / s), -127, 127) (0 where s = 0).
INT8_ROW = "head_dim int8 values then the row's bf16 scale (2 bytes, little-endian): x = q * scale, per token and KV head"
INT8_ROW_SCALE_BYTES = 2
# An int8 KV cache row with a zero point (Holds.INT8_ZP_ROWS, --kv-cache-dtype int8 since 2026-11-28):
# head_dim int8 values q, the bf16 bits of the scale s (2 bytes, little-endian), then the zero point
# z (int8); the values are (q - z) * s. Asymmetric: the row's range [lo, hi] = [min(x, 0), max(x, 0)]
# spans the 256 codes, s = bf16((hi - lo) / 255), z = clip(round(-lo / s), 0, 255) - 128 and
# q = clip(round_half_even(x / s) + z, -128, 127) (s = 1 where hi = lo, i.e. an all-zero row).
INT8_ZP_ROW = ("head_dim int8 values, the row's bf16 scale (2 bytes, little-endian), then its int8 zero point: "
               "x = (q - zero) * scale, per token and KV head")
INT8_ZP_ROW_EXTRA = 3
# An fp8 KV cache row (Holds.FP8_E4M3_ROWS, --kv-cache-dtype fp8_e4m3 since 2026-11-29): head_dim bytes,
# each the bits of an OCP float8 e4m3fn value f (1 sign, 4 exponent bits of bias 7, 3 mantissa bits;
# no infinities, 0x7F / 0xFF NaN, never written), then the bf16 bits of the row's scale s (2 bytes,
# little-endian); the values are f * s, where s = bf16(max|x| / 448) (448: e4m3's largest value) and
# f = e4m3(clip(x / s, -448, 448)), rounded to nearest even (s = 1 where the row is all zero).
FP8_E4M3_ROW = ("head_dim float8 e4m3fn values (their bits), then the row's bf16 scale (2 bytes, little-endian): "
                "x = f * scale, per token and KV head")
FP8_E4M3_MAX = 448.0
_ROW_EXTRA = {Holds.INT8_ROWS: INT8_ROW_SCALE_BYTES, Holds.INT8_ZP_ROWS: INT8_ZP_ROW_EXTRA,
              Holds.FP8_E4M3_ROWS: INT8_ROW_SCALE_BYTES}


@dataclasses.dataclass(frozen=True)
class Composite:
    """One composite's contract.

    name / version: as in the stablehlo.composite op; a kernel serves one (name, version).
    operands / attributes / result: the contract, in words (shapes with named dims).
    """
    name: str
    version: int
    operands: tuple[str, ...]
    attributes: tuple[str, ...]
    result: str

    @property
    def key(self) -> tuple[str, int]:
        """(name, version): what a kernel table's row is keyed by."""
        return self.name, self.version


# Attention of each token over its own sequence's paged context (the LLM step's decode layout).
PAGED_ATTENTION = Composite(
    name="hloserve.paged_attention",
    version=1,
    operands=(
        "q f32[T, KV, G, D]: rotated queries, G query heads per KV head",
        "kv_cache [L, 2, KV, N, BS, D]: f32, or 16-bit float (bits in s16 when `holds` says so); "
        "or s8 [L, 2, KV, N, BS, D + 2] when `holds` is 3 (INT8_ROW: D int8 values, then the row's bf16 scale), "
        "or s8 [L, 2, KV, N, BS, D + 3] when `holds` is 4 (INT8_ZP_ROW: then also the row's int8 zero point), "
        "or s8 [L, 2, KV, N, BS, D + 2] when `holds` is 5 (FP8_E4M3_ROW: D float8 e4m3fn bytes, then the row's "
        "bf16 scale)",
        "layer s32[]: the layer whose K (index 0) and V (index 1) are read",
        "block_tables s32[S, B]", "seq_ids s32[T]", "positions s32[T]", "context_lens s32[S]",
    ),
    attributes=(
        "window i64: attend to positions > position - window (0: no window)",
        "holds i64: what the cache elements are (Holds): 0 its own dtype (f32), 1 bfloat16, 2 float16, "
        "3 int8 rows with a bf16 scale each (read as q * scale), 4 int8 rows with a bf16 scale and an int8 "
        "zero point each (read as (q - zero) * scale), 5 float8 e4m3fn rows with a bf16 scale each (read as "
        "f * scale)",
        "scale f32: the scores' factor (1/sqrt(D) for most models)",
        "softcap f32: scores become softcap * tanh(scores / softcap) (0: no capping)",
    ),
    result="f32[T, KV, G, D]: softmax(softcap(scale q k^T)) v over the positions c of the token's sequence "
           "(block_tables row seq_ids[t]) with c <= positions[t] and c < context_lens[seq]; a token that "
           "sees no position (padding) gets unspecified finite values",
)

# One layer's matrix product, read where the layer lies in a stack of 16-bit weight matrices.
LAYER_LINEAR = Composite(
    name="hloserve.layer_linear",
    version=1,
    operands=(
        "x f32[M, K]: activations",
        "weights [L, N, K]: 16-bit floats, or their bits in s16 (`holds` says which floats)",
        "layer s32[]: the matrix used",
    ),
    attributes=("holds i64: what the weights are (Holds): 1 bfloat16, 2 float16",),
    result="f32[M, N]: x rounded to the weights' dtype (to nearest even) times weights[layer] transposed; "
           "the products are exact in f32 and summed in f32 (in any order)",
)

X_BLOCK = 32   # the quant composites' activations are quantized per block of this many elements of a row


def quantize_blocks(x, xp, barrier=None):
    """The quant composites' activation rule (llama.cpp's Q8_0): x f32 [M, K] quantized to int8 per
    block of X_BLOCK elements (d = max|x| / 127, round half to even, 0 where d = 0; a last shorter
    block zero-padded) and multiplied back, over the array library `xp` (jax.numpy: the
    decomposition's and the Pallas kernels' operand; the torch twin is quantization.modules').

    Both divisions are IEEE divisions, as the kernels' and torch's are. XLA's simplifier turns a
    division by a broadcast value into a multiply by its reciprocal, which can be an ulp off the
    quotient, and round(x / d) then takes the other side of a tie (a step's logits moved by 0.1 where
    the kernels and torch agreed): under jax pass `barrier=jax.lax.optimization_barrier`, and each
    divisor goes behind it at the dividend's shape, where the simplifier cannot see it."""
    def divide(a, b):
        return a / (b if barrier is None else barrier(xp.broadcast_to(b, a.shape)))

    m, k = x.shape
    xb = xp.pad(x, ((0, 0), (0, -k % X_BLOCK))).reshape(m, -1, X_BLOCK)     # [M, B, 32]
    d = divide(xp.max(xp.abs(xb), axis=-1, keepdims=True), xp.float32(127))
    q = xp.where(d > 0, xp.round(divide(xb, xp.where(d > 0, d, 1))), 0)    # round half to even
    return (q * d).reshape(m, -1)[:, :k]                                  # [M, K]


# bytes of one K-quant super-block's header (QUANT_LINEAR_V3's `blocks`), by block type
KQUANT_HEADER = {"Q4_K": 16, "Q5_K": 16, "Q6_K": 18}


def _f16_at(h, at: int, xp):
    """The float16 at byte `at` of each header h uint8 [..., nb, bytes], as float32 [..., nb]."""
    bits = h[..., at].astype(xp.uint16) | (h[..., at + 1].astype(xp.uint16) << 8)
    return bits.view(xp.float16).astype(xp.float32)


def block_scales(blocks, block: str, xp=np):
    """A K-quant weight's headers (QUANT_LINEAR_V3's `blocks`, uint8 [..., N, nb * KQUANT_HEADER[block]]) -> per
    sub-block scale d * sc and min -(dmin * m), float32 [..., N, nb * 8] (Q6_K: scale [..., N, nb * 16],
    min None); exact in float32 (an f16 times an integer below 2^8). Q4_K / Q5_K headers are
    [d f16 | dmin f16 | 12 bytes]: bytes 0-3 of the 12 hold sc 0-3 in their low 6 bits, bytes 4-7
    m 0-3; sub-block 4 + i takes its low 4 bits from byte 8 + i (sc low nibble, m high nibble) and
    its top 2 bits from the top 2 bits of byte i (sc) or 4 + i (m). Q6_K headers are [16 int8 sc | d
    f16]. Written once for numpy and jax.numpy (`xp`, default numpy): the composite's decomposition
    and the Pallas kernels trace it, the torch op and the tests run it with numpy."""
    *lead, width = blocks.shape
    head = KQUANT_HEADER[block]
    h = blocks.reshape(*lead, width // head, head)                      # [..., N, nb, head]
    if block == "Q6_K":
        scale = _f16_at(h, 16, xp)[..., None] * h[..., :16].view(xp.int8).astype(xp.float32)
        return scale.reshape(*lead, -1), None                            # [..., N, nb * 16]
    lo_sc, lo_m, mix = h[..., 4:8], h[..., 8:12], h[..., 12:16]
    sc = xp.concatenate([lo_sc & 0x3F, (mix & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)   # [..., N, nb, 8]
    m = xp.concatenate([lo_m & 0x3F, (mix >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    scale = _f16_at(h, 0, xp)[..., None] * sc.astype(xp.float32)
    mn = -(_f16_at(h, 2, xp)[..., None] * m.astype(xp.float32))
    return scale.reshape(*lead, -1), mn.reshape(*lead, -1)              # [..., N, nb * 8]


# One layer's matrix product with weight-only quantized matrices, dequantized where they are read
# (quantization/schemes.py defines the stored layout; GGUF Q8_0 / Q4_0 / Q4_1 blocks are stored in
# it as they are in the file).
QUANT_LINEAR = Composite(
    name="hloserve.quant_linear",
    version=1,
    operands=(
        "x f32[M, K]: activations",
        "qweight [L, N, K] s8 (bits 8), or [L, N, K/2] u8 (bits 4: element 2k in the low nibble, 2k+1 in "
        "the high one; two's complement when there is no min, unsigned [0, 15] when there is)",
        "scale [L, N, K/group]: f16 or f32",
        "min [L, N, K/group] like scale (asymmetric), or f32[0] (symmetric: no min)",
        "layer s32[]: the matrix used",
    ),
    attributes=("bits i64: 8 or 4", "group i64: elements of a row sharing one scale (K: one per row)"),
    result="f32[M, N]: x8 times W[layer] transposed, where W = q * scale + min per group (scale and min "
           "widened to f32) and x8 is x quantized per block of 32 elements of a row as llama.cpp's Q8_0 does: "
           "d = max|x| / 127, x8 = round_half_even(x / d) * d (0 where d = 0), a last shorter block zero-padded; "
           "computed in f32 in any association (the integer products are exact)",
)

# Version 2: the same product with each layer's matrix interleaved by 16 rows, so that one 64-byte
# read holds 4 (int8) or 8 (int4) consecutive elements of 16 rows (docs/quantization.md, "Version 2").
QUANT_LINEAR_V2 = Composite(
    name="hloserve.quant_linear",
    version=2,
    operands=(
        "x f32[M, K]: activations",
        "qweight [L, N/16, 16 K] s8 (bits 8: element (n, k) of a layer at (n // 16, 64 (k // 4) + 4 (n % 16) + k % 4)), "
        "or [L, N/16, 8 K] u8 (bits 4: element (n, k) in byte (n // 16, 64 (k // 8) + 4 (n % 16) + k % 4), its low "
        "nibble when k % 8 < 4, else its high one; two's complement when there is no min, unsigned when there is)",
        "scale [L, N/16, K/group, 16]: f16 or f32, row n's scale for group g at (n // 16, g, n % 16)",
        "min like scale (asymmetric), or f32[0] (symmetric: no min)",
        "layer s32[]: the matrix used",
    ),
    attributes=QUANT_LINEAR.attributes,
    result=QUANT_LINEAR.result,
)

# Version 6: version 2's operands and layout, but a call of `bf16_rows` rows or more (a prompt chunk)
# rounds x and the dequantized W to bfloat16 and multiplies those: a tile unit's 16-bit operands with
# f32 sums (AMX-BF16, an MXU, tensor cores), where version 2's 32-element int8 blocks of x need a
# rescale per block. What a call computes depends on its row count, so a batch-invariant export keeps
# version 2 (docs/quantization.md "Prompt chunks in bf16"). bf16_rows is where the export asks for the
# bf16 product; a platform whose version 2 product is the faster at every row count may raise it (the
# CPUs without AMX: VNNI's int8 products are twice bf16's per instruction; runtime/kernels/cpu/targets.py),
# so a chunk's result, like every kernel's rounding, depends on the platform.
QUANT_LINEAR_V6 = Composite(
    name="hloserve.quant_linear",
    version=6,
    operands=QUANT_LINEAR_V2.operands,
    attributes=(*QUANT_LINEAR.attributes,
                "bf16_rows i64: from this many rows of x (M >= bf16_rows) the bf16 product below is computed "
                "(a platform may raise it)"),
    result="f32[M, N]: for M < bf16_rows, version 2's result; for M >= bf16_rows, r(x) times r(W[layer]) transposed, "
           "where W = q * scale + min per group (scale and min widened to f32, computed in f32) and r rounds to "
           "bfloat16 (to nearest even); the products are exact in f32 and summed in f32 (in any order)",
)
QUANT_BF16_ROWS = 64   # the exporter's bf16_rows: chunks of 64 rows and more (docs/quantization.md says why)

# Version 4: the same product with 5-bit values (GGUF Q5_0 blocks kept: q in [-16, 15], the file's f16 d
# as the scale of each 32 elements), interleaved by 16 rows as version 2's int4, the fifth bits beside
# each block's nibbles (quantization/schemes.py; docs/quantization.md "Q5_0 kept").
QUANT_LINEAR_V4 = Composite(
    name="hloserve.quant_linear",
    version=4,
    operands=(
        "x f32[M, K]: activations (K a multiple of 32)",
        "qweight [L, N/16, 10 K] u8: per 32-element block b of 16 rows (320 bytes at (n // 16, 320 b)), the "
        "codes u = q + 16 in [0, 31]: 256 bytes of low nibbles as version 2's int4 (element (n, k) in byte "
        "64 (k // 8 % 4) + 4 (n % 16) + k % 4 of the block, its low nibble when k % 8 < 4, else its high one), "
        "then 64 bytes of fifth bits, 16 per k-step s = k // 8 % 4 at 256 + 16 s: two little-endian 64-bit "
        "masks, bit 4 (n % 16) + k % 4 of the first (k % 8 < 4) or the second (else)",
        "scale [L, N/16, K/32, 16]: f16 or f32, row n's scale for block b at (n // 16, b, n % 16)",
        "min f32[0]: none (symmetric)",
        "layer s32[]: the matrix used",
    ),
    attributes=("bits i64: 5", "group i64: 32"),
    result="f32[M, N]: x8 (as version 1) times W[layer] transposed, where W = (u - 16) * scale per block of 32 "
           "(the scale widened to f32); computed in f32 in any association (the integer products are exact)",
)

# Version 3: the same product with each layer's matrix in a GGUF K-quant's super-blocks of 256, kept
# as the file has them (quantization/schemes.py "K-quant blocks"; docs/quantization.md).
QUANT_LINEAR_V3 = Composite(
    name="hloserve.quant_linear",
    version=3,
    operands=(
        "x f32[M, K]: activations (K a multiple of 256)",
        "qweight [L, N, K/2] u8 (Q4_K: element 2k in the low nibble, 2k+1 in the high one, unsigned [0, 15]), "
        "or [L, N, K] s8 (Q5_K: [0, 31]; Q6_K: [-32, 31])",
        "blocks [L, N, K/256 * H] u8: each super-block's header as the file stores it; Q4_K / Q5_K (H 16): "
        "[d f16 | dmin f16 | 12 bytes: 6-bit sc_j, m_j of 8 sub-blocks of 32, ggml's packing], Q6_K (H 18): "
        "[16 s8 sc_j of sub-blocks of 16 | d f16]",
        "layer s32[]: the matrix used",
    ),
    attributes=("kind i64: the block type (Block): 12 Q4_K, 13 Q5_K, 14 Q6_K",),
    result="f32[M, N]: x8 (as version 1) times W[layer] transposed, where W = q * (d * sc_j) - dmin * m_j per "
           "sub-block j (Q6_K: no min), each product of an f16 and an integer exact in f32; computed in f32 "
           "in any association",
)

# Version 5: version 3's K-quant matrices with their quants interleaved by 16 rows as version 2's (Q4_K
# as its int4 nibbles, Q5_K / Q6_K as its int8 bytes), the headers row by row as version 3's: what
# version 3's kernel copied per call, done at export (quantization/schemes.py; docs/quantization.md).
QUANT_LINEAR_V5 = Composite(
    name="hloserve.quant_linear",
    version=5,
    operands=(
        "x f32[M, K]: activations (K a multiple of 256)",
        "qweight [L, N/16, 8 K] u8 (Q4_K: element (n, k) in byte (n // 16, 64 (k // 8) + 4 (n % 16) + k % 4), its "
        "low nibble when k % 8 < 4, else its high one, unsigned [0, 15]), or [L, N/16, 16 K] s8 (Q5_K: [0, 31]; "
        "Q6_K: [-32, 31]; element (n, k) at (n // 16, 64 (k // 4) + 4 (n % 16) + k % 4))",
        "blocks [L, N, K/256 * H] u8: as version 3",
        "layer s32[]: the matrix used",
    ),
    attributes=QUANT_LINEAR_V3.attributes,
    result=QUANT_LINEAR_V3.result,
)

# Version 2 of paged attention: the window is an operand, so layers that differ only in their
# window (Gemma's sliding and global layers) are one scanned body, each layer's window a row of the
# scan's per-layer data. Version 1 stays for everything else (and the artifacts that have it).
PAGED_ATTENTION_V2 = Composite(
    name=PAGED_ATTENTION.name,
    version=2,
    operands=(*PAGED_ATTENTION.operands,
              "window s32[]: attend to positions > position - window (0 or less: no window)"),
    attributes=PAGED_ATTENTION.attributes[1:],
    result=PAGED_ATTENTION.result + "; with a window w > 0 also c > positions[t] - w",
)

# A mixture-of-experts layer's experts over 16-bit matrix stacks: each token's chosen experts' gated
# MLPs, weighted. The decomposition multiplies every row by each expert a token chose; a kernel may
# group the (token, slot) pairs by expert and read each expert's matrices once for its rows.
GROUPED_EXPERTS = Composite(
    name="hloserve.grouped_experts",
    version=1,
    operands=(
        "x f32[T, D]: activations",
        "index s32[T, k]: each token's experts, in [0, E)",
        "weights f32[T, k]: each token's routing weights",
        "gate_up [L, E, 2F, D]: 16-bit floats, or their bits in s16: rows [0, F) the gate, [F, 2F) the up projection",
        "down [L, E, D, F]: like gate_up",
        "layer s32[]: the layer whose experts are used",
    ),
    attributes=("holds i64: what the matrices are (Holds): 1 bfloat16, 2 float16",),
    result="f32[T, D]: sum over j of weights[t, j] * down[layer, e] . r(silu(g) * u), [g; u] = gate_up[layer, e] . "
           "r(x[t]), e = index[t, j], where r rounds to the matrices' dtype (to nearest even) and silu(g) = g "
           "sigmoid(g) in f32; products exact in f32, summed in f32 in any order",
)

# The same layer over int8 / int4 stacks (quantization/schemes.py's row-by-row layout): each product
# is QUANT_LINEAR's (the rows quantized per 32-element block as Q8_0, W = q * scale (+ min)).
QUANT_EXPERTS = Composite(
    name="hloserve.quant_experts",
    version=1,
    operands=(
        "x f32[T, D]: activations",
        "index s32[T, k]: each token's experts, in [0, E)",
        "weights f32[T, k]: each token's routing weights",
        "gate_up [L, E, 2F, D] s8 (bits 8) or [L, E, 2F, D/2] u8 (bits 4, two per byte, element 2j in the low "
        "nibble; signed without mins, unsigned with): rows [0, F) the gate, [F, 2F) the up projection",
        "gate_up_scale f16 or f32 [L, E, 2F, D / gate_up_group]",
        "gate_up_min like gate_up_scale (asymmetric int4), or f32[0]",
        "down [L, E, D, F] s8 or [L, E, D, F/2] u8, like gate_up",
        "down_scale f16 or f32 [L, E, D, F / down_group]",
        "down_min like down_scale, or f32[0]",
        "layer s32[]: the layer whose experts are used",
    ),
    attributes=("bits i64: 8 or 4", "gate_up_group i64: elements of a gate_up row per scale",
                "down_group i64: elements of a down row per scale"),
    result="f32[T, D]: sum over j of weights[t, j] * P(down[layer, e], silu(g) * u), [g; u] = P(gate_up[layer, e], "
           "x[t]), e = index[t, j], where P(W, v) is QUANT_LINEAR's product (v quantized per block of 32 as "
           "Q8_0, W = q * scale (+ min) per group) and silu(g) = g sigmoid(g) in f32; sums in f32 in any order",
)

# a*b + c*d with both products rounded before the sum: a rotary embedding's q*cos + rotate(q)*sin,
# computed with the same bits whatever the step's shape (exporter/composites/product_sum.py says why)
PRODUCT_SUM = Composite(
    name="hloserve.product_sum",
    version=1,
    operands=("a f32[N]", "b f32[N]", "c f32[N]", "d f32[N]"),
    attributes=(),
    result="f32[N]: f32(a*b) + f32(c*d) elementwise, each product rounded to f32 before the sum (never a "
           "fused multiply-add)",
)

# each row's sum in an order that does not depend on the number of rows: a norm's mean of squares,
# computed with the same bits whatever the step's shape (exporter/composites/row_sum.py says why)
ROW_SUM = Composite(
    name="hloserve.row_sum",
    version=1,
    operands=("x f32[R, N]",),
    attributes=(),
    result="f32[R]: the sum of each row in f32; a kernel sums a row in one order whatever R is",
)

# (name, version) -> contract
COMPOSITES = {(c.name, c.version): c for c in (PAGED_ATTENTION, PAGED_ATTENTION_V2, LAYER_LINEAR, QUANT_LINEAR,
                                                 QUANT_LINEAR_V2, QUANT_LINEAR_V3, QUANT_LINEAR_V4, QUANT_LINEAR_V5,
                                                 QUANT_LINEAR_V6, GROUPED_EXPERTS,
                                                 QUANT_EXPERTS, PRODUCT_SUM, ROW_SUM)}
