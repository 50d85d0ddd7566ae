"""TensorFlow Serving's predict semantics, shared by its REST API (server/http/tf_serving.py) and its
gRPC API (server/grpc/): request bodies <-> input/output arrays, the servable check, model status and
metadata, and `run_predict`. No HTTP, no gRPC, no TensorFlow: errors are `PredictRequestError` (a bad
body) and `ApiError` (server/http/errors.py, the status each API translates into its own answer).

    POST /v1/models/{name}:predict          (TF Serving's REST API, served by hloserve too)
    {"signature_name": "serving_default", "instances": [{"input_ids": [101, 7592, 102], ...}, ...]}   row form
    {"signature_name": "serving_default", "inputs": {"input_ids": [[101, 7592, 102], ...], ...}}      columnar form

    req = decode_predict_request(body, manifest)      # -> PredictRequest (function, arrays, form)
    outs = model.functions[req.function](**req.inputs)
    return encode_predict_response(outs, req)        # {"predictions": [...]} or {"outputs": ...}

The rules follow https://www.tensorflow.org/tfx/serving/api_rest#request_format_2:
  - exactly one of "instances" (row) and "inputs" (columnar); "signature_name" defaults to
    "serving_default", which is the artifact's first function (the SavedModel that `hloserve tf`
    writes uses the same rule), and every function's own name is a signature too;
  - row form: a list of instances; each instance is an object {input name: value}, or, when the
    signature has one input, the bare value. Instances are stacked on a new leading (batch) dim,
    so every instance must give every input with the same shape;
  - columnar form: an object {input name: full tensor}, or the bare tensor for a one-input
    signature; no batch dim is added;
  - the response mirrors the form: row -> {"predictions": [one value per instance]} (an object
    per instance when there are several outputs); columnar -> {"outputs": tensor} (an object of
    tensors when there are several outputs);
  - {"b64": ...} values are for string tensors only, which hloserve artifacts do not have.
Values convert to the artifact's dtypes: integers must be integral and in range (int64 inputs
were narrowed to int32 at export), booleans are true/false. Every problem raises
PredictRequestError, whose message the server returns as {"error": message} with status 400.

Below the bodies: the servable check, model status and metadata (as TF Serving's JSON, which is the
proto3 JSON of the gRPC messages), typed arrays (gRPC's TensorProto) cast to the inputs' dtypes, and
`run_predict` (admission, then the batcher).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import ml_dtypes
import numpy as np
from hloserve.runtime import artifact
from hloserve.runtime.artifact.errors import HloserveError

from .http.errors import ApiError, admit

if TYPE_CHECKING:
    from .services import PredictService

SERVING_DEFAULT = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"
# TensorFlow's DataType name -> the numpy dtype and the TensorProto field holding its values when not
# in tensor_content (16-bit floats as uint16 bit patterns in half_val, complex as (re, im) pairs)
TF_TYPES = {
    "DT_FLOAT": (np.dtype(np.float32), "float_val"), "DT_DOUBLE": (np.dtype(np.float64), "double_val"),
    "DT_INT32": (np.dtype(np.int32), "int_val"), "DT_UINT8": (np.dtype(np.uint8), "int_val"),
    "DT_INT16": (np.dtype(np.int16), "int_val"), "DT_INT8": (np.dtype(np.int8), "int_val"),
    "DT_COMPLEX64": (np.dtype(np.complex64), "scomplex_val"), "DT_INT64": (np.dtype(np.int64), "int64_val"),
    "DT_BOOL": (np.dtype(np.bool_), "bool_val"), "DT_BFLOAT16": (np.dtype(ml_dtypes.bfloat16), "half_val"),
    "DT_UINT16": (np.dtype(np.uint16), "int_val"), "DT_COMPLEX128": (np.dtype(np.complex128), "dcomplex_val"),
    "DT_HALF": (np.dtype(np.float16), "half_val"), "DT_UINT32": (np.dtype(np.uint32), "uint32_val"),
    "DT_UINT64": (np.dtype(np.uint64), "uint64_val"),
}
TF_TYPE_OF_NUMPY = {dtype: name for name, (dtype, _) in TF_TYPES.items()}


class PredictRequestError(ValueError):
    """A predict body that cannot be turned into the function's inputs (HTTP 400)."""


