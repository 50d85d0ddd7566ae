"""torch dtypes <-> manifest dtype names (the format's own table is hloserve.runtime.artifact.dtypes).

The artifact stores dtypes as short strings ("f32", "bf16", "i32", ...). jax
runs without x64, so torch's 64-bit types narrow at the boundary: int64 ->
int32 and float64 -> float32 (documented in docs/artifact-format.md).
"""
from __future__ import annotations

import numpy as np
from hloserve.runtime.artifact.dtypes import NUMPY, name_of_numpy  # noqa: F401  (re-exported)

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
