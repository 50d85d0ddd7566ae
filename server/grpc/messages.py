"""TF Serving's gRPC messages without TensorFlow: classes built from a schema table with protobuf's
descriptor APIs, in a private descriptor pool.

Each class has the full name, field numbers and types of its counterpart in tensorflow-serving-api and
TensorFlow (tests/server/test_grpc.py compares every declared field with the real descriptors), so
both read each other's bytes. Only the fields hloserve reads or writes are declared; any other field a
client sends is kept as an unknown field and ignored. Oneofs are not declared (a message field has
presence anyway, and an empty version_label means none).

    m = messages()
    req = m.PredictRequest.FromString(data)
    resp = m.PredictResponse(); resp.outputs["y"].float_val.extend([1.0])
"""
from __future__ import annotations

import functools
import re
import types

from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2
from google.protobuf.internal import enum_type_wrapper

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {t: getattr(_F, "TYPE_" + t.upper())
            for t in ("double", "float", "int64", "uint64", "int32", "uint32", "bool", "string", "bytes")}

# package -> {message name: field lines as in a .proto (types fully qualified) | enum name: {value: number}}.
# Nested types are named Outer.Inner; a map<string, T> field gets its Entry type as protoc makes it.
_SCHEMA = {
    "tensorflow.error": {
        "Code": {"OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
                 "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "UNAUTHENTICATED": 16, "RESOURCE_EXHAUSTED": 8,
                 "FAILED_PRECONDITION": 9, "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13,
                 "UNAVAILABLE": 14, "DATA_LOSS": 15},
    },
    "tensorflow": {   # tensorflow/core/framework/{types,tensor_shape,tensor}.proto, core/protobuf/meta_graph.proto
        "DataType": {"DT_INVALID": 0, "DT_FLOAT": 1, "DT_DOUBLE": 2, "DT_INT32": 3, "DT_UINT8": 4, "DT_INT16": 5,
                     "DT_INT8": 6, "DT_STRING": 7, "DT_COMPLEX64": 8, "DT_INT64": 9, "DT_BOOL": 10, "DT_BFLOAT16": 14,
                     "DT_UINT16": 17, "DT_COMPLEX128": 18, "DT_HALF": 19, "DT_UINT32": 22, "DT_UINT64": 23,
                     "DT_INT4": 29, "DT_UINT4": 30},
        "TensorShapeProto": ["repeated tensorflow.TensorShapeProto.Dim dim = 2", "bool unknown_rank = 3"],
        "TensorShapeProto.Dim": ["int64 size = 1", "string name = 2"],
        "TensorProto": ["tensorflow.DataType dtype = 1", "tensorflow.TensorShapeProto tensor_shape = 2",
                        "int32 version_number = 3", "bytes tensor_content = 4", "repeated int32 half_val = 13",
                        "repeated float float_val = 5", "repeated double double_val = 6", "repeated int32 int_val = 7",
                        "repeated bytes string_val = 8", "repeated float scomplex_val = 9",
                        "repeated int64 int64_val = 10", "repeated bool bool_val = 11",
                        "repeated double dcomplex_val = 12", "repeated uint32 uint32_val = 16",
                        "repeated uint64 uint64_val = 17"],
        "TensorInfo": ["string name = 1", "tensorflow.DataType dtype = 2", "tensorflow.TensorShapeProto tensor_shape = 3"],
        "SignatureDef": ["map<string, tensorflow.TensorInfo> inputs = 1", "map<string, tensorflow.TensorInfo> outputs = 2",
                         "string method_name = 3"],
    },
    "tensorflow.serving": {   # tensorflow_serving/apis/*.proto
        "ModelSpec": ["string name = 1", "google.protobuf.Int64Value version = 2", "string version_label = 4",
                      "string signature_name = 3"],
        "PredictRequest": ["tensorflow.serving.ModelSpec model_spec = 1", "map<string, tensorflow.TensorProto> inputs = 2",
                           "repeated string output_filter = 3"],
        "PredictResponse": ["tensorflow.serving.ModelSpec model_spec = 2",
                            "map<string, tensorflow.TensorProto> outputs = 1"],
        "GetModelMetadataRequest": ["tensorflow.serving.ModelSpec model_spec = 1", "repeated string metadata_field = 2"],
        "GetModelMetadataResponse": ["tensorflow.serving.ModelSpec model_spec = 1",
                                     "map<string, google.protobuf.Any> metadata = 2"],
        "SignatureDefMap": ["map<string, tensorflow.SignatureDef> signature_def = 1"],
        "StatusProto": ["tensorflow.error.Code error_code = 1", "string error_message = 2"],
        "ModelVersionStatus": ["int64 version = 1", "tensorflow.serving.ModelVersionStatus.State state = 2",
                               "tensorflow.serving.StatusProto status = 3"],
        "ModelVersionStatus.State": {"UNKNOWN": 0, "START": 10, "LOADING": 20, "AVAILABLE": 30, "UNLOADING": 40, "END": 50},
        "GetModelStatusRequest": ["tensorflow.serving.ModelSpec model_spec = 1"],
        "GetModelStatusResponse": ["repeated tensorflow.serving.ModelVersionStatus model_version_status = 1"],
        # Classify / Regress: only the model spec is read (hloserve signatures are predict signatures)
        "ClassificationRequest": ["tensorflow.serving.ModelSpec model_spec = 1"],
        "RegressionRequest": ["tensorflow.serving.ModelSpec model_spec = 1"],
    },
}
_FIELD = re.compile(r"(repeated )?(?:map<string, ([\w.]+)>|([\w.]+)) (\w+) = (\d+)")


