"""Wire models of vLLM's LoRA adapter API (/v1/load_lora_adapter, /v1/unload_lora_adapter), served by
http/lora.py."""
from __future__ import annotations

from .protocol import OpenModel


class LoadLoRAAdapterRequest(OpenModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenModel):
    lora_name: str
