"""Start a real `hloserve serve` subprocess on 127.0.0.1 and wait until it is ready; transformers greedy reference."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile

from tests.support.launch import free_port, server_process


@contextlib.contextmanager
def running_server(artifact: str | None, *args: str, ready_timeout: float = 600.0, env: dict | None = None,
                   log_dir: str | None = None):
    """Yields (base_url, process). The server's output goes to a log file shown on failure.

    artifact None runs `hloserve serve` without one (the default model, exported on first use). The gRPC
    API is off unless `--grpc-port` is among the args (a predict server would otherwise take port 8500).
    """
    port = free_port()
    log_dir = log_dir or (os.path.dirname(os.path.normpath(artifact)) if artifact else tempfile.gettempdir())
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hloserve.server.cli", "serve", *([artifact] if artifact else []), "--port", str(port),
           *args, *(() if "--grpc-port" in args else ("--grpc-port", "0"))]
    with server_process(cmd, f"{base}/ready", os.path.join(log_dir, f"server-{port}.log"), timeout=ready_timeout,
                        env=env) as proc:
        yield base, proc


def with_chat_template(artifact: str, template: str, directory: str) -> str:
    """A copy of `artifact` under `directory` whose manifest carries `template` as its chat template
    (in its text spec, model["text"])."""
    from hloserve.runtime.artifact import Manifest, TextSpec
    copy = os.path.join(directory, "art")
    shutil.copytree(artifact, copy)
    with open(f"{copy}/manifest.json") as f:
        manifest = json.load(f)
    text = TextSpec.of(Manifest.from_json(manifest), copy)
    manifest["model"]["text"] = dataclasses.replace(text, chat_template=template).to_json()
    with open(f"{copy}/manifest.json", "w") as f:
        json.dump(manifest, f)
    return copy


def hf_greedy(hf, ids, n):
    """n greedy tokens from transformers (full recompute each step, no cache)."""
    import torch
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(torch.argmax(hf(torch.tensor([ids])).logits[0, -1]))
            ids.append(tok)
            out.append(tok)
    return out


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-by-bucket Prometheus sample `name{...} value`."""
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"metric {name} missing from /metrics"
    return float(m.group(1))


def runners_in_budget(artifacts: dict[str, str], budget: int) -> dict:
    """Per KV cache dtype, the model runner `hloserve serve --kv-cache-mib` would build from the
    artifact at that path in `budget` bytes of KV cache (no server: the sizing alone)."""
    from hloserve.runtime.artifact import LLMArtifact
    from hloserve.server.config import ServeConfig
    from hloserve.server.core.model_runner import ModelRunner

    runners = {}
    for kv, path in artifacts.items():
        art = LLMArtifact.read(path)
        _, runner_cfg, _ = ServeConfig(kv_cache_bytes=budget).resolve(art.llm)
        runners[kv] = ModelRunner.from_artifact(art, runner_cfg)
    return runners
