"""The one rule in front of every request, on a real `hloserve serve`: the API key on every route but
the probes (http/app.py's middleware; the gRPC server's interceptor), and request bodies read within
their budgets, bytes, chunks and a deadline, while the event loop keeps answering /health
(http/bodies.py). The routes and gRPC methods checked are enumerated from the application itself
(the FastAPI app's routes, the servicer's method table), so a route added later is checked too."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Iterable, Iterator

import httpx
import pytest

from tests.support.launch import free_port

from .servers import running_server

pytestmark = pytest.mark.slow
KEY = "sk-guard"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def llm_server(tiny_chat_llm, tmp_path_factory):
    _, art = tiny_chat_llm
    with running_server(art, "--model-name", "tiny-chat", "--api-key", KEY, "--max-body-mib", "1",
                        "--body-timeout", str(BODY_TIMEOUT_S), "--max-model-len", "128",
                        log_dir=str(tmp_path_factory.mktemp("guard-llm"))) as (base, _):
        yield base


@pytest.fixture(scope="module")
def predict_server(minilm_artifact, tmp_path_factory):
    """(REST base URL, gRPC target); /metrics behind the key too (--metrics-require-key)."""
    port = free_port()
    with running_server(minilm_artifact, "--model-name", "minilm", "--api-key", KEY, "--metrics-require-key",
                        "--grpc-port", str(port), "--body-timeout", str(BODY_TIMEOUT_S),
                        log_dir=str(tmp_path_factory.mktemp("guard-predict"))) as (base, _):
        yield base, f"127.0.0.1:{port}"


class HealthProbe:
    """Asks /health every 0.2 s on its own connection while the block runs; `latencies` holds
    each answer's seconds (inf for a failure)."""

    def __init__(self, base: str):
        self.base, self.latencies, self._stop = base, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    ok = client.get(f"{self.base}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.monotonic() - t if ok else float("inf"))
                self._stop.wait(0.2)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def raw_post(base: str, path: str, headers: dict[str, str], body: Iterable[bytes], *,
             pause_s: float = 0.0) -> tuple[int, dict[str, str], bytes, float]:
    """POST `body` (pieces sent as they come, `pause_s` apart) on a raw socket while reading the
    answer; (status, headers, body, seconds from the request's headers to the answer's end). The
    sender stops when the server closes the connection."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, **headers}.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
    start = time.monotonic()
    done = threading.Event()

    def send() -> None:
        try:
            for piece in body:
                if done.is_set():
                    return
                sock.sendall(piece)
                if pause_s:
                    done.wait(pause_s)
        except OSError:     # the server answered and closed the connection: what is being tested
            pass
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sock.settimeout(120)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    elapsed = time.monotonic() - start
    done.set()
    sock.close()
    sender.join(60)
    head, _, payload = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    return status, {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:])}, payload, elapsed


def one_byte_chunks(n: int, per_piece: int = 10_000) -> Iterator[bytes]:
    """A chunked body of `n` one-byte chunks, made as it is sent (n // per_piece pieces of 60 KB)."""
    piece = b"1\r\nx\r\n" * per_piece
    for _ in range(n // per_piece):
        yield piece
    yield b"0\r\n\r\n"


CHUNKED = {"Content-Type": "application/json", "Transfer-Encoding": "chunked", **AUTH}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_three_million_one_byte_chunks_are_refused_while_health_answers(llm_server, path):
    """The body that used to hold the event loop for 16 s (a 400 after it all was parsed): now the
    chunk budget refuses it as it arrives, and /health answers within a second throughout."""
    with HealthProbe(llm_server) as probe:
        time.sleep(0.5)
        status, headers, payload, elapsed = raw_post(llm_server, path, CHUNKED, one_byte_chunks(3_000_000))
        time.sleep(1.0)
    print(f"\n{path}: {status} after {elapsed:.2f} s; /health at most {max(probe.latencies):.3f} s "
          f"over {len(probe.latencies)} asks")
    assert status == 400 and elapsed < 5, (status, elapsed, payload[:300])
    assert headers.get("connection") == "close"
    error = json.loads(payload)["error"]                 # OpenAI's error object
    assert "chunks" in error["message"] and "--max-body-chunks" in error["message"], error
    assert len(probe.latencies) >= 5 and max(probe.latencies) < 1.0, probe.latencies
    r = httpx.post(f"{llm_server}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny-chat", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_dripping_body_is_cut_off_at_the_deadline_while_health_answers(llm_server):
    """One byte every 0.5 s of a body whose Content-Length promises 1,000: answered 408 once
    --body-timeout has passed (not before), while /health answers within a second."""
    headers = {"Content-Type": "application/json", "Content-Length": "1000", **AUTH}
    with HealthProbe(llm_server) as probe:
        status, answer_headers, payload, elapsed = raw_post(llm_server, "/v1/completions", headers,
                                                            (b"x" for _ in range(1000)), pause_s=0.5)
    assert status == 408, (status, payload[:300])
    assert BODY_TIMEOUT_S <= elapsed < BODY_TIMEOUT_S + 5, elapsed
    assert answer_headers.get("connection") == "close"
    assert "--body-timeout" in json.loads(payload)["error"]["message"]
    assert probe.latencies and max(probe.latencies) < 1.0, probe.latencies


def test_a_chunked_body_past_the_byte_budget_is_refused_as_it_arrives(llm_server):
    """--max-body-mib 1: a chunked body (no Content-Length to refuse it from) of 64 KiB chunks
    answers 413 once it passes 1 MiB; the sender is cut off long before its 64 MiB."""
    piece = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
    status, headers, payload, _ = raw_post(llm_server, "/v1/completions", CHUNKED, (piece for _ in range(1024)))
    assert status == 413 and headers.get("connection") == "close"
    assert "larger than 1048576 bytes" in json.loads(payload)["error"]["message"]


def test_predict_routes_refuse_in_tf_servings_format(predict_server):
    """The same budgets on TF Serving's REST API answer its own error body, {"error": "..."}."""
    base, _ = predict_server
    with HealthProbe(base) as probe:
        status, _, payload, elapsed = raw_post(base, "/v1/models/minilm:predict", CHUNKED, one_byte_chunks(3_000_000))
        drip = raw_post(base, "/v1/models/minilm:predict", {"Content-Length": "100", **AUTH},
                        (b"{" for _ in range(100)), pause_s=0.5)
    assert status == 400 and elapsed < 5
    assert isinstance(json.loads(payload)["error"], str) and "chunks" in json.loads(payload)["error"]
    assert drip[0] == 408 and isinstance(json.loads(drip[2])["error"], str)
    assert max(probe.latencies) < 1.0, probe.latencies


# -- one authentication rule ---------------------------------------------------------------------------

def _app_routes(artifact: str, **config) -> list[tuple[str, str]]:
    """(method, path with its parameters filled) of every route of the app `hloserve serve` builds
    for `artifact` (built here, in process, from the same code)."""
    from fastapi.routing import iter_route_contexts

    from hloserve.server.config import ServeConfig
    from hloserve.server.http.app import create_app
    from hloserve.server.services import build_service
    service = build_service(artifact, ServeConfig(**config))
    try:
        app = create_app(service, api_key=KEY)
        version = str(getattr(service, "version", 1))
        out = []
        for route in iter_route_contexts(app.routes):   # the included routers' routes as served
            path = route.path.replace("{name}", service.model_name).replace("{version}", version)
            out += [(method, path) for method in sorted(route.methods or ())]
    finally:
        service.close()
    assert not [p for _, p in out if "{" in p], out   # every parameter filled
    return out


def _check_every_route(base: str, routes: list[tuple[str, str]], open_paths: set[str], tf_format: set[str]) -> None:
    """Without the key every route but `open_paths` answers 401 (in TF Serving's error body on
    `tf_format` paths, OpenAI's elsewhere); with it, none does."""
    unprotected, locked = [], []
    for method, path in routes:
        bare = httpx.request(method, f"{base}{path}", timeout=60)
        keyed = httpx.request(method, f"{base}{path}", headers=AUTH, timeout=60)
        if keyed.status_code == 401:
            locked.append((method, path))
        if path in open_paths:
            assert bare.status_code != 401, (method, path)
            continue
        if bare.status_code != 401:
            unprotected.append((method, path, bare.status_code))
        elif method != "HEAD":
            error = bare.json()["error"]
            assert isinstance(error, str) if path in tf_format else error["type"] == "authentication_error", error
            assert bare.headers["www-authenticate"] == "Bearer"
    assert not unprotected, f"routes answering without the API key: {unprotected}"
    assert not locked, f"routes refusing the right key: {locked}"


def test_every_llm_route_but_the_probes_needs_the_key(llm_server, tiny_chat_llm):
    _, art = tiny_chat_llm
    routes = _app_routes(art, served_model_names=("tiny-chat",), num_blocks=8, max_model_len=128)
    assert {("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/openapi.json"),
            ("POST", "/v1/responses"), ("GET", "/v1/models/tiny-chat")} <= set(routes), routes
    _check_every_route(llm_server, routes, {"/health", "/ready", "/metrics"}, set())
    assert httpx.get(f"{llm_server}/no/such/route").status_code == 401   # nothing told without the key


def test_every_predict_route_needs_the_key_and_metrics_too_when_asked(predict_server, minilm_artifact):
    base, _ = predict_server
    routes = _app_routes(minilm_artifact, served_model_names=("minilm",))
    assert ("POST", "/v1/models/minilm:predict") in routes and ("POST", "/v1/embeddings") in routes
    _check_every_route(base, routes, {"/health", "/ready"}, {p for _, p in routes if p.startswith("/v1/models/")})
    assert httpx.get(f"{base}/metrics", headers=AUTH).status_code == 200


def test_every_grpc_method_needs_the_key(predict_server, minilm_artifact):
    """Each method of the servicer's table, called with an empty request: UNAUTHENTICATED without
    the key or with a wrong one, anything else with it; a method nobody serves is refused the same
    way before it is found missing."""
    import grpc

    from hloserve.server.grpc.tf_serving import TFServingServicer
    _, target = predict_server
    methods = [f"/{service}/{name}" for service, table in TFServingServicer(None, max_message_bytes=1).methods().items()
               for name in table]
    assert "/tensorflow.serving.PredictionService/Predict" in methods
    with grpc.insecure_channel(target) as channel:
        def code(method: str, metadata) -> grpc.StatusCode:
            try:
                channel.unary_unary(method)(b"", timeout=60, metadata=metadata)
            except grpc.RpcError as e:
                return e.code()
            return grpc.StatusCode.OK
        for method in methods + ["/tensorflow.serving.PredictionService/MultiInference"]:
            assert code(method, None) == grpc.StatusCode.UNAUTHENTICATED, method
            assert code(method, [("authorization", "Bearer wrong")]) == grpc.StatusCode.UNAUTHENTICATED, method
        for method in methods:
            assert code(method, [("authorization", f"Bearer {KEY}")]) != grpc.StatusCode.UNAUTHENTICATED, method


@pytest.mark.parametrize("flag", ["--max-body-mib", "--max-body-chunks", "--body-timeout"])
def test_a_body_budget_that_is_not_positive_is_refused_in_one_line(flag, capsys):
    """Checked where the flags are parsed (ServeConfig), before anything loads."""
    from hloserve.server.cli import main
    assert main(["serve", "no-such-artifact", flag, "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"hloserve: error: {flag} 0: give a positive limit", err