@dataclasses.dataclass(frozen=True)
class PredictRequest:
    """A decoded predict body.

    Attributes:
      signature_name: as sent (default "serving_default").
      function: the artifact function it names.
      inputs: input name -> array in the artifact's dtype, in the function's input order.
      row_format: True for "instances" (the response is "predictions"), False for "inputs" ("outputs").
      output_names: the function's outputs, in order (the response keeps it).
    """
    signature_name: str
    function: str
    inputs: Mapping[str, np.ndarray]
    row_format: bool
    output_names: tuple[str, ...]


def default_function(manifest: artifact.Manifest) -> str:
    """The function behind "serving_default": the artifact's first one."""
    return next(iter(manifest.functions))


def resolve_signature(signature_name: str | None, manifest: artifact.Manifest) -> str:
    """Signature key -> artifact function ("serving_default" or a function's own name)."""
    name = SERVING_DEFAULT if signature_name in (None, "") else signature_name
    if name == SERVING_DEFAULT:
        return default_function(manifest)
    if name not in manifest.functions:
        raise PredictRequestError(f"Serving signature key {json.dumps(name)} not found; the model has "
                                  f"{[SERVING_DEFAULT, *manifest.functions]}")
    return name


def decode_predict_request(body: Mapping[str, Any] | str | bytes, manifest: artifact.Manifest) -> PredictRequest:
    """Parse a TF Serving predict body (dict or JSON text) into the function's input arrays."""
    if isinstance(body, (str, bytes)):
        try:
            body = json.loads(body)
        except ValueError as e:
            raise PredictRequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, Mapping):
        raise PredictRequestError(f"request body must be a JSON object, got {type(body).__name__}")
    unknown = set(body) - {"signature_name", "instances", "inputs"}
    if unknown:
        raise PredictRequestError(f"unknown request field(s) {sorted(unknown)}; expected 'signature_name' and "
                                  f"one of 'instances' (row form) or 'inputs' (columnar form)")
    if ("instances" in body) == ("inputs" in body):
        raise PredictRequestError("the request needs exactly one of 'instances' (row form) and 'inputs' "
                                  "(columnar form)")
    sig = body.get("signature_name") or SERVING_DEFAULT
    if not isinstance(sig, str):
        raise PredictRequestError(f"signature_name must be a string, got {type(sig).__name__}")
    fn = manifest.functions[resolve_signature(sig, manifest)]
    if "instances" in body:
        arrays = instances_to_arrays(body["instances"], fn.inputs)
    else:
        arrays = columnar_to_arrays(body["inputs"], fn.inputs)
    return PredictRequest(sig, fn.name, arrays, "instances" in body, tuple(t.name for t in fn.outputs))


def instances_to_arrays(instances: Any, specs: Sequence[artifact.TensorSpec]) -> dict[str, np.ndarray]:
    """Row form: a list of instances -> {input name: array with a leading batch dim}."""
    if not isinstance(instances, list) or not instances:
        raise PredictRequestError("'instances' must be a non-empty list (one entry per example)")
    names = [t.name for t in specs]
    rows: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for i, inst in enumerate(instances):
        named = _named(inst, names, f"instance {i}")
        for t in specs:
            arr = _to_array(named[t.name], t, f"instance {i} input {t.name!r}")
            want = len(t.shape) - 1
            if arr.ndim != want:
                raise PredictRequestError(f"instance {i} input {t.name!r} has rank {arr.ndim}, expected {want} "
                                          f"(the input is {t.describe()}; instances drop the leading batch dim)")
            if rows[t.name] and arr.shape != rows[t.name][0].shape:
                raise PredictRequestError(
                    f"input {t.name!r}: instance {i} has shape {list(arr.shape)} but instance 0 has "
                    f"{list(rows[t.name][0].shape)}; instances are stacked into one batch, so pad them to one "
                    f"shape or send the columnar 'inputs' form")
            rows[t.name].append(arr)
    return {n: np.stack(rows[n]) for n in names}


def columnar_to_arrays(inputs: Any, specs: Sequence[artifact.TensorSpec]) -> dict[str, np.ndarray]:
    """Columnar form: {input name: tensor} (or a bare tensor for one input) -> arrays."""
    names = [t.name for t in specs]
    named = _named(inputs, names, "'inputs'")
    out = {}
    for t in specs:
        arr = _to_array(named[t.name], t, f"input {t.name!r}")
        if arr.ndim != len(t.shape):
            raise PredictRequestError(f"input {t.name!r} has rank {arr.ndim} (shape {list(arr.shape)}), "
                                      f"expected {t.describe()}")
        out[t.name] = arr
    return out


