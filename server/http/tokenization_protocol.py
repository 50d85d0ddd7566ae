"""Wire models of vLLM's tokenization API (/tokenize, /detokenize), served by http/tokenization.py."""
from __future__ import annotations

from .chat_protocol import ChatMessage
from .protocol import OpenModel


class TokenizeRequest(OpenModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenModel):
    model: str | None = None
    tokens: list[int]
