"""GGUF K-quant blocks for tests: a small numpy quantizer for Q4_K and Q6_K (gguf-py dequantizes K-quants
but cannot make them), random blocks of any K type, and a Q4_K_M-style GGUF of a real model.

    raw = quantize("Q4_K", w)                 # uint8 [rows, cols / 256 * 144]: valid Q4_K blocks of w
    raw = random_blocks("Q5_K", rows, cols, rng)
    path = q4_k_m_copy(src_gguf, out_path)    # src's metadata and tokenizer, its tensors requantized

The quantizer follows llama.cpp's block layouts (ggml-quants.c quantize_row_q4_K_ref / q6_K_ref) with
the plain rules, not llama.cpp's scale search: per sub-block of 32 a min and a scale from its extremes
(Q4_K), or the signed extreme / -32 (Q6_K), then the super-block's f16 d (and dmin) as the largest
sub-block value over 63 (Q6_K: 127) and each sub-block's 6-bit (8-bit) integer. The blocks are what a
reader must accept; how close they are to w is llama.cpp's business and these tests' tolerance's.
"""
from __future__ import annotations

import numpy as np

QK = 256


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float [..., n] -> uint8 [..., n, 2]: each value as little-endian float16."""
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(*v.shape, 2)


def _q4_k(x: np.ndarray) -> np.ndarray:
    """x f32 [n, 256] -> Q4_K blocks uint8 [n, 144]."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)                                     # [n, 8] (<= 0)
    scale = (sub.max(-1) - lo) / 15.0
    d = (scale.max(-1) / 63.0).astype(np.float16).astype(np.float32)       # [n]
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d[:, None])), 0, 63).astype(np.uint8)
        m = np.clip(np.nan_to_num(np.round(-lo / dmin[:, None])), 0, 63).astype(np.uint8)
        step = (d[:, None] * sc)[..., None]
        q = np.nan_to_num(np.round((sub + (dmin[:, None] * m)[..., None]) / step))
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, 4, 2, 32)          # [n, run, low|high, 32]
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_f16_bytes(d[:, None]).reshape(n, 2), _f16_bytes(dmin[:, None]).reshape(n, 2),
                           packed, qs], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """x f32 [n, 256] -> Q6_K blocks uint8 [n, 210]."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    idx = np.abs(sub).argmax(-1)[..., None]
    scale = np.take_along_axis(sub, idx, -1)[..., 0] / -32.0             # [n, 16] signed
    d = (np.abs(scale).max(-1) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d[:, None])), -128, 127).astype(np.int8)
        q = np.nan_to_num(np.round(sub / (d[:, None] * sc)[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, half, quarter, 32]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d[:, None]).reshape(n, 2)], axis=-1)


_QUANTIZE = {"Q4_K": _q4_k, "Q6_K": _q6_k}


def quantize(kind: str, w: np.ndarray) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) -> `kind` blocks uint8 [rows, cols / 256 * block bytes]."""
    rows, cols = w.shape
    blocks = _QUANTIZE[kind](np.asarray(w, np.float32).reshape(rows * cols // QK, QK))
    return blocks.reshape(rows, -1)


def random_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K blocks uint8 [rows, cols / 256 * size]: every bit random but the f16
    d (and dmin), drawn so the values are ~0.05 in size."""
    import gguf
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    b = rng.integers(0, 256, (rows, cols // QK, size), dtype=np.uint8)

    def f16(lo: float, hi: float, signed: bool) -> np.ndarray:
        sign = rng.choice([-1.0, 1.0], b.shape[:2]) if signed else 1.0
        return _f16_bytes(rng.uniform(lo, hi, b.shape[:2]) * sign)

    if kind == "Q6_K":
        b[..., 208:210] = f16(5e-6, 2e-5, True)
    else:
        b[..., 0:2], b[..., 2:4] = f16(5e-5, 2e-4, False), f16(5e-5, 2e-4, False)
    return b.reshape(rows, -1)


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers a Q4_K_M file gives Q6_K (attention V, FFN down)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, cols: int, n_layers: int) -> str:
    """The ggml type llama.cpp's Q4_K_M gives the GGUF tensor `name` of `cols` columns: Q6_K for the
    output (a tied embedding) and for the V / FFN down matrices of more_bits layers, Q4_K otherwise;
    where cols is not a multiple of 256 its fallback (Q6_K -> Q8_0, Q4_K -> Q5_0)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    more = name in ("token_embd.weight", "output.weight") or (
        (".attn_v." in name or ".ffn_down." in name) and more_bits(layer, n_layers))
    if cols % QK:
        return "Q8_0" if more else "Q5_0"
    return "Q6_K" if more else "Q4_K"


def q4_k_m_copy(src: str, out: str) -> dict[str, str]:
    """A GGUF at `out` with src's key-values (architecture, tokenizer, ...) and its matrices
    dequantized and requantized as llama.cpp's Q4_K_M would store them (q4_k_m_type; 1-D tensors
    F32); returns {GGUF tensor name: ggml type}."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    types = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(v) for v in reversed(t.shape.tolist()))          # numpy order [rows, cols]
        values = values.reshape(shape)
        kind = "F32" if values.ndim == 1 else q4_k_m_type(t.name, shape[-1], n_layers)
        qtype = gguf.GGMLQuantizationType[kind]
        data = (values if kind == "F32" else quantize(kind, values) if kind in _QUANTIZE
                else gguf.quants.quantize(values, qtype))
        writer.add_tensor(t.name, data, raw_dtype=None if kind == "F32" else qtype)   # blocks: uint8 [rows, bytes]
        types[t.name] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types
