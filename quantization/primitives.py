"""Reference quantize / dequantize / pack functions in NumPy (schemes.py defines the layout).

These are the definition the in-graph lowering (exporter/composites/quant_linear.py) and the
tests are checked against. Quantization rules:

  * int8 symmetric:   scale = amax / 127, q = clip(round(w / scale), -127, 127)
  * int4 symmetric:   llama.cpp's Q4_0 rule: m = the signed value of largest magnitude,
                      scale = m / -8, q = clip(round(w / scale), -8, 7) (16 levels, m -> -8)
  * asymmetric:       scale = (max - min) / (2^bits - 1), q = clip(round((w - min) / scale), 0, 2^bits - 1)
  * int4 symmetric, rounding "mse": for each candidate divisor d in 6, 6.25, ..., 9 (8 is the
                      rule above), q_d = clip(round(w / (m / -d)), -8, 7) and the least-squares
                      scale s_d = sum(w q_d) / sum(q_d^2), rounded to its storage dtype; the group
                      keeps the (q_d, s_d) of least sum((w - s_d q_d)^2). It trades clipping the
                      extreme for finer steps in the bulk of the group.

per group of `group` input elements (or per output row). Scales (and mins) are rounded to
their storage dtype FIRST and q is computed against the rounded values, so what is stored is
what the quantizer chose. Rounding goes outward (scale magnitudes up, mins down), so the
group's extremes still fit the integer range: nothing is clipped by the f16 rounding and the
error stays within scale / 2 (int4 symmetric: the +8 side clips to 7, within one scale).
An all-zero group gets scale 0 (q = 0).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hloserve.runtime.artifact.kernels import block_scales   # the K-quant headers, as the contract decodes them

from .schemes import FIVE_BIT_BYTES, FIVE_BIT_GROUP, INTERLEAVE, QuantizationError, WeightScheme

_NP_SCALE = {"f32": np.float32, "f16": np.float16}


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """One quantized weight as stored: qweight (int8 or packed uint8), scale, min (or None)."""
    qweight: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None
    scheme: WeightScheme
    shape: tuple[int, ...]

    def tensors(self) -> dict[str, np.ndarray]:
        out = {"qweight": self.qweight, "scale": self.scale}
        if self.min is not None:
            out["min"] = self.min
        return out

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.tensors().values())


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int values in [-8, 7] or [0, 15], [..., n] (n even) -> uint8 [..., n // 2]; 2k low nibble, 2k+1 high."""
    q = np.asarray(q)
    if q.shape[-1] % 2:
        raise QuantizationError(f"pack_int4: last dim {q.shape[-1]} is odd")
    if q.size and (q.min() < -8 or q.max() > 15):
        raise QuantizationError(f"pack_int4: values in [{q.min()}, {q.max()}] do not fit 4 bits")
    nib = (q.astype(np.int16) & 0xF).astype(np.uint8)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, *, signed: bool) -> np.ndarray:
    """uint8 [..., m] -> int8 [..., 2m]: signed two's complement nibbles ([-8, 7]) or unsigned ([0, 15])."""
    p = np.asarray(packed, dtype=np.uint8)
    lo, hi = (p & 0xF).astype(np.int8), (p >> 4).astype(np.int8)
    if signed:
        lo, hi = np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)
    return np.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1]).astype(np.int8)