def _named(value: Any, names: Sequence[str], where: str) -> dict[str, Any]:
    """{input name: value} from an object, or from a bare value when the signature has one input."""
    if isinstance(value, Mapping):
        named = dict(value)
    elif len(names) == 1:
        named = {names[0]: value}
    else:
        raise PredictRequestError(f"{where} must be an object with the inputs {list(names)} "
                                  f"(the signature has {len(names)} inputs)")
    _check_names(named, names, where)
    return named


def _check_names(named: Mapping[str, Any], names: Sequence[str], where: str) -> None:
    missing = [n for n in names if n not in named]
    extra = sorted(set(named) - set(names))
    if missing or extra:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {extra}"] if extra else [])
        raise PredictRequestError(f"{where}: {', '.join(parts)}; the signature's inputs are {list(names)}")


def _to_array(value: Any, spec: artifact.TensorSpec, where: str) -> np.ndarray:
    """A JSON value -> array of the spec's dtype; rejects ragged lists, b64, and lossy integer casts."""
    dtype = artifact.numpy_dtype(spec.dtype)
    if isinstance(value, np.ndarray):
        return cast_array(value, spec, where)
    if _has_b64(value):
        raise PredictRequestError(f"{where}: {{'b64': ...}} values are for string tensors; this input is {spec.dtype}")
    try:
        raw = np.array(value, dtype=object if dtype.kind in "iub" else np.float64)
    except (ValueError, TypeError) as e:
        raise PredictRequestError(f"{where}: not a rectangular numeric tensor ({e}); nested lists must have "
                                  f"equal lengths at every level") from e
    if raw.dtype == object:
        flat = raw.reshape(-1)
        if any(isinstance(v, (list, dict)) for v in flat):
            raise PredictRequestError(f"{where}: nested lists have unequal lengths (ragged); pad them to one length")
        if dtype.kind == "b":
            if not all(isinstance(v, bool) for v in flat):
                raise PredictRequestError(f"{where}: expected true/false values for a bool input")
            return raw.astype(np.bool_)
        bad = next((v for v in flat if isinstance(v, bool) or not isinstance(v, (int, float))
                    or (isinstance(v, float) and (not math.isfinite(v) or v != int(v)))), None)
        if bad is not None:
            raise PredictRequestError(f"{where}: {bad!r} is not an integer; the input is {spec.dtype} "
                                      f"(64-bit integers are narrowed to int32 in hloserve artifacts)")
        info = np.iinfo(dtype)
        ints = [int(v) for v in flat]
        out_of_range = next((v for v in ints if not info.min <= v <= info.max), None)
        if out_of_range is not None:
            raise PredictRequestError(f"{where}: {out_of_range} does not fit {spec.dtype} "
                                      f"[{info.min}, {info.max}]")
        return np.array(ints, dtype=dtype).reshape(raw.shape)
    return raw.astype(dtype)


