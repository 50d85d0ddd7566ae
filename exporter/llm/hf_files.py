"""What a Hugging Face model directory says beside its weights, as an LLM artifact carries it:
the tokenizer files, the chat template, the recommended sampling.

    files = {f: os.path.join(path, f) for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))}
    template = chat_template(path)          # chat_template.jinja, or tokenizer_config.json's
    defaults = generation_defaults(path)    # generation_config.json's sampling, when it samples
"""
from __future__ import annotations

import json
import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def chat_template(path: str) -> str | None:
    """The chat template of the directory at `path` (None: it has none)."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja) as f:
            return f.read()
    tc = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(tc):
        with open(tc) as f:
            tmpl = json.load(f).get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), tmpl[0]["template"] if tmpl else None)
        return tmpl
    return None


# sampling fields of generation_config.json a server applies when a request leaves them out (vLLM does the same)
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(path: str) -> dict[str, float]:
    """The checkpoint's recommended sampling (generation_config.json), only when it samples (do_sample)."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            gen = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    if not gen.get("do_sample", False):
        return {}
    return {k: gen[k] for k in GENERATION_FIELDS if isinstance(gen.get(k), (int, float))}
