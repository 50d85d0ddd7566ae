"""OpenAI's embeddings API (POST /v1/embeddings) for encoder artifacts with a sentence-transformers
pooling config: its route (wire model: http/embeddings_protocol.py). Tokenizing and pooling are
server/embeddings.py's; the encoder runs through the predict batcher."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import APIRouter, Request

from ..services import PredictService
from .errors import ApiError, admit, check_model
from .embeddings_protocol import EmbeddingRequest
from .protocol import now

router = APIRouter()
BODIES: dict = {}    # FastAPI parses and documents its body itself
ANSWERS: dict = {}


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request):
    svc: PredictService = request.app.state.service
    check_model(svc, req.model)
    emb = svc.embedder
    inputs = [req.input] if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)) \
        else list(req.input)
    admit(svc)
    try:
        try:
            arrays, tokens = await asyncio.to_thread(emb.encode, inputs)
        except ValueError as e:
            raise ApiError(400, str(e), param="input") from None
        hidden = (await svc.batcher.run(emb.function, arrays))["last_hidden_state"]
    finally:
        svc.admission.leave()
    vectors = emb.pool(hidden, arrays["attention_mask"])
    if req.dimensions is not None:
        if req.dimensions > vectors.shape[1]:
            raise ApiError(400, f"dimensions={req.dimensions} exceeds the model's {vectors.shape[1]}",
                           param="dimensions")
        vectors = vectors[:, :req.dimensions]
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64"
             else [float(x) for x in v]} for i, v in enumerate(np.asarray(vectors))]
    return {"object": "list", "data": data, "model": req.model, "created": now(),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
