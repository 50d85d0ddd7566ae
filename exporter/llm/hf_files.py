"""What a Hugging Face model directory says beside its weights, as an LLM artifact carries it:
the tokenizer files, the chat template, the recommended sampling.

    files = {f: os.path.join(path, f) for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))}
    template = chat_template(path)          # chat_template.jinja, or tokenizer_config.json's
    files[GENERATION_CONFIG] = with_recommended(files, {"temperature": 0.2})   # a preset's model card

generation_config.json travels into the artifact as it is; the server reads its sampling fields
(runtime/artifact/generation.py), so every source's defaults reach the server by that one file.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping

from hloserve.runtime.artifact.generation import GENERATION_CONFIG

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", GENERATION_CONFIG,
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


def with_recommended(files: Mapping[str, str | bytes], recommended: Mapping[str, Any]) -> bytes:
    """generation_config.json for an artifact whose `files` (name -> path or bytes) may hold the
    checkpoint's own: the checkpoint's fields, with `recommended` sampling (a preset's, from its model
    card) where they are silent."""
    own = files.get(GENERATION_CONFIG)
    if isinstance(own, str):
        own = pathlib.Path(own).read_bytes()
    config = json.loads(own) if own else {}
    return json.dumps({"do_sample": True, **recommended, **config}, indent=2).encode()
