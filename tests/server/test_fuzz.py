"""Schema-driven fuzzing of every route of a real server (schemathesis on its published OpenAPI document).

Every operation gets bodies, paths and parameters generated from the schema (valid ones, and in
negative mode invalid ones), half of them naming the served model. For each answer: never a 5xx,
the status code and content type are the documented ones, and the body matches the documented
schema. Throughout, a prober in its own process keeps asking /health; afterwards the server still
answers a normal completion and holds no admission slot. A bounded run here
(HLOSERVE_FUZZ_EXAMPLES examples per operation and mode, default 25, the same cases every run); a
longer one is the same test with a larger value, drawn anew each run (docs/reliability.md).
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import checks

from .servers import running_server

pytestmark = pytest.mark.slow

MODEL = "tiny-chat"
PREDICT_ROUTES = {"POST /v1/models/{name}:predict", "GET /v1/models/{name}", "GET /v1/models/{name}/metadata"}
KEY = "sk-fuzz"
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance]

_PROBE = """
import json, sys, threading
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
answered, failed = 0, []
with httpx.Client(timeout=60) as client:   # 60 s: a hang detector, not a latency bound
    print("ready", flush=True)
    while not stop.is_set():
        try:
            r = client.get(sys.argv[1])
            answered += r.status_code == 200
            if r.status_code != 200:
                failed.append(r.status_code)
        except httpx.HTTPError as e:
            failed.append(type(e).__name__)
        stop.wait(0.05)
print(json.dumps({"answered": answered, "failed": failed}))
"""


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_llm, tmp_path_factory):
    _, art = tiny_chat_llm
    with running_server(art, "--model-name", MODEL, "--api-key", KEY, "--max-num-seqs", "4",
                        "--max-num-batched-tokens", "32", "--max-model-len", "128", "--max-output-tokens", "8",
                        "--max-pending", "64", log_dir=str(tmp_path_factory.mktemp("fuzz"))) as (base, _):
        yield base


def fuzz(base: str, model: str) -> tuple[collections.Counter, list[str], dict]:
    """Every operation of the server's /openapi.json, HLOSERVE_FUZZ_EXAMPLES examples per mode (half
    naming `model`), each answer checked against the document, while a prober asks /health.
    Returns (answers per (operation, status), failing answers, the prober's counts)."""
    examples = int(os.environ.get("HLOSERVE_FUZZ_EXAMPLES", "25"))
    derandomize = "HLOSERVE_FUZZ_EXAMPLES" not in os.environ   # the suite's bounded run draws the same cases
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    prober = subprocess.Popen([sys.executable, "-c", _PROBE, f"{base}/health"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert prober.stdout.readline().strip() == "ready"
    seen: collections.Counter = collections.Counter()
    failures: list[str] = []
    try:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in schemathesis.GenerationMode:
                @given(case=op.as_strategy(generation_mode=mode), served=st.booleans())
                @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
                          suppress_health_check=list(HealthCheck))
                def run(case, served):
                    if served and isinstance(case.body, dict) and "model" in case.body:
                        case.body["model"] = model
                    if served and case.path_parameters and "name" in case.path_parameters:
                        case.path_parameters["name"] = model
                    headers = {"Authorization": f"Bearer {KEY}"}
                    response = case.call(headers=headers, timeout=120)
                    seen[op.label, response.status_code] += 1
                    try:
                        case.validate_response(response, checks=CHECKS, headers=headers)
                    except Exception as e:  # noqa: BLE001 - collected: every failing operation is reported
                        failures.append(f"{op.label} ({mode.value}): {str(e)[:600]}")

                try:
                    run()
                except Unsatisfiable:   # negative mode of an operation with no inputs: nothing to make invalid
                    assert mode is schemathesis.GenerationMode.NEGATIVE
    finally:
        out, _ = prober.communicate("stop\n", timeout=120)
    print("\n" + "\n".join(f"{label} {status}: {n}" for (label, status), n in sorted(seen.items())))
    return seen, failures, json.loads(out)


def test_every_route_survives_schema_driven_fuzzing(fuzz_server):
    base = fuzz_server
    seen, failures, probes = fuzz(base, MODEL)
    assert not failures, f"{len(failures)} failing answers, e.g.:\n" + "\n\n".join(failures[:3])
    assert not any(status >= 500 for _, status in seen)
    assert probes["answered"] > 0 and not probes["failed"], probes
    # every route was reached past the model check, and the server still serves
    assert {label for label, status in seen if status not in (401, 404)} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /tokenize",
        "POST /detokenize"}, seen
    r = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    families = text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=60).text)
    in_flight = [s.value for f in families for s in f.samples if s.name == "hloserve:requests_in_flight"]
    assert in_flight == [0], in_flight   # every admission was released


@pytest.fixture(scope="module")
def predict_server(minilm_artifact, tmp_path_factory):
    with running_server(minilm_artifact, "--model-name", "minilm", "--api-key", KEY, "--max-batch-size", "8",
                        "--batch-timeout-ms", "5", "--max-pending", "64",
                        log_dir=str(tmp_path_factory.mktemp("fuzz-predict"))) as (base, _):
        yield base


def test_every_predict_route_survives_schema_driven_fuzzing(predict_server):
    """The same on a predict artifact's server (TF Serving's REST API, /v1/embeddings): never a 5xx,
    answers as documented, /health answered throughout; afterwards a real predict is answered."""
    base = predict_server
    seen, failures, probes = fuzz(base, "minilm")
    assert not failures, f"{len(failures)} failing answers, e.g.:\n" + "\n\n".join(failures[:3])
    assert not any(status >= 500 for _, status in seen)
    assert probes["answered"] > 0 and not probes["failed"], probes
    assert {label for label, status in seen if status not in (401, 404)} >= PREDICT_ROUTES, seen
    r = httpx.post(f"{base}/v1/models/minilm:predict", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"instances": [{"input_ids": [101, 7592, 102], "attention_mask": [1, 1, 1],
                                        "token_type_ids": [0, 0, 0]}]})
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1, r.text
