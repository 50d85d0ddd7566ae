"""What a Hugging Face model directory says beside its weights, as an artifact carries it:
the tokenizer files, the text spec (tokenizer, chat template, add_bos_token), the recommended sampling.

    files = {f: os.path.join(path, f) for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))}
    text = text_spec(path)                  # runtime/artifact/text.py's TextSpec, written as model["text"]
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
from hloserve.runtime.artifact.text import TOKENIZER, TextSpec

TOKENIZER_FILES = (TOKENIZER, "tokenizer_config.json", "special_tokens_map.json", GENERATION_CONFIG,
                   "chat_template.jinja")


def text_spec(path: str) -> TextSpec:
    """The text spec of the directory at `path`: its tokenizer.json (None: it has none), its chat
    template and tokenizer_config.json's add_bos_token (absent: the tokenizer's own post-processor
    decides, i.e. true)."""
    tc = os.path.join(path, "tokenizer_config.json")
    config = {}
    if os.path.exists(tc):
        with open(tc) as f:
            config = json.load(f)
    add_bos = config.get("add_bos_token")
    return TextSpec(tokenizer=TOKENIZER if os.path.exists(os.path.join(path, TOKENIZER)) else None,
                    chat_template=_chat_template(path, config), add_bos_token=True if add_bos is None else bool(add_bos))


def _chat_template(path: str, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The chat template of the directory at `path` (None: it has none): chat_template.jinja, else
    its `tokenizer_config` (tokenizer_config.json, read)'s."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja) as f:
            return f.read()
    tmpl = tokenizer_config.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
        tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), tmpl[0]["template"] if tmpl else None)
    return tmpl


def with_recommended(files: Mapping[str, str | bytes], recommended: Mapping[str, Any]) -> bytes:
    """generation_config.json for an artifact whose `files` (name -> path or bytes) may hold the
    checkpoint's own: the checkpoint's fields, with `recommended` sampling (a preset's, from its model
    card) where they are silent."""
    own = files.get(GENERATION_CONFIG)
    if isinstance(own, str):
        own = pathlib.Path(own).read_bytes()
    config = json.loads(own) if own else {}
    return json.dumps({"do_sample": True, **recommended, **config}, indent=2).encode()
