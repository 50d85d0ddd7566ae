"""Graceful shutdown of a real server: SIGTERM while streams run."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .servers import running_server

pytestmark = pytest.mark.slow


def _stream(base: str, results: list, i: int) -> None:
    """One streaming completion; records (saw [DONE], last finish_reason or error, tokens)."""
    done, reason, chunks = False, None, 0
    try:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
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
    except httpx.HTTPError as e:
        reason = f"transport error: {type(e).__name__}"
    results[i] = (done, reason, chunks)


def test_sigterm_drains_running_streams_and_exits_within_the_grace(tiny_chat_llm, tmp_path):
    """20 long streams, SIGTERM: /ready turns 503 at once, every stream ends cleanly (its finish
    reason, or an error event saying the server shut down, then [DONE]) and the process exits
    within the grace plus a margin."""
    _, art = tiny_chat_llm
    with running_server(art, "--model-name", "m", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                        "--shutdown-grace", "2", log_dir=str(tmp_path)) as (base, proc):
        results: list = [None] * 20
        threads = [threading.Thread(target=_stream, args=(base, results, i)) for i in range(20)]
        for t in threads:
            t.start()
        time.sleep(1.5)                                   # the streams are running (or queued)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(f"{base}/ready", timeout=5).status_code == 503
        for t in threads:
            t.join(30)
        proc.wait(30)
        exited = time.monotonic() - t0
    assert exited < 2 + 5, exited
    for i, (done, reason, _) in enumerate(results):
        assert done and reason is not None, (i, results[i])
        assert reason == "length" or "shut down" in reason, (i, reason)


def test_a_non_streaming_client_that_leaves_is_aborted_within_a_second(tiny_chat_llm, tmp_path):
    """One sequence at a time, four long streams ahead: a non-streaming request waits, its client
    gives up, and the server aborts it (freeing its slot) within a second, while the streams run on."""
    _, art = tiny_chat_llm
    with running_server(art, "--model-name", "m", "--max-num-seqs", "1", "--max-num-batched-tokens", "64",
                        log_dir=str(tmp_path)) as (base, proc):
        results: list = [None] * 4
        threads = [threading.Thread(target=_stream, args=(base, results, i)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{base}/v1/completions", timeout=0.3,
                       json={"model": "m", "prompt": [9, 9, 9], "max_tokens": 100, "ignore_eos": True})
        left = time.monotonic()
        aborted = None
        while time.monotonic() - left < 1.0:
            text = httpx.get(f"{base}/metrics", timeout=5).text
            aborted = [ln for ln in text.splitlines() if 'finished_reason="abort"' in ln]
            if aborted:
                break
            time.sleep(0.05)
        assert aborted and aborted[0].endswith(" 1"), aborted
        for t in threads:
            t.join(60)
    assert all(r[0] and r[1] == "length" for r in results), results


_PROBE = """
import json, sys, threading, time
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
seconds = []
with httpx.Client(timeout=5) as client:
    client.get(sys.argv[1])                      # the connection is set up before timing
    print("ready", flush=True)
    while not stop.is_set():
        t0 = time.monotonic()
        client.get(sys.argv[1])
        seconds.append(time.monotonic() - t0)
        time.sleep(0.02)
print(json.dumps(seconds))
"""


def test_large_requests_never_stall_health_and_the_output_cap_holds(tiny_chat_llm, tmp_path):
    """A 50 MB body and a 100,000-message chat are refused (413 / 400) while /health keeps answering
    within 100 ms; --max-output-tokens caps what a request may ask and what it gets by default."""
    _, art = tiny_chat_llm
    with running_server(art, "--model-name", "m", "--max-output-tokens", "8", log_dir=str(tmp_path)) as (base, _):
        big = b'{"model": "m", "prompt": "' + b"x" * (50 << 20) + b'"}'
        many = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 100_000})
        # The prober is its own process: in a thread here it would time this process's GIL (held while
        # httpx sends 50 MB), not the server.
        prober = subprocess.Popen([sys.executable, "-c", _PROBE, f"{base}/health"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert prober.stdout.readline().strip() == "ready"
            r = httpx.post(f"{base}/v1/completions", content=big, timeout=60,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 413
            r = httpx.post(f"{base}/v1/chat/completions", content=many, timeout=60,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "more than 8192 messages" in r.json()["error"]["message"], r.text
            time.sleep(0.3)                                # a few probes after them too
        finally:
            out, _ = prober.communicate("stop\n", timeout=30)
        worst = json.loads(out)
        assert len(worst) >= 5 and max(worst) < 0.1, worst
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
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
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
