"""Graceful shutdown of a real server: SIGTERM while streams run."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support.launch import http

from .servers import metric, running_server

pytestmark = pytest.mark.slow


def _stream(base: str, results: list, i: int, started: threading.Semaphore | None = None) -> None:
    """One streaming completion; records (saw [DONE], last finish_reason or error, tokens) and
    releases `started` at its first chunk."""
    done, reason, chunks = False, None, 0
    try:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=120,
                          json={"model": "m", "prompt": [5 + i, 6, 7], "max_tokens": 200, "temperature": 0,
                                "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                body = json.loads(data)
                if "error" in body:
                    reason = "error: " + body["error"]["message"]
                elif body["choices"] and body["choices"][0]["finish_reason"]:
                    reason = body["choices"][0]["finish_reason"]
                chunks += 1
                if chunks == 1 and started is not None:
                    started.release()
    except httpx.HTTPError as e:
        reason = f"transport error: {type(e).__name__}"
    results[i] = (done, reason, chunks)


def _start_streams(base: str, n: int, running: int) -> tuple[list, list]:
    """n streams; returns once `running` of them have their first token and the others are queued
    (a signal sent then finds every request in the engine)."""
    results: list = [None] * n
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=_stream, args=(base, results, i, started)) for i in range(n)]
    for t in threads:
        t.start()
    for _ in range(running):
        assert started.acquire(timeout=120), "the streams never started"   # a hang detector
    deadline = time.monotonic() + 120   # a hang detector: every request reached the engine (queued, running or done)
    while True:
        text = http().get(f"{base}/metrics", timeout=30).text
        finished = sum(float(v) for v in re.findall(r"^vllm:request_success_total{[^}]*} (\S+)$", text, re.M))
        admitted = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting") + finished
        if admitted == n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert admitted == n, text
    return results, threads


@pytest.mark.parametrize("grace", ["0", "60"])
def test_sigterm_drains_running_streams_and_exits(tiny_chat_llm, tmp_path, grace):
    """20 long streams (8 running, 12 queued), SIGTERM: /ready answers 503 while they drain, every
    stream ends cleanly (its finish reason, or an error event saying the server shut down, then
    [DONE]) and the process exits cleanly (143). With no grace every running stream is ended; with a long one
    every stream finishes."""
    _, art = tiny_chat_llm
    with running_server(art, "--model-name", "m", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                        "--shutdown-grace", grace, log_dir=str(tmp_path)) as (base, proc):
        results, threads = _start_streams(base, 20, running=8)
        proc.send_signal(signal.SIGTERM)
        if grace != "0":   # the server is up until 12 queued x 200 tokens are generated
            assert httpx.get(f"{base}/ready", timeout=60).status_code == 503
        for t in threads:
            t.join(300)
        assert proc.wait(300) == 128 + signal.SIGTERM   # a clean close, then the conventional status
    for i, (done, reason, _) in enumerate(results):
        assert done and reason is not None, (i, results[i])
        assert reason == "length" or (grace == "0" and "shut down" in reason), (i, reason)
    if grace == "0":
        assert sum("shut down" in reason for _, reason, _ in results) >= 8, results


def test_a_non_streaming_client_that_leaves_is_aborted(tiny_chat_llm, tmp_path):
    """One sequence at a time, four long streams ahead: a non-streaming request waits, its client
    gives up, and the server aborts it (no token is generated for it), while the streams run on."""
    _, art = tiny_chat_llm
    with running_server(art, "--model-name", "m", "--max-num-seqs", "1", "--max-num-batched-tokens", "64",
                        log_dir=str(tmp_path)) as (base, proc):
        results, threads = _start_streams(base, 4, running=1)
        # queued behind 4 x 200 tokens, its client closes the connection right after sending it
        body = json.dumps({"model": "m", "prompt": [9, 9, 9], "max_tokens": 100, "ignore_eos": True}).encode()
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as leaver:
            leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        for t in threads:
            t.join(300)
        text = httpx.get(f"{base}/metrics", timeout=30).text
        aborted = [ln for ln in text.splitlines() if 'finished_reason="abort"' in ln]
        assert aborted and aborted[0].endswith(" 1"), aborted
        generated = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total")]
        assert generated and float(generated[0].split()[-1]) == 4 * 200, generated   # none for the leaver
    assert all(r[0] and r[1] == "length" for r in results), results


def test_large_requests_never_stall_health_and_the_output_cap_holds(tiny_chat_llm, tmp_path):
    """A 50 MB body is refused (413) and /health answers while it is still being sent; a
    100,000-message chat is refused (400); --max-output-tokens caps what a request may ask and what
    it gets by default."""
    _, art = tiny_chat_llm
    with running_server(art, "--model-name", "m", "--max-output-tokens", "8", log_dir=str(tmp_path)) as (base, _):
        host, port = base.removeprefix("http://").split(":")
        size = 50 << 20
        with socket.create_connection((host, int(port)), timeout=60) as upload:
            upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % size + b'{"model": "m", "prompt": "' + b"x" * (1 << 20))
            # mid-upload (1 of 50 MB sent): the server still answers everything else
            assert httpx.get(f"{base}/health", timeout=60).status_code == 200
            try:
                upload.sendall(b"x" * (size - (1 << 20) - 30))
            except OSError:
                pass   # refused and closed before the whole body arrived
            answer = upload.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        many = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 100_000})
        r = httpx.post(f"{base}/v1/chat/completions", content=many, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "more than 8192 messages" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{base}/health", timeout=60).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 9}, timeout=30)
        assert r.status_code == 400 and "limit of 8 tokens" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_sigint_during_warm_up_exits_with_one_line(tiny_chat_llm, tmp_path):
    """Ctrl-C while XLA compiles the buckets (empty compile cache): exit code 130 and one line, not an
    abort from a compile thread torn down under it."""
    import os

    from tests.support.launch import free_port
    _, art = tiny_chat_llm
    port = free_port()
    env = dict(os.environ, HLOSERVE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "hloserve.server.cli", "serve", art, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if http().get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 503   # still warming up
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, out[-2000:])
    assert "interrupted during warm-up" in out and "terminate called" not in out, out[-2000:]
