"""vLLM's runtime LoRA adapter API for LLM services with adapter slots (an artifact exported with
--lora-slots): POST /v1/load_lora_adapter reads a PEFT directory into a free slot under a name, POST
/v1/unload_lora_adapter frees it (wire models: http/lora_protocol.py). A request then names the
adapter as its `model`; /v1/models lists it (http/models.py).

Both answer vLLM's plain-text success line; an adapter that cannot be served (rank above the
artifact's, projections it has no slots for, missing files, no free slot) answers 400 naming what
is wrong, an unknown name to unload 404. The files are read and the stacks placed on a worker
thread; steps already running keep the stacks they started with.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ..core.adapters import AdapterError
from ..services import LLMService
from .errors import ApiError
from .lora_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .prepare import parse_body

router = APIRouter()
BODIES = {"/v1/load_lora_adapter": LoadLoRAAdapterRequest, "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest}
ANSWERS: dict = {}     # plain text


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(request: Request):
    req = await parse_body(request, LoadLoRAAdapterRequest)
    svc: LLMService = request.app.state.service
    if req.lora_name in svc.model_names:
        raise ApiError(400, f"lora_name '{req.lora_name}' is the served model's name; choose another",
                       param="lora_name")
    try:
        await asyncio.to_thread(svc.runner.load_adapter, req.lora_name, req.lora_path)
    except AdapterError as e:
        raise ApiError(400, str(e), param="lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


# an unknown name to unload answers 404 (vLLM's), documented here: the schema adds 404 only to routes naming a model
_NOT_LOADED = {404: {"description": "no adapter of that name is loaded", "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}}


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_NOT_LOADED)
async def unload_lora_adapter(request: Request):
    req = await parse_body(request, UnloadLoRAAdapterRequest)
    svc: LLMService = request.app.state.service
    if req.lora_name not in svc.adapter_names:
        raise ApiError(404, f"LoRA adapter '{req.lora_name}' is not loaded (loaded: "
                            f"{', '.join(svc.adapter_names) or 'none'})", type_="not_found_error", param="lora_name")
    try:
        await asyncio.to_thread(svc.runner.unload_adapter, req.lora_name)
    except AdapterError as e:
        raise ApiError(400, str(e), param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
