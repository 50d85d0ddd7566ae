"""TensorFlow Serving's REST API for predict services: :predict (row and columnar bodies), model
status and metadata, with and without /versions/N. Handlers read their service from `request.app.state`."""
from __future__ import annotations

import json

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from hloserve.runtime.artifact.errors import HloserveError

from ..services import PredictService
from .errors import ApiError, admit
from .tf_serving_protocol import PredictRequestError, decode_predict_request, default_function, encode_predict_response

router = APIRouter()


def _svc(request: Request) -> PredictService:
    return request.app.state.service


def _checked(request: Request, name: str, version: str | None) -> PredictService:
    """The service, if it is the servable the path names (404 in TF Serving's words otherwise)."""
    svc = _svc(request)
    check(svc, name, version)
    return svc


def check(svc: PredictService, name: str, version: str | None) -> None:
    if name != svc.model_name:
        raise ApiError(404, f"Servable not found for request: Latest({name}); this server serves '{svc.model_name}'")
    if version is not None and version != str(svc.version):
        raise ApiError(404, f"Servable not found for request: Specific({name}, {version}); "
                            f"available version: {svc.version}")


async def predict(name: str, version: str | None, request: Request):
    svc = _checked(request, name, version)
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    try:
        req = decode_predict_request(body, svc.model.manifest)
    except PredictRequestError as e:
        raise ApiError(400, str(e)) from None
    admit(svc)
    try:
        outs = await svc.batcher.run(req.function, req.inputs)
    except HloserveError as e:
        raise ApiError(400, str(e)) from None
    finally:
        svc.admission.leave()
    return JSONResponse(encode_predict_response({k: np.asarray(v) for k, v in outs.items()}, req))


@router.post("/v1/models/{name}:predict")
async def predict_latest(name: str, request: Request):
    return await predict(name, None, request)


@router.post("/v1/models/{name}/versions/{version}:predict")
async def predict_version(name: str, version: str, request: Request):
    return await predict(name, version, request)


def status(svc: PredictService) -> dict:
    state = "AVAILABLE" if svc.readiness.ready else ("END" if svc.readiness.error else "LOADING")
    return {"model_version_status": [{"version": str(svc.version), "state": state,
                                      "status": {"error_code": "OK", "error_message": svc.readiness.error or ""}}]}


@router.get("/v1/models/{name}")
@router.get("/v1/models/{name}/versions/{version}")
async def model_status(name: str, request: Request, version: str | None = None):
    return status(_checked(request, name, version))


def metadata(svc: PredictService) -> dict:
    return {"model_spec": {"name": svc.model_name, "signature_name": "", "version": str(svc.version)},
            "metadata": {"signature_def": _signature_defs(svc.model.manifest)}}


@router.get("/v1/models/{name}/metadata")
@router.get("/v1/models/{name}/versions/{version}/metadata")
async def model_metadata(name: str, request: Request, version: str | None = None):
    return metadata(_checked(request, name, version))


_TF_DTYPES = {"f32": "DT_FLOAT", "f16": "DT_HALF", "bf16": "DT_BFLOAT16", "i32": "DT_INT32", "i16": "DT_INT16",
              "i8": "DT_INT8", "u8": "DT_UINT8", "bool": "DT_BOOL", "u32": "DT_UINT32"}


def _signature_defs(manifest) -> dict:
    """GetModelMetadata's signature_def map, as TF Serving answers it (symbolic dims are -1)."""
    def tensors(specs):
        return {t.name: {"dtype": _TF_DTYPES.get(t.dtype, "DT_INVALID"), "name": t.name,
                         "tensor_shape": {"dim": [{"size": str(d if isinstance(d, int) else -1), "name": ""}
                                                  for d in t.shape], "unknown_rank": False}} for t in specs}

    sigs = {}
    for name, fn in manifest.functions.items():
        sig = {"inputs": tensors(fn.inputs), "outputs": tensors(fn.outputs), "method_name": "tensorflow/serving/predict"}
        sigs[name] = sig
        if name == default_function(manifest):
            sigs["serving_default"] = sig
    return {"signature_def": sigs}
