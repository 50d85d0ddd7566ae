"""An LLM's recommended sampling: a generation_config.json, read as vLLM reads a checkpoint's.

An LLM artifact may carry `generation_config.json` beside its manifest (listed in
manifest["model"]["files"]): a Hugging Face directory's own, copied at export, or one the exporter
writes for a preset from its model card's recommendation. The server applies its sampling fields
where a request leaves them out (`hloserve serve --generation-config`); the other fields (token ids,
`do_sample`, ...) are not read, as vLLM reads none of them either (`get_diff_sampling_param`).

    config = read_generation_config(artifact_dir)   # {} when the directory has none
    defaults = sampling_fields(config)               # {"temperature": 0.2, "top_p": 0.9}
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from .errors import ArtifactError

GENERATION_CONFIG = "generation_config.json"
# the fields a server applies where a request is silent, under generation_config.json's names
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# Hugging Face's name -> the request field it is the default of (the rest keep their names)
REQUEST_NAMES = {"max_new_tokens": "max_tokens"}


def read_generation_config(path: str, *, required: bool = False) -> dict[str, Any]:
    """The JSON object in `path`: a file, or a directory's generation_config.json ({} when the
    directory has none, unless `required`). ArtifactError when it cannot be read or is no object."""
    file = os.path.join(path, GENERATION_CONFIG) if os.path.isdir(path) else path
    if not os.path.exists(file):
        if required or not os.path.isdir(path):
            raise ArtifactError(f"{file} does not exist; name a directory holding {GENERATION_CONFIG}, or the file")
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{file} is not readable JSON ({e}); fix or remove it") from None
    if not isinstance(config, dict):
        raise ArtifactError(f"{file} holds a JSON {type(config).__name__}, not an object of generation fields")
    return config


def sampling_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The request defaults a generation config gives: its SAMPLING_FIELDS that are set (not null),
    under the request's names (max_new_tokens -> max_tokens)."""
    return {REQUEST_NAMES.get(k, k): config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