@functools.cache
def messages() -> types.SimpleNamespace:
    """The message classes by short name (`m.PredictRequest`) and the enums (`m.DataType.Value("DT_FLOAT")`)."""
    pool = descriptor_pool.DescriptorPool()
    for dep in (any_pb2, wrappers_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        dep.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    enums = {f"{pkg}.{name}" for pkg, decls in _SCHEMA.items() for name, d in decls.items() if isinstance(d, dict)}
    for i, (pkg, decls) in enumerate(_SCHEMA.items()):   # each package may use the ones before it
        pool.Add(_file(pkg, decls, enums, deps=list(_SCHEMA)[:i]))
    out = {}
    for pkg, decls in _SCHEMA.items():
        for name, decl in decls.items():
            if isinstance(decl, dict):
                out[name.replace(".", "_")] = enum_type_wrapper.EnumTypeWrapper(pool.FindEnumTypeByName(f"{pkg}.{name}"))
            elif "." not in name:
                out[name] = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{pkg}.{name}"))
    return types.SimpleNamespace(**out)


def _file(pkg: str, decls: dict, enums: set[str], deps: list[str]) -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name=_file_name(pkg), package=pkg, syntax="proto3")
    f.dependency.extend(["google/protobuf/any.proto", "google/protobuf/wrappers.proto", *map(_file_name, deps)])
    made: dict[str, descriptor_pb2.DescriptorProto] = {}
    for name, decl in decls.items():
        outer, _, inner = name.rpartition(".")
        if isinstance(decl, dict):
            enum = (made[outer].enum_type if outer else f.enum_type).add(name=inner)
            enum.value.extend(descriptor_pb2.EnumValueDescriptorProto(name=k, number=v) for k, v in decl.items())
            continue
        msg = made[name] = (made[outer].nested_type if outer else f.message_type).add(name=inner)
        for line in decl:
            _add_field(msg, f"{pkg}.{name}", line, enums)
    return f


def _add_field(msg: descriptor_pb2.DescriptorProto, full_name: str, line: str, enums: set[str]) -> None:
    repeated, map_value, type_name, name, number = _FIELD.fullmatch(line).groups()
    field = msg.field.add(name=name, number=int(number), json_name=_camel(name),
                          label=_F.LABEL_REPEATED if repeated or map_value else _F.LABEL_OPTIONAL)
    if map_value:   # map<string, T> is a repeated nested XEntry {key = 1; value = 2} marked map_entry
        entry = msg.nested_type.add(name=_camel(name)[0].upper() + _camel(name)[1:] + "Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL, json_name="key")
        _set_type(entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL, json_name="value"), map_value, enums)
        field.type, field.type_name = _F.TYPE_MESSAGE, f".{full_name}.{entry.name}"
        return
    _set_type(field, type_name, enums)


def _set_type(field: descriptor_pb2.FieldDescriptorProto, type_name: str, enums: set[str]) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        field.type = _F.TYPE_ENUM if type_name in enums else _F.TYPE_MESSAGE
        field.type_name = "." + type_name


def _file_name(pkg: str) -> str:
    return f"hloserve/{pkg.replace('.', '/')}.proto"


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)
