"""`hloserve serve [ARTIFACT]`: build the service, start uvicorn, warm up in the background.

/health answers at once; /ready answers 503 until warm-up has compiled every
bucket (then the engine loop starts). With no ARTIFACT, the default model
(SmolLM2-135M-Instruct) is exported into the cache on first use — in a
subprocess, so the serving process itself never imports torch — with
DEFAULT_EXPORT_FLAGS: bf16 weight matrices and KV cache under f32 activations, the
form XLA:CPU serves fastest at the f32 model's perplexity (docs/performance.md).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading

from .config import ServeConfig
from .services import LLMService, build_service

DEFAULT_PRESET = "smollm2-135m-instruct"
# How the default model is exported, and the cache directory's suffix naming it (a cache
# written with other flags is never mistaken for this one).
DEFAULT_EXPORT_FLAGS = ("--weight-dtype", "bfloat16", "--kv-cache-dtype", "bfloat16")
DEFAULT_EXPORT_TAG = "bf16"
log = logging.getLogger("hloserve.server")


def default_artifact_path(preset: str = DEFAULT_PRESET) -> str:
    """Where `hloserve serve` keeps the default model's artifact (it may not exist yet)."""
    from hloserve.runtime.paths import cache_dir
    return os.path.join(cache_dir(), "artifacts", f"{preset}-{DEFAULT_EXPORT_TAG}")


def default_artifact(preset: str = DEFAULT_PRESET) -> str:
    """The default model's artifact, exported into the cache the first time."""
    path = default_artifact_path(preset)
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    print(f"[hloserve] first run: exporting {preset} to {path} (once; later starts reuse it)", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "hloserve.server.cli", "export", preset, "-o", path, *DEFAULT_EXPORT_FLAGS]
    if subprocess.run(cmd).returncode != 0:
        from hloserve.runtime.artifact.errors import HloserveError
        raise HloserveError(f"exporting the default model {preset} failed (see above); run `{' '.join(cmd[2:])}` to retry")
    return path


def serve(artifact_path: str | None, *, host: str = "127.0.0.1", port: int = 8000, config: ServeConfig | None = None,
          log_level: str = "info") -> None:
    import uvicorn

    from .http.app import create_app

    logging.basicConfig(level=logging.INFO, format="[hloserve] %(message)s")
    config = config or ServeConfig()
    if artifact_path is None and not config.served_model_names:   # the default model keeps its preset's name
        config = dataclasses.replace(config, served_model_names=(DEFAULT_PRESET,))
    path = artifact_path or default_artifact()
    print(f"[hloserve] loading {path}", file=sys.stderr, flush=True)
    service = build_service(path, config)
    app = create_app(service, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    def warm():
        print(f"[hloserve] warming up {service.model_name} (compiling every bucket; /ready says 503 until done)",
              file=sys.stderr, flush=True)
        if isinstance(service, LLMService):
            service.warmup(lambda msg: print(f"[hloserve] {msg}", file=sys.stderr, flush=True))
        else:
            service.warmup()
        state = "ready" if service.readiness.ready else service.readiness.error
        print(f"[hloserve] {service.model_name}: {state}", file=sys.stderr, flush=True)

    threading.Thread(target=warm, name="hloserve-warmup", daemon=True).start()
    print(f"[hloserve] serving {service.model_name} on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        service.close()
