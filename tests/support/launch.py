"""Run an HTTP server as a subprocess on loopback and wait until it answers (tests, benchmarks).

    with server_process([sys.executable, "-m", "hloserve.server.cli", "serve", ART, "--port", str(port)],
                        f"http://127.0.0.1:{port}/ready", log_path) as proc:
        ...   # the server answered 200 on the ready URL

The server's stdout and stderr go to `log_path`; a server that exits or is not ready within
`timeout` raises with the tail of that log. On exit it is terminated (killed after `grace` s).
"""
from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

if TYPE_CHECKING:
    import httpx


@functools.cache
def http() -> "httpx.Client":
    """One HTTP client for loops that poll a server: `httpx.get` builds a client, and loads its TLS
    certificates, on every call (~45 ms of CPU), which at a few polls a second takes a share of a
    core from the server being waited for. Per-call timeouts go to its methods (`timeout=`). It keeps
    no connection open between calls: servers come and go on reused ports."""
    import httpx
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: str, n: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


@contextlib.contextmanager
def server_process(cmd: Sequence[str], ready_url: str, log_path: str, *, timeout: float = 600.0,
                   env: dict | None = None, poll: float = 0.5, grace: float = 20.0,
                   on_ready: Callable[[float], None] | None = None) -> Iterator[subprocess.Popen]:
    """Start `cmd`, poll GET `ready_url` until it answers 200, yield the process, stop it on exit.

    env: extra environment variables (added to os.environ). on_ready gets the seconds it took.
    """
    import httpx

    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited with {proc.returncode} ({log_path}):\n{_log_tail(log_path)}")
                try:
                    if http().get(ready_url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"server not ready after {timeout:.0f} s ({log_path}):\n{_log_tail(log_path)}")
                time.sleep(poll)
            if on_ready is not None:
                on_ready(time.monotonic() - t0)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
