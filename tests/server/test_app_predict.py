"""The real server with the real all-MiniLM-L6-v2 artifact: TF Serving's REST predict API over HTTP.

Answers are compared with the PJRT runtime on the same inputs (the runtime itself is compared
with torch eager in tests/exporter/test_minilm.py). Request bodies are the documented ones
in deploy/tf_serving/requests/.
"""
from __future__ import annotations

import concurrent.futures
import glob
import json
import os

import httpx
import numpy as np
import pytest

from tests.support.launch import http

from .servers import running_server

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
BODIES = sorted(glob.glob(os.path.join(REPO, "deploy", "tf_serving", "requests", "*.json")))


@pytest.fixture(scope="module")
def server(minilm_artifact):
    with running_server(minilm_artifact, "--model-name", "minilm", "--max-batch-size", "16",
                        "--batch-timeout-ms", "50") as (base, _):
        yield base


@pytest.fixture(scope="module")
def runtime_model(minilm_artifact):
    from hloserve import runtime
    return runtime.load(minilm_artifact, cache_dir=None)


def expected(runtime_model, inputs: dict) -> np.ndarray:
    return np.asarray(runtime_model.functions["forward"](**inputs)["last_hidden_state"])


@pytest.mark.parametrize("path", BODIES, ids=os.path.basename)
def test_documented_bodies_answered_like_the_runtime(server, runtime_model, path):
    body = json.load(open(path))
    r = httpx.post(f"{server}/v1/models/minilm:predict", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if "instances" in body:
        inst = body["instances"]
        inputs = {k: np.array([i[k] for i in inst]) for k in inst[0]}
        got = np.array(r.json()["predictions"])
    else:
        inputs = {k: np.array(v) for k, v in body["inputs"].items()}
        got = np.array(r.json()["outputs"])
    np.testing.assert_allclose(got, expected(runtime_model, inputs), atol=1e-5)


def test_versioned_route_status_and_metadata(server):
    ids = [[101, 7592, 2088, 102]]
    body = {"inputs": {"input_ids": ids, "attention_mask": [[1] * 4], "token_type_ids": [[0] * 4]}}
    assert httpx.post(f"{server}/v1/models/minilm/versions/1:predict", json=body, timeout=60).status_code == 200
    assert httpx.post(f"{server}/v1/models/minilm/versions/2:predict", json=body, timeout=60).status_code == 404
    st = httpx.get(f"{server}/v1/models/minilm").json()
    assert st["model_version_status"][0]["state"] == "AVAILABLE"
    meta = httpx.get(f"{server}/v1/models/minilm/metadata").json()
    sig = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sig["inputs"]["input_ids"]["dtype"] == "DT_INT32"
    assert [d["size"] for d in sig["outputs"]["last_hidden_state"]["tensor_shape"]["dim"]] == ["-1", "-1", "384"]


def test_concurrent_requests_are_batched(server, runtime_model):
    rng = np.random.default_rng(0)
    rows = [rng.integers(1000, 29000, (1, 9)) for _ in range(12)]

    def call(ids):
        body = {"inputs": {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist(),
                           "token_type_ids": np.zeros_like(ids).tolist()}}
        return httpx.post(f"{server}/v1/models/minilm:predict", json=body, timeout=120).json()["outputs"]

    before = _metric(server, "hloserve:predict_batches_total")
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(call, rows))
    batches = _metric(server, "hloserve:predict_batches_total") - before
    assert batches < len(rows), "12 concurrent requests should share batches"
    for ids, out in zip(rows, outs):
        x = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        np.testing.assert_allclose(np.array(out), expected(runtime_model, x), atol=1e-5)


def _metric(base, name) -> float:
    """One sample's value, read through prometheus_client's parser (a malformed /metrics fails here)."""
    from .test_app_llm import parse_metrics
    for fam in parse_metrics(http().get(f"{base}/metrics").text).values():
        for sample in fam.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} missing from /metrics")


@pytest.mark.parametrize("body,fragment", [
    ("{nope", "malformed JSON"),
    ({"instances": [{"input_ids": [1, 2]}], "inputs": {}}, "instances"),
    ({"inputs": {"input_ids": [[1, 2]], "attention_mask": [[1, 1]]}}, "token_type_ids"),
    ({"inputs": {"input_ids": [[1.5, 2]], "attention_mask": [[1, 1]], "token_type_ids": [[0, 0]]}}, "input_ids"),
    ({"inputs": {"input_ids": [[1] * 600], "attention_mask": [[1] * 600], "token_type_ids": [[0] * 600]}},
     "seq = 600 is outside its range [1, 512]"),
])
def test_bad_predict_requests_answer_400_in_tf_serving_format(server, body, fragment):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server}/v1/models/minilm:predict", content=data, timeout=60)
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["error"], str) and fragment in r.json()["error"]
    assert httpx.get(f"{server}/health").status_code == 200


def test_unknown_model_is_404(server):
    r = httpx.post(f"{server}/v1/models/bert:predict", json={"inputs": {}}, timeout=10)
    assert r.status_code == 404 and "Servable not found" in r.json()["error"]


def test_embeddings_equal_sentence_transformers_pooling(server, minilm_dir):
    """/v1/embeddings through the openai SDK: mean pooling over the mask and L2 normalization, as the
    checkpoint's sentence-transformers modules say, of transformers' own outputs (cosine >= 0.999)."""
    import openai
    import torch
    import transformers
    texts = ["The capital of France is Paris.", "A cat sat on the mat, looking at nothing in particular.", "hi"]
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    r = c.embeddings.create(model="minilm", input=texts)
    got = np.array([d.embedding for d in r.data])
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"][..., None].float()
    want = ((h * m).sum(1) / m.sum(1)).numpy()
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.shape == (3, 384) and cos.min() >= 0.999, cos
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert r.usage.prompt_tokens == int(batch["attention_mask"].sum())
    one = c.embeddings.create(model="minilm", input=texts[0], encoding_format="base64")
    assert len(one.data) == 1


def test_embeddings_of_token_ids_outside_the_vocabulary_answer_400(server):
    """Token ids the vocabulary does not have (schemathesis sent 2**90: 500 once) answer 400 in
    OpenAI's format naming the id; the server keeps serving."""
    for ids in ([[101, 888407928238200012863073943552, 102]], [101, -1], [[30522]]):
        r = httpx.post(f"{server}/v1/embeddings", json={"model": "minilm", "input": ids}, timeout=30)
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server}/v1/embeddings", json={"model": "minilm", "input": [[101, 30521, 102]]}, timeout=30)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384, r.text


def test_published_schema_answers_400_in_tf_serving_format(server):
    import jsonschema
    doc = httpx.get(f"{server}/openapi.json", timeout=30).json()
    assert "422" not in json.dumps(doc)
    op = doc["paths"]["/v1/models/{name}:predict"]["post"]
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/TFServingError")
    r = httpx.post(f"{server}/v1/models/minilm:predict", content=b"{", timeout=30)
    assert r.status_code == 400
    jsonschema.validate(r.json(), {"$ref": "#/components/schemas/TFServingError", "components": doc["components"]})
