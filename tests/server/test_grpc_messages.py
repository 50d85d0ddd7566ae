"""The gRPC API's messages and TensorProto codec (server/grpc/) against TensorFlow's and
tensorflow-serving-api's own: same fields on the wire, and arrays read and written as TensorFlow does,
for every dtype TF_TYPES maps (bf16/f16 through half_val bit patterns included)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hloserve.runtime.artifact.errors import HloserveError
from hloserve.server.config import DEFAULT_GRPC_PORT, ServeConfig
from hloserve.server.grpc.messages import messages
from hloserve.server.grpc.tensors import from_array, to_array
from hloserve.server.predict import TF_TYPES, PredictRequestError

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def tf():
    """TensorFlow, with tensorflow-serving-api's messages registered in its descriptor pool."""
    import tensorflow
    from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2,  # noqa: F401 - registers them
                                         get_model_status_pb2, predict_pb2, regression_pb2)
    return tensorflow


def _pairs(mine, pool):
    """(our descriptor, the real one of the same full name) for every message and nested message we declare."""
    real = pool.FindMessageTypeByName(mine.full_name)
    yield mine, real
    for nested in mine.nested_types:
        yield from _pairs(nested, pool)


def test_every_declared_field_is_the_real_one(tf):
    from google.protobuf import descriptor_pool
    pool = descriptor_pool.Default()
    m = messages()
    checked = 0
    for name, cls in vars(m).items():
        if not hasattr(cls, "FromString"):   # an enum
            real = pool.FindEnumTypeByName(cls.DESCRIPTOR.full_name)
            assert {v.name: v.number for v in cls.DESCRIPTOR.values}.items() <= \
                {v.name: v.number for v in real.values}.items(), name
            continue
        for ours, real in _pairs(cls.DESCRIPTOR, pool):
            for f in ours.fields:
                r = real.fields_by_number[f.number]
                assert (r.name, r.type, r.is_repeated) == (f.name, f.type, f.is_repeated), (ours.full_name, f.name)
                assert (r.message_type or r.enum_type or f).full_name == (f.message_type or f.enum_type or f).full_name
                checked += 1
    assert checked > 50


def _example(dtype: np.dtype, shape=(2, 3)) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)   # f16, bf16, f32, f64: negative values too


@pytest.mark.parametrize("dt", sorted(TF_TYPES))
def test_tensors_cross_with_tensorflow_both_ways(tf, dt):
    """TensorFlow's own proto of an array, and the tensor_content and typed-field forms (each checked
    with tf.make_ndarray first), read back bit for bit; ours read back by tf.make_ndarray bit for bit."""
    from tensorflow.core.framework import tensor_pb2
    dtype, field = TF_TYPES[dt]
    arr = _example(dtype)
    own = tf.make_tensor_proto(arr)
    assert tf.dtypes.as_dtype(own.dtype) == tf.dtypes.as_dtype(dtype)
    content = tensor_pb2.TensorProto(dtype=own.dtype, tensor_shape=own.tensor_shape, tensor_content=arr.tobytes())
    typed = tensor_pb2.TensorProto(dtype=own.dtype, tensor_shape=own.tensor_shape)
    flat = arr.reshape(-1)
    getattr(typed, field).extend((flat.view(np.uint16).astype(np.int32) if field == "half_val" else
                                  flat.view(flat.real.dtype) if dtype.kind == "c" else flat).tolist())
    for real in (own, content, typed):
        assert tf.make_ndarray(real).tobytes() == arr.tobytes()
        got = to_array(messages().TensorProto.FromString(real.SerializeToString()), "x", LIMIT)
        assert got.dtype == dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes(), dt
    ours = messages().TensorProto()
    from_array(arr, ours)
    assert not ours.tensor_content and len(getattr(ours, field)) == arr.size * (2 if dtype.kind == "c" else 1)
    back = tf.make_ndarray(tensor_pb2.TensorProto.FromString(ours.SerializeToString()))
    assert back.dtype == dtype and back.shape == arr.shape and back.tobytes() == arr.tobytes(), dt


@pytest.mark.parametrize("values", [[], [1.5], [1.5, -2.0]])
def test_short_typed_fields_repeat_the_last_value_as_tensorflow_does(tf, values):
    from tensorflow.core.framework import tensor_pb2
    real = tensor_pb2.TensorProto(dtype=tf.float32.as_datatype_enum, float_val=values)
    real.tensor_shape.dim.add(size=2)
    real.tensor_shape.dim.add(size=3)
    got = to_array(messages().TensorProto.FromString(real.SerializeToString()), "x", LIMIT)
    np.testing.assert_array_equal(got, tf.make_ndarray(real))


def _proto(dtype: str, shape, **fields):
    m = messages()
    p = m.TensorProto(dtype=m.DataType.Value(dtype), **fields)
    for s in shape:
        p.tensor_shape.dim.add(size=s)
    return p


@pytest.mark.parametrize("proto,fragment", [
    (_proto("DT_FLOAT", [2], tensor_content=b"\0" * 7), "tensor_content has 7 bytes, DT_FLOAT[2] needs 8"),
    (_proto("DT_FLOAT", [2], float_val=[1, 2, 3]), "3 values in float_val for DT_FLOAT[2]"),
    (_proto("DT_STRING", [1], string_val=[b"a"]), "dtype DT_STRING is not supported"),
    (_proto("DT_INT8", [1], int_val=[300]), "int_val values do not fit DT_INT8"),
    (_proto("DT_BFLOAT16", [1], half_val=[-1]), "half_val holds 16-bit patterns"),
    (_proto("DT_FLOAT", [-1]), "negative dim"),
    (_proto("DT_FLOAT", [1 << 20, 1 << 10], float_val=[0]), "more than the server's limit"),
])
def test_bad_tensors_are_named(proto, fragment):
    with pytest.raises(PredictRequestError, match="input 'x'") as e:
        to_array(proto, "input 'x'", LIMIT)
    assert fragment in str(e.value)


def test_bf16_outputs_are_half_val_bit_patterns():
    arr = np.array([1.0, -2.5, 3.0e38], ml_dtypes.bfloat16)
    p = messages().TensorProto()
    from_array(arr, p)
    assert messages().DataType.Name(p.dtype) == "DT_BFLOAT16"
    assert list(p.half_val) == [0x3F80, 0xC020, int(arr[2:].view(np.uint16)[0])]


def test_grpc_port_defaults():
    """8500 for predict artifacts, off for LLMs; 0 turns it off; an LLM given a port is refused."""
    assert ServeConfig().grpc_port_for(llm=False) == DEFAULT_GRPC_PORT == 8500
    assert ServeConfig().grpc_port_for(llm=True) == 0
    assert ServeConfig(grpc_port=0).grpc_port_for(llm=False) == 0
    assert ServeConfig(grpc_port=9000).grpc_port_for(llm=False) == 9000
    with pytest.raises(HloserveError, match="--grpc-port 9000: the gRPC API is TF Serving's, for predict artifacts"):
        ServeConfig(grpc_port=9000).grpc_port_for(llm=True)


def test_the_grpc_server_imports_neither_tensorflow_nor_fastapi():
    """The serving side's messages come from protobuf alone (the layer rule checks direct imports; this,
    what loading the module pulls in)."""
    import os
    import subprocess
    import sys
    code = ("import sys, hloserve.server.grpc.tf_serving as t; t.messages(); "
            "print(sorted(m for m in ('tensorflow', 'fastapi', 'torch', 'tensorflow_serving') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stdout.strip() == "[]"
