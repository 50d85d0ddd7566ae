"""TensorFlow Serving's REST API for predict services: :predict (row and columnar bodies), model
status and metadata, with and without /versions/N. Handlers read their service from `request.app.state`;
the servable semantics and the body <-> array conversion are server/predict.py's, shared with the gRPC API."""
from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..predict import PredictRequestError, check_servable, decode_predict_request, encode_predict_response
from ..predict import model_metadata as metadata_of
from ..predict import model_status as status_of
from ..predict import run_predict
from ..services import PredictService
from .errors import ApiError

router = APIRouter(tags=["tf-serving"])   # the tag gives its routes TF Serving's error body in /openapi.json
BODIES: dict = {}    # its bodies are TF Serving's JSON (server/predict.py), not a pydantic model
ANSWERS: dict = {}


def _checked(request: Request, name: str, version: str | None) -> PredictService:
    """The service, if it is the servable the path names (404 in TF Serving's words otherwise)."""
    svc = request.app.state.service
    check_servable(svc, name, version)
    return svc


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
    outs = await run_predict(svc, req.function, req.inputs)
    return JSONResponse(encode_predict_response(outs, req))


@router.post("/v1/models/{name}:predict")
async def predict_latest(name: str, request: Request):
    return await predict(name, None, request)


@router.post("/v1/models/{name}/versions/{version}:predict")
async def predict_version(name: str, version: str, request: Request):
    return await predict(name, version, request)


@router.get("/v1/models/{name}")
@router.get("/v1/models/{name}/versions/{version}")
async def model_status(name: str, request: Request, version: str | None = None):
    return status_of(_checked(request, name, version))


@router.get("/v1/models/{name}/metadata")
@router.get("/v1/models/{name}/versions/{version}/metadata")
async def model_metadata(name: str, request: Request, version: str | None = None):
    return metadata_of(_checked(request, name, version))
