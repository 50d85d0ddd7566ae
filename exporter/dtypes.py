"""dtype names shared by the manifest, torch and jax.

The artifact stores dtypes as short strings ("f32", "bf16", "i32", ...). jax
runs without x64, so torch's 64-bit types narrow at the boundary: int64 ->
int32 and float64 -> float32 (documented in docs/artifact-format.md).
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

# What the artifact uses for a torch dtype (64-bit narrows; see module doc).
_NARROW = {"f64": "f32", "i64": "i32", "c128": "c64"}


def name_of_torch(dtype) -> str:
    """torch.dtype -> manifest name, before narrowing."""
    import torch
    table = {
        torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
        torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
        torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
        torch.uint32: "u32",
    }
    if dtype not in table:
        raise TypeError(f"dtype {dtype} is not supported by hloserve artifacts")
    return table[dtype]


def artifact_name_of_torch(dtype) -> str:
    """torch.dtype -> the dtype the artifact (and jax) uses."""
    name = name_of_torch(dtype)
    return _NARROW.get(name, name)


def jax_of_torch(dtype) -> np.dtype:
    """torch.dtype -> numpy/jax dtype as traced (64-bit narrowed)."""
    return NUMPY[artifact_name_of_torch(dtype)]


def name_of_numpy(dtype) -> str:
    return NAME_OF_NUMPY[np.dtype(dtype)]
