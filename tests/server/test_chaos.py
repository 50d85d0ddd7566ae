"""Fixed points of benchmarks/chaos.py on the tiny Llama of conftest.py: a server SIGKILLed during
warm-up or while streaming recovers on the same cache root, and a planted executable-cache entry
is never unpickled.

A module fixture starts the server once on a fresh cache root (kernels built, every bucket
compiled and written to CACHE/xla) and records the greedy text of a few prompts; each test works on
a copy of that cache root. Every wait is on a condition (/health, /ready, the cache's files, the
first streamed chunk), never on a timer; the timeouts are hang detectors.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support.launch import free_port, http

from .servers import running_server

pytestmark = pytest.mark.slow

MODEL = "tiny-chat"
SERVER_ARGS = ("--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--max-model-len", "256",
               "--model-name", MODEL)
PROMPTS = ("The capital of France is", "Once upon a time, in a harbour town,")
HANG = 300.0     # seconds: a hang detector, not a speed bound


def greedy_texts(base: str) -> list[str]:
    """The greedy completion (24 tokens, EOS ignored) of each of PROMPTS, one at a time."""
    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{base}/v1/completions", timeout=HANG, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def executables(cache: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache, "xla", "executables", "*.xla")))


def status(base: str, path: str) -> int | None:
    try:
        return http().get(base + path, timeout=5).status_code
    except httpx.HTTPError:
        return None


def wait_until(cond, proc: subprocess.Popen, what: str) -> None:
    """Poll `cond()` until it holds; the server must stay up meanwhile."""
    deadline = time.monotonic() + HANG
    while not cond():
        assert proc.poll() is None, f"the server exited with {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"{what}: not within {HANG:.0f} s"
        time.sleep(0.05)


@contextlib.contextmanager
def launched(art: str, cache: str, log_path: str):
    """`hloserve serve` on `cache`, not waited for; yields (base URL, process); killed on exit if alive."""
    port = free_port()
    cmd = [sys.executable, "-m", "hloserve.server.cli", "serve", art, "--port", str(port), *SERVER_ARGS]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HLOSERVE_CACHE": cache})
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(HANG) == -signal.SIGKILL


@pytest.fixture(scope="module")
def reference(tiny_chat_llm, tmp_path_factory):
    """(artifact, a cache root one clean start filled, the greedy texts of that start)."""
    _, art = tiny_chat_llm
    root = tmp_path_factory.mktemp("chaos")
    cache = str(root / "cache")
    with running_server(art, *SERVER_ARGS, env={"HLOSERVE_CACHE": cache}, log_dir=str(root)) as (base, _):
        texts = greedy_texts(base)
    assert executables(cache), "the clean start wrote no executable to the cache"
    return art, cache, texts


def copy_cache(reference_cache: str, tmp_path) -> str:
    cache = str(tmp_path / "cache")
    shutil.copytree(reference_cache, cache, symlinks=True)
    return cache


def test_sigkill_during_warmup_then_restart_serves_the_same_text(reference, tmp_path):
    art, ref_cache, want = reference
    cache = copy_cache(ref_cache, tmp_path)
    shutil.rmtree(os.path.join(cache, "xla"))          # every bucket compiles again
    log = str(tmp_path / "killed.log")
    with launched(art, cache, log) as (base, proc):
        # partway through warm-up: the server answers, has written an executable, is not ready
        wait_until(lambda: status(base, "/health") == 200 and executables(cache), proc, "the first compiled bucket")
        assert status(base, "/ready") == 503
        sigkill(proc)
    with open(log) as f:
        assert "warm-up compiled" not in f.read(), "the kill came after warm-up"
    with running_server(art, *SERVER_ARGS, env={"HLOSERVE_CACHE": cache}, log_dir=str(tmp_path),
                        ready_timeout=HANG) as (base, _):
        assert greedy_texts(base) == want


def test_sigkill_while_streaming_then_restart_serves_the_same_text(reference, tmp_path):
    art, ref_cache, want = reference
    cache = copy_cache(ref_cache, tmp_path)
    n = 8
    started = threading.Semaphore(0)
    ended: list[str] = []

    def stream(base: str, i: int) -> None:
        try:
            with httpx.stream("POST", f"{base}/v1/completions", timeout=HANG, json={
                    "model": MODEL, "prompt": f"Stream {i}: a long story", "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                first = True
                for line in r.iter_lines():
                    if line.startswith("data: ") and first:
                        started.release()
                        first = False
                    if line == "data: [DONE]":
                        ended.append("done")
                        return
            ended.append("closed without [DONE]")
        except httpx.HTTPError as e:
            ended.append(type(e).__name__)

    with launched(art, cache, str(tmp_path / "killed.log")) as (base, proc):
        wait_until(lambda: status(base, "/ready") == 200, proc, "ready")
        threads = [threading.Thread(target=stream, args=(base, i)) for i in range(n)]
        for t in threads:
            t.start()
        for _ in range(n):
            assert started.acquire(timeout=HANG), "the streams never started"
        sigkill(proc)
        for t in threads:
            t.join(HANG)
    assert len(ended) == n and ended.count("done") < n, ended      # the kill cut streams off
    with running_server(art, *SERVER_ARGS, env={"HLOSERVE_CACHE": cache}, log_dir=str(tmp_path),
                        ready_timeout=HANG) as (base, _):
        assert greedy_texts(base) == want


class _Planted:
    """Unpickling it calls open(path, "w"): it creates the file at `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_executable_cache_entry_whose_unpickling_would_run_code_is_never_unpickled(reference, tmp_path):
    art, ref_cache, want = reference
    cache = copy_cache(ref_cache, tmp_path)
    entries = executables(cache)
    assert entries
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Planted(str(probe)))).close()   # the payload is live: unpickling creates its file
    assert probe.exists()
    marker = tmp_path / "marker"
    payload = pickle.dumps(_Planted(str(marker)))
    for path in entries:
        with open(path, "wb") as f:
            f.write(payload)
    logs = tmp_path / "logs"
    logs.mkdir()
    with running_server(art, *SERVER_ARGS, env={"HLOSERVE_CACHE": cache}, log_dir=str(logs),
                        ready_timeout=HANG) as (base, _):
        assert greedy_texts(base) == want
    assert not marker.exists(), "a cache entry was unpickled"
    (log,) = glob.glob(str(logs / "server-*.log"))
    with open(log) as f:
        assert f.read().count("executable cache entry") >= len(entries)     # each planted entry refused
    for path in entries:                                                    # and rewritten by its recompile
        with open(path, "rb") as f:
            assert f.read(1) == b"{", path