def cast_array(arr: np.ndarray, spec: artifact.TensorSpec, where: str) -> np.ndarray:
    """A typed array (a gRPC TensorProto's) -> the spec's dtype: integers from integers in range (int64
    is narrowed to int32 like JSON numbers), booleans from booleans, floats from any real numbers."""
    dtype = artifact.numpy_dtype(spec.dtype)
    src = arr.dtype
    if src == dtype:
        return arr
    kind = "f" if src == ml_dtypes.bfloat16 else src.kind
    want = "f" if dtype == ml_dtypes.bfloat16 else dtype.kind
    sent = TF_TYPE_OF_NUMPY.get(src, str(src))
    if want in "iu" and kind in "iu":
        info = np.iinfo(dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            bad = arr[(arr < info.min) | (arr > info.max)].flat[0]
            raise PredictRequestError(f"{where}: {bad} does not fit {spec.dtype} [{info.min}, {info.max}]")
        return arr.astype(dtype)
    if want == "f" and kind in "iuf" or want == "c" and kind in "iufc":
        return arr.astype(dtype)
    raise PredictRequestError(f"{where}: a {sent} tensor cannot feed {spec.describe()}; send "
                              f"{TF_TYPE_OF_NUMPY.get(dtype, spec.dtype)}")


def _has_b64(value: Any) -> bool:
    if isinstance(value, Mapping):
        return "b64" in value
    if isinstance(value, list):
        return any(_has_b64(v) for v in value[:1])
    return False


def _json_value(arr: np.ndarray) -> Any:
    arr = np.asarray(arr)
    if arr.dtype.kind == "f" and arr.dtype.itemsize < 4 or arr.dtype.kind == "V" or str(arr.dtype) == "bfloat16":
        arr = arr.astype(np.float32)   # bf16/f16 as float32 values (exact)
    return arr.tolist()


def encode_predict_response(outputs: Mapping[str, Any], request: PredictRequest) -> dict[str, Any]:
    """The function's outputs -> the TF Serving response body for the request's form."""
    names = [n for n in request.output_names if n in outputs] or list(outputs)
    arrays = {n: np.asarray(outputs[n]) for n in names}
    if not request.row_format:
        if len(names) == 1:
            return {"outputs": _json_value(arrays[names[0]])}
        return {"outputs": {n: _json_value(a) for n, a in arrays.items()}}
    batch = {n: (a.shape[0] if a.ndim else None) for n, a in arrays.items()}
    if len(set(batch.values())) != 1 or None in batch.values():
        raise PredictRequestError(f"outputs {batch} do not share a leading batch dim, which the row form needs; "
                                  f"send the columnar 'inputs' form instead")
    if len(names) == 1:
        return {"predictions": _json_value(arrays[names[0]])}
    values = {n: _json_value(a) for n, a in arrays.items()}
    return {"predictions": [{n: values[n][i] for n in names} for i in range(next(iter(batch.values())))]}


def check_servable(svc: "PredictService", name: str, version: str | None) -> None:
    """404 in TF Serving's words unless `name` (and `version`, when given) is the servable served."""
    if name != svc.model_name:
        raise ApiError(404, f"Servable not found for request: Latest({name}); this server serves '{svc.model_name}'")
    if version is not None and version != str(svc.version):
        raise ApiError(404, f"Servable not found for request: Specific({name}, {version}); "
                            f"available version: {svc.version}")


async def run_predict(svc: "PredictService", function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Admit the request (503 while warming up or shutting down, 429 past --max-pending), run it through
    the batcher, release it; a runtime check that fails (a dim out of range) answers 400."""
    admit(svc)
    try:
        outs = await svc.batcher.run(function, inputs)
    except HloserveError as e:
        raise ApiError(400, str(e)) from None
    finally:
        svc.admission.leave()
    return {k: np.asarray(v) for k, v in outs.items()}


def model_status(svc: "PredictService") -> dict:
    """GetModelStatus's answer (AVAILABLE once warm, UNLOADING while shutting down)."""
    r = svc.readiness
    state = ("UNLOADING" if r.draining else "AVAILABLE" if r.ready else "END" if r.error else "LOADING")
    return {"model_version_status": [{"version": str(svc.version), "state": state,
                                      "status": {"error_code": "OK", "error_message": r.error or ""}}]}


def model_metadata(svc: "PredictService") -> dict:
    """GetModelMetadata's answer: the signature defs of every function, "serving_default" the first."""
    return {"model_spec": {"name": svc.model_name, "signature_name": "", "version": str(svc.version)},
            "metadata": {"signature_def": signature_defs(svc.model.manifest)}}


def signature_defs(manifest: artifact.Manifest) -> dict:
    """The SignatureDefMap, as TF Serving answers it (symbolic dims are -1)."""
    def tensors(specs):
        return {t.name: {"dtype": TF_TYPE_OF_NUMPY.get(artifact.numpy_dtype(t.dtype), "DT_INVALID"), "name": t.name,
                         "tensor_shape": {"dim": [{"size": str(d if isinstance(d, int) else -1), "name": ""}
                                                  for d in t.shape], "unknown_rank": False}} for t in specs}

    sigs = {}
    for name, fn in manifest.functions.items():
        sig = {"inputs": tensors(fn.inputs), "outputs": tensors(fn.outputs), "method_name": PREDICT_METHOD}
        sigs[name] = sig
        if name == default_function(manifest):
            sigs["serving_default"] = sig
    return {"signature_def": sigs}