def interleave_rows(qweight: np.ndarray, scale: np.ndarray, min_: np.ndarray | None, bits: int,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Stored tensors in version 1's layout (qweight [..., N, K | K/2], scale/min [..., N, G]) ->
    version 2's (runtime/artifact/kernels.py QUANT_LINEAR_V2): qweight [..., N/16, 16 K | 8 K], each
    64-byte run 16 rows x 4 bytes of one k-step (int4: a byte holds elements k and k + 4 of an
    8-element step), scale/min [..., N/16, G, 16]. The values are the same; only their places move."""
    *lead, N, width = qweight.shape
    if N % INTERLEAVE:
        raise QuantizationError(f"interleave_rows: {N} rows is not a multiple of {INTERLEAVE}")
    if bits == 5:
        q = _interleave_five(np.asarray(qweight), lead, N)
    elif bits == 8:
        K = width
        q = qweight.reshape(*lead, N // INTERLEAVE, INTERLEAVE, K // 4, 4)                      # [.., n/16, 16, K/4, 4]
        q = np.swapaxes(q, -3, -2).reshape(*lead, N // INTERLEAVE, INTERLEAVE * K)             # [.., n/16, K/4, 16, 4]
    else:
        K = 2 * width
        v = unpack_int4(qweight, signed=False).astype(np.uint8)                    # nibbles in element order
        v = v.reshape(*lead, N // INTERLEAVE, INTERLEAVE, K // 8, 2, 4)                        # [.., n/16, 16, K/8, lo|hi, 4]
        packed = v[..., 0, :] | (v[..., 1, :] << 4)                                # [.., n/16, 16, K/8, 4]
        q = np.swapaxes(packed, -3, -2).reshape(*lead, N // INTERLEAVE, INTERLEAVE * K // 2)   # [.., n/16, K/8, 16, 4]

    def rows_last(a):
        return None if a is None else np.ascontiguousarray(
            np.swapaxes(a.reshape(*lead, N // INTERLEAVE, INTERLEAVE, a.shape[-1]), -2, -1))   # [.., n/16, G, 16]
    return np.ascontiguousarray(q), rows_last(scale), rows_last(min_)


def _interleave_five(q: np.ndarray, lead: list, N: int) -> np.ndarray:
    """5-bit values int8 [..., N, K] (in [-16, 15]) -> version 4's qweight uint8 [..., N/16, 10 K]: per
    32-element block of 16 rows, int4's 4 k-steps of 64 bytes holding the low nibbles of u = q + 16
    (element k of row r at byte 64 (k // 8) + 4 r + k % 4, its low nibble when k % 8 < 4, else its
    high one), then per k-step 16 bytes of fifth bits: two little-endian 64-bit masks over that
    step's 64 bytes, the first for the low nibbles, the second for the high ones (bit 4 r + k % 4)."""
    K = q.shape[-1]
    if K % FIVE_BIT_GROUP or q.min(initial=0) < -16 or q.max(initial=0) > 15:
        raise QuantizationError(f"interleave_rows: 5-bit values must be in [-16, 15] with K ({K}) a multiple of "
                                f"{FIVE_BIT_GROUP}")
    u = (q.astype(np.int16) + 16).astype(np.uint8)
    v = u.reshape(*lead, N // INTERLEAVE, INTERLEAVE, K // 8, 2, 4)                # [.., n/16, r, step, lo|hi, i]
    nib = np.moveaxis((v[..., 0, :] & 0xF) | ((v[..., 1, :] & 0xF) << 4), -3, -2)  # [.., n/16, step, r, i]
    high = np.moveaxis(v >> 4, -4, -2)                                           # [.., n/16, step, lo|hi, r, i]
    masks = np.packbits(high.reshape(*high.shape[:-2], 64), axis=-1, bitorder="little")   # [.., n/16, step, 2, 8]
    blocks = K // FIVE_BIT_GROUP
    nib = nib.reshape(*lead, N // INTERLEAVE, blocks, 256)
    masks = masks.reshape(*lead, N // INTERLEAVE, blocks, 64)
    return np.concatenate([nib, masks], axis=-1).reshape(*lead, N // INTERLEAVE, blocks * FIVE_BIT_BYTES)


def _five_in_order(qweight, xp):
    """Version 4's qweight of one matrix (uint8 [N/16, 10 K], _interleave_five) -> int8 [N, K] in [-16, 15]."""
    ng, width = qweight.shape
    K = width // FIVE_BIT_BYTES * FIVE_BIT_GROUP
    b = qweight.reshape(ng, K // FIVE_BIT_GROUP, FIVE_BIT_BYTES)
    nib = b[..., :256].reshape(ng, K // FIVE_BIT_GROUP, 4, INTERLEAVE, 4)                  # [n/16, blk, s, r, i]
    masks = b[..., 256:].reshape(ng, K // FIVE_BIT_GROUP, 4, 2, 8)                         # [n/16, blk, s, lo|hi, byte]
    bit = (masks[..., None] >> xp.arange(8, dtype=xp.uint8)) & 1                           # [.., lo|hi, byte, bit]
    bit = bit.reshape(ng, K // FIVE_BIT_GROUP, 4, 2, INTERLEAVE, 4)                        # [.., lo|hi, r, i]
    lo = (nib & 0xF) | (bit[:, :, :, 0] << 4)
    hi = (nib >> 4) | (bit[:, :, :, 1] << 4)
    u = xp.stack([lo, hi], axis=3)                                                         # [n/16, blk, s, lo|hi, r, i]
    q = u.astype(xp.int8) - xp.int8(16)
    return q.transpose(0, 4, 1, 2, 3, 5).reshape(INTERLEAVE * ng, K)                     # [n/16, r, blk, s, lo|hi, i]


def rows_in_order(qweight, scale, min_, bits: int, xp=np, *, signed: bool | None = None):
    """One matrix in version 2's layout (qweight [N/16, 16 K | 8 K], scale/min [N/16, G, 16]) -> its
    integer values int8 [N, K] (int4: two's complement nibbles, or unsigned ones [0, 15] when there is
    a min) and scale/min [N, G]: interleave_rows undone. `xp` is the arrays' library, numpy or
    jax.numpy: the composite's decomposition (exporter/composites/quant_linear.py) traces this same
    function with jax.numpy (this package imports no jax), the torch op (modules.py) runs it on its
    tensors' memory. Only reshapes, transposes, shifts and masks, which both libraries spell alike."""
    ng, width = qweight.shape
    if bits == 5:
        q = _five_in_order(qweight, xp)
        K = q.shape[-1]
    elif bits == 8:
        K = width // INTERLEAVE
        q = qweight.reshape(ng, K // 4, INTERLEAVE, 4).transpose(0, 2, 1, 3)              # [n/16, 16, K/4, 4]
    else:
        K = width // 8
        b = qweight.view(xp.int8).reshape(ng, K // 8, INTERLEAVE, 4)                      # [n/16, K/8, 16, 4]
        signed = min_ is None if signed is None else signed
        lo, hi = ((b << 4) >> 4, b >> 4) if signed else (b & 0xF, (b >> 4) & 0xF)           # signed | unsigned
        q = xp.stack([lo, hi], axis=3).transpose(0, 2, 1, 3, 4)                           # [n/16, 16, K/8, 2, 4]

    def rows(a):
        return None if a is None else a.transpose(0, 2, 1).reshape(INTERLEAVE * ng, a.shape[1])   # [N, G]
    return q.reshape(INTERLEAVE * ng, K), rows(scale), rows(min_)


def gather_rows(qweight, scale, min_, indices, bits: int, xp=np):
    """The rows `indices` ([*idx] integers) of one matrix in version 2's layout (qweight [N/16, 16 K |
    8 K], scale/min [N/16, G, 16]) -> their integer values int8 [*idx, K] (int4 as in rows_in_order)
    and scale/min [*idx, G]: what rows_in_order(...)[indices] gives, without putting the table back
    in order. A tied embedding table stored once for its LM head's kernel is gathered this way (a
    row's k-steps lie 64 bytes apart). numpy or jax.numpy (`xp`), like rows_in_order."""
    ng, width = qweight.shape
    blk, pos = indices // INTERLEAVE, indices % INTERLEAVE
    if bits == 8:
        K = width // INTERLEAVE
        q = qweight.reshape(ng, K // 4, INTERLEAVE, 4)[blk, :, pos, :]                  # [*idx, K/4, 4]
    else:
        K = width // 8
        b = qweight.view(xp.int8).reshape(ng, K // 8, INTERLEAVE, 4)[blk, :, pos, :]    # [*idx, K/8, 4]
        lo, hi = ((b << 4) >> 4, b >> 4) if min_ is None else (b & 0xF, (b >> 4) & 0xF)
        q = xp.stack([lo, hi], axis=-2)                                                # [*idx, K/8, 2, 4]
    out = q.reshape(*indices.shape, K)

    def rows(a):
        return None if a is None else a[blk, :, pos]                                    # [*idx, G]
    return out, rows(scale), rows(min_)


def block_quants(qweight, scheme: WeightScheme, xp=np):
    """One K-quant matrix's quants (schemes.py: row by row, or interleaved by 16 rows) -> their values
    int8 [N, K] (Q4_K unsigned [0, 15]). Interleaved: numpy or jax.numpy (`xp`), like rows_in_order;
    row by row: numpy (version 3's decomposition reads those as they are)."""
    if scheme.rows:
        return rows_in_order(qweight, None, None, scheme.bits, xp, signed=False)[0]
    return unpack_int4(qweight, signed=False) if scheme.bits == 4 else qweight


def dequantize_blocks(qweight: np.ndarray, blocks: np.ndarray, scheme: WeightScheme) -> np.ndarray:
    """float32 [..., out, in] of a K-quant weight kept as blocks (schemes.py; one matrix where the
    quants are interleaved): q * scale + min per sub-block, gguf.quants.dequantize's values bit for bit."""
    scale, mn = block_scales(np.asarray(blocks), scheme.block)
    q = block_quants(np.asarray(qweight), scheme)
    qa = QuantizedArray(q, scale, mn, dataclasses.replace(scheme, bits=8, block="", symmetric=True), q.shape)
    return dequantize(qa)


def _outward(x: np.ndarray, dtype, *, down: bool = False) -> np.ndarray:
    """Round float32 `x` to `dtype`, away from zero (or toward -inf with down=True)."""
    r = x.astype(dtype)
    r32 = r.astype(np.float32)
    if down:
        fix = r32 > x
        toward = np.full_like(r, -np.inf)
    else:
        fix = np.abs(r32) < np.abs(x)
        toward = np.where(x < 0, -np.inf, np.inf).astype(dtype)
    return np.where(fix, np.nextafter(r, toward), r).astype(dtype)


def _grouped(w: np.ndarray, group: int | None) -> np.ndarray:
    """[..., out, in] -> [..., out, in // group, group] (per-channel: [..., out, 1, in])."""
    g = group or w.shape[-1]
    return w.reshape(*w.shape[:-1], w.shape[-1] // g, g)


def quantize(w: np.ndarray, scheme: WeightScheme, *, where: str = "weight") -> QuantizedArray:
    """Quantize a float weight [..., out, in] (any float dtype; computed in float32)."""
    w = np.asarray(w, dtype=np.float32)
    scheme.check_shape(w.shape, where)
    sdt = _NP_SCALE[scheme.scale_dtype]
    wg = _grouped(w, scheme.group)                                       # [..., out, G, g]
    levels = (1 << scheme.bits) - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        if scheme.symmetric:
            if scheme.bits == 8:
                scale = _outward(np.abs(wg).max(-1) / np.float32(127), sdt)  # [..., out, G]
                lo, hi = -127, 127
            else:
                idx = np.abs(wg).argmax(-1)[..., None]
                m = np.take_along_axis(wg, idx, -1)[..., 0]                  # signed extreme
                scale = _outward(m / np.float32(-8), sdt)
                lo, hi = -8, 7
            s32 = scale.astype(np.float32)[..., None]
            q = np.where(s32 != 0, np.round(wg / s32), 0.0)
            mn = None
        else:
            mn = _outward(wg.min(-1), sdt, down=True)                         # [..., out, G]
            scale = _outward((wg.max(-1) - mn.astype(np.float32)) / np.float32(levels), sdt)
            s32, m32 = scale.astype(np.float32)[..., None], mn.astype(np.float32)[..., None]
            q = np.where(s32 != 0, np.round((wg - m32) / s32), 0.0)
            lo, hi = 0, levels
    if scheme.rounding == "mse":
        q, scale = _search_sym_int4(wg, np.clip(q, lo, hi), scale)       # [..., out, G, g], [..., out, G]
    q = np.clip(q, lo, hi).reshape(w.shape).astype(np.int8)             # [..., out, in]
    qweight = pack_int4(q) if scheme.bits == 4 else q
    if scheme.group is None:
        scale = scale[..., 0]
        mn = None if mn is None else mn[..., 0]
    return QuantizedArray(qweight, np.ascontiguousarray(scale), None if mn is None else np.ascontiguousarray(mn),
                          scheme, tuple(w.shape))


MSE_DIVISORS = np.arange(6.0, 9.001, 0.25, dtype=np.float32)


def _search_sym_int4(wg: np.ndarray, q0: np.ndarray, s0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rounding "mse" of int4 symmetric: per group of wg [..., G, g], the (q, scale) of least
    squared error among the minmax pair (q0, s0) and MSE_DIVISORS (see the module docstring);
    returns q float [..., G, g] and scale [..., G] in s0's dtype."""
    sdt = s0.dtype
    idx = np.abs(wg).argmax(-1)[..., None]
    m = np.take_along_axis(wg, idx, -1)                                  # [..., G, 1] signed extreme
    best_q, best_s = q0.astype(np.float32), s0
    best_err = np.square(wg - s0.astype(np.float32)[..., None] * best_q).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        for d in MSE_DIVISORS:
            trial = m / -d                                               # [..., G, 1]
            q = np.clip(np.where(trial != 0, np.round(wg / trial), 0.0), -8, 7)
            qq = (q * q).sum(-1)                                         # [..., G]
            s = np.where(qq > 0, (wg * q).sum(-1) / qq, 0.0).astype(sdt)
            err = np.square(wg - s.astype(np.float32)[..., None] * q).sum(-1)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s = np.where(better, s, best_s)
            best_q = np.where(better[..., None], q, best_q)
    return best_q, best_s


def int_values(qa: QuantizedArray) -> np.ndarray:
    """The integer values q [..., out, in] (unpacked for int4)."""
    if qa.scheme.bits == 4:
        return unpack_int4(qa.qweight, signed=qa.scheme.symmetric)
    return np.asarray(qa.qweight)


def dequantize(qa: QuantizedArray) -> np.ndarray:
    """float32 [..., out, in]: q * scale (+ min), in float32 with scale and min widened first."""
    q = int_values(qa).astype(np.float32)
    qg = _grouped(q, qa.scheme.group)                                    # [..., out, G, g]
    scale = qa.scale if qa.scheme.group else qa.scale[..., None]
    out = qg * scale.astype(np.float32)[..., None]
    if qa.min is not None:
        mn = qa.min if qa.scheme.group else qa.min[..., None]
        out = out + mn.astype(np.float32)[..., None]
    return out.reshape(qa.shape)
