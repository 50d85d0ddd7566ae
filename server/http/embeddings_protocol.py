"""Wire model of OpenAI's embeddings API (/v1/embeddings), served by http/embeddings.py."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, field_validator

from .protocol import OpenModel


class EmbeddingRequest(OpenModel):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _some(cls, v):
        if not v or (isinstance(v, list) and any(not x for x in v if isinstance(x, (str, list)))):
            raise ValueError("input is empty; send a string, a list of strings, or token ids")
        if isinstance(v, list) and len(v) > 2048:
            raise ValueError("at most 2048 inputs per request")
        return v
