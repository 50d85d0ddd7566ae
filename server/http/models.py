"""The model list (GET /v1/models, /v1/models/{name}) for LLM services: the names the model is served
under (--served-model-name), each as OpenAI's model object with vLLM's `root` and `max_model_len` and the
server's generation defaults, then the LoRA adapters loaded (vLLM's cards: `parent` the base model)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from ..services import LLMService
from .errors import check_model

router = APIRouter()
BODIES: dict = {}    # FastAPI documents these routes itself (no body, untyped answers)
ANSWERS: dict = {}


def model_card(svc: LLMService, name: str) -> dict:
    """OpenAI's Model object, with vLLM's `root` and `max_model_len` and the sampling defaults a
    request gets for the fields it leaves out (`generation_defaults`; {}: neutral)."""
    return {"id": name, "object": "model", "created": svc.created, "owned_by": "hloserve",
            "root": svc.model_names[0], "max_model_len": svc.max_model_len,
            "generation_defaults": svc.generation_defaults}


def adapter_card(svc: LLMService, name: str) -> dict | None:
    """A loaded LoRA adapter as vLLM lists it: `root` its directory, `parent` the base model (None
    when it was unloaded meanwhile)."""
    adapter = svc.runner.adapters.get(name) if svc.runner.adapters is not None else None
    if adapter is None:
        return None
    return {"id": name, "object": "model", "created": svc.created, "owned_by": "hloserve", "root": adapter.path,
            "parent": svc.model_names[0], "max_model_len": svc.max_model_len,
            "generation_defaults": svc.generation_defaults}


@router.get("/v1/models")
async def models(request: Request):
    svc: LLMService = request.app.state.service
    adapters = [card for n in svc.adapter_names if (card := adapter_card(svc, n)) is not None]
    return {"object": "list", "data": [model_card(svc, n) for n in svc.model_names] + adapters}


@router.get("/v1/models/{name}")
async def model(name: str, request: Request):
    svc: LLMService = request.app.state.service
    check_model(svc, name)
    return adapter_card(svc, name) or model_card(svc, name)
