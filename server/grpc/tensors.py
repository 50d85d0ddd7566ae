"""TensorProto <-> numpy arrays, as TensorFlow reads and writes them.

In: `tensor_content` (the raw little-endian bytes) or the dtype's typed field (`float_val`, `int_val`,
`half_val` with bf16/f16 as uint16 bit patterns, ...). As in TensorFlow, a typed field with fewer values
than the shape holds is padded with its last value (none: zeros). Out: the typed field, as TF Serving's
Predict answers by default (clients read `outputs[k].float_val` as well as `tf.make_ndarray`).
"""
from __future__ import annotations

import math

import numpy as np

from ..predict import TF_TYPE_OF_NUMPY, TF_TYPES, PredictRequestError
from .messages import messages

# the numpy type each typed field holds on the wire (half_val: 16-bit patterns in int32s)
_WIRE = {"float_val": np.float32, "double_val": np.float64, "int_val": np.int32, "int64_val": np.int64,
         "bool_val": np.bool_, "half_val": np.int32, "uint32_val": np.uint32, "uint64_val": np.uint64,
         "scomplex_val": np.float32, "dcomplex_val": np.float64}


def to_array(proto, where: str, max_bytes: int) -> np.ndarray:
    """A TensorProto -> numpy array of its dtype; PredictRequestError names what is wrong ("tensor parsing
    error", as TF Serving says). Tensors over `max_bytes` decoded are refused before they are allocated."""
    m = messages()
    name = m.DataType.Name(proto.dtype) if proto.dtype in m.DataType.values() else str(proto.dtype)
    if name not in TF_TYPES:
        raise PredictRequestError(f"tensor parsing error: {where}: dtype {name} is not supported; "
                                  f"send one of {sorted(TF_TYPES)}")
    dtype, field = TF_TYPES[name]
    if proto.tensor_shape.unknown_rank:
        raise PredictRequestError(f"tensor parsing error: {where}: the shape has an unknown rank; send its dims")
    shape = tuple(d.size for d in proto.tensor_shape.dim)
    if any(s < 0 for s in shape):
        raise PredictRequestError(f"tensor parsing error: {where}: shape {list(shape)} has a negative dim")
    n = math.prod(shape)
    if n * dtype.itemsize > max_bytes:
        raise PredictRequestError(f"{where}: {name}{list(shape)} is {n * dtype.itemsize} bytes, more than the "
                                  f"server's limit of {max_bytes} (--max-body-mib)")
    if proto.tensor_content:
        data = proto.tensor_content
        if len(data) != n * dtype.itemsize:
            raise PredictRequestError(f"tensor parsing error: {where}: tensor_content has {len(data)} bytes, "
                                      f"{name}{list(shape)} needs {n * dtype.itemsize}")
        return np.frombuffer(data, dtype).reshape(shape)
    values = np.asarray(getattr(proto, field), _WIRE[field])
    if field == "half_val":
        if values.size and (values.min() < 0 or values.max() > 0xFFFF):
            raise PredictRequestError(f"tensor parsing error: {where}: half_val holds 16-bit patterns (0..65535)")
        values = values.astype(np.uint16).view(dtype)
    elif dtype.kind == "c":
        if values.size % 2:
            raise PredictRequestError(f"tensor parsing error: {where}: {field} holds (real, imaginary) pairs")
        values = values.view(dtype)
    elif values.dtype != dtype:
        info = np.iinfo(dtype)
        if values.size and (values.min() < info.min or values.max() > info.max):
            raise PredictRequestError(f"tensor parsing error: {where}: {field} values do not fit {name}")
        values = values.astype(dtype)
    if values.size > n:
        raise PredictRequestError(f"tensor parsing error: {where}: {values.size} values in {field} for "
                                  f"{name}{list(shape)} ({n} elements)")
    if values.size < n:   # TensorFlow's rule: the last value repeats (no values: zeros)
        values = np.concatenate([values, np.full(n - values.size, values[-1] if values.size else 0, dtype)])
    return values.reshape(shape)


def from_array(arr: np.ndarray, proto) -> None:
    """Fill a TensorProto with the array: dtype, shape and the typed field."""
    arr = np.asarray(arr)
    name = TF_TYPE_OF_NUMPY[arr.dtype]
    _, field = TF_TYPES[name]
    proto.dtype = messages().DataType.Value(name)
    for size in arr.shape:
        proto.tensor_shape.dim.add(size=size)
    flat = arr.reshape(-1)
    if field == "half_val":
        flat = flat.view(np.uint16).astype(np.int32)
    elif arr.dtype.kind == "c":
        flat = flat.view(_WIRE[field])
    getattr(proto, field).extend(flat.tolist())
