"""Start a real `hloserve serve` subprocess on 127.0.0.1 and wait until it is ready; transformers greedy reference."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(artifact: str | None, *args: str, ready_timeout: float = 600.0, env: dict | None = None,
                   log_dir: str | None = None):
    """Yields (base_url, process). The server's stderr goes to a log file shown on failure.

    artifact None runs `hloserve serve` without one (the default model, exported on first use).
    """
    port = free_port()
    log_dir = log_dir or (os.path.dirname(os.path.normpath(artifact)) if artifact else tempfile.gettempdir())
    log_path = os.path.join(log_dir, f"server-{port}.log")
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "hloserve.exporter.cli", "serve", *([artifact] if artifact else []), "--port", str(port),
           *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {ready_timeout}s:\n{open(log_path).read()[-4000:]}")
            time.sleep(0.5)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


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
