"""Manifest dtype names ("f32", "bf16", "i32", ...) and their numpy / safetensors equivalents.

The torch side of the mapping (and the 64-bit narrowing at the export boundary) is in
hloserve.exporter.dtypes; this module needs only numpy and ml_dtypes.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

# manifest name -> numpy dtype
NUMPY = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f64": np.dtype(np.float64),
    "i64": np.dtype(np.int64),
    "i32": np.dtype(np.int32),
    "i16": np.dtype(np.int16),
    "i8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
    "u32": np.dtype(np.uint32),
    "bool": np.dtype(np.bool_),
    "i4": np.dtype(ml_dtypes.int4),
    "u4": np.dtype(ml_dtypes.uint4),
    "c64": np.dtype(np.complex64),
}
NAME_OF_NUMPY = {v: k for k, v in NUMPY.items()}

# safetensors header dtype strings
SAFETENSORS = {
    "f32": "F32", "f16": "F16", "bf16": "BF16", "f64": "F64", "i64": "I64", "i32": "I32",
    "i16": "I16", "i8": "I8", "u8": "U8", "u32": "U32", "bool": "BOOL",
}
NAME_OF_SAFETENSORS = {v: k for k, v in SAFETENSORS.items()}

def name_of_numpy(dtype) -> str:
    return NAME_OF_NUMPY[np.dtype(dtype)]
