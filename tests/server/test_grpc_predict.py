"""TF Serving's gRPC API of a real `hloserve serve` (all-MiniLM-L6-v2) through tensorflow-serving-api's
own stubs: the same answers as the REST API of the same server, TF Serving's status codes for bad
requests (the server keeps serving), the docs' client example, and SIGTERM draining a gRPC call."""
from __future__ import annotations

import os
import re
import signal
import threading

import httpx
import numpy as np
import pytest

from tests.support.launch import free_port

from .servers import running_server

pytestmark = pytest.mark.slow
DOCS_API = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "api.md")


@pytest.fixture(scope="module")
def tfs():
    """TensorFlow and tensorflow-serving-api's modules (imported once, here: they take seconds)."""
    import types

    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                         model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc)
    return types.SimpleNamespace(grpc=grpc, tf=tf, predict_pb2=predict_pb2, meta_pb2=get_model_metadata_pb2,
                                 status_pb2=get_model_status_pb2, classification_pb2=classification_pb2,
                                 prediction=prediction_service_pb2_grpc, models=model_service_pb2_grpc)


@pytest.fixture(scope="module")
def server(minilm_artifact, tmp_path_factory):
    """(REST base URL, gRPC target); message bodies bounded at 1 MiB."""
    port = free_port()
    with running_server(minilm_artifact, "--model-name", "minilm", "--grpc-port", str(port), "--max-body-mib", "1",
                        log_dir=str(tmp_path_factory.mktemp("grpc-server"))) as (base, _):
        yield base, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stubs(server, tfs):
    channel = tfs.grpc.insecure_channel(server[1])
    yield tfs.prediction.PredictionServiceStub(channel), tfs.models.ModelServiceStub(channel)
    channel.close()


def _inputs(rng, batch: int, seq: int) -> dict[str, np.ndarray]:
    ids = rng.integers(1000, 29000, (batch, seq))
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def _request(tfs, inputs: dict, *, name="minilm", typed=False, **spec):
    """A PredictRequest; int64 tensors in tensor_content (tf.make_tensor_proto's form) or int32 int_val fields."""
    req = tfs.predict_pb2.PredictRequest()
    req.model_spec.name = name
    for k, v in spec.items():
        if k == "version":
            req.model_spec.version.value = v
        else:
            setattr(req.model_spec, k, v)
    for k, v in inputs.items():
        if typed:
            t = req.inputs[k]
            t.dtype = tfs.tf.int32.as_datatype_enum
            for s in v.shape:
                t.tensor_shape.dim.add(size=s)
            t.int_val.extend(v.reshape(-1).tolist())
        else:
            req.inputs[k].CopyFrom(tfs.tf.make_tensor_proto(v))
    return req


def _rest(base, inputs: dict, headers: dict | None = None) -> np.ndarray:
    r = httpx.post(f"{base}/v1/models/minilm:predict", timeout=120, headers=headers,
                   json={"inputs": {k: v.tolist() for k, v in inputs.items()}})
    assert r.status_code == 200, r.text
    return np.array(r.json()["outputs"], np.float32)


@pytest.mark.parametrize("batch,seq,typed", [(1, 4, False), (3, 9, True), (2, 17, False)])
def test_predict_answers_like_rest(server, stubs, tfs, batch, seq, typed):
    inputs = _inputs(np.random.default_rng(batch * seq), batch, seq)
    response = stubs[0].Predict(_request(tfs, inputs, typed=typed), timeout=120)
    got = tfs.tf.make_ndarray(response.outputs["last_hidden_state"])
    assert len(response.outputs["last_hidden_state"].float_val) == got.size   # TF Serving's typed-field answer
    np.testing.assert_allclose(got, _rest(server[0], inputs), atol=1e-5)
    assert (response.model_spec.name, response.model_spec.version.value,
            response.model_spec.signature_name) == ("minilm", 1, "serving_default")


def test_versions_signatures_and_output_filter(server, stubs, tfs):
    inputs = _inputs(np.random.default_rng(1), 1, 4)
    want = _rest(server[0], inputs)
    for spec in ({"version": 1}, {"signature_name": "forward"}, {"signature_name": "serving_default"}):
        req = _request(tfs, inputs, **spec)
        req.output_filter.append("last_hidden_state")
        np.testing.assert_allclose(tfs.tf.make_ndarray(stubs[0].Predict(req, timeout=60).outputs["last_hidden_state"]),
                                   want, atol=1e-5)


def test_metadata_and_status_are_the_rest_answers(server, stubs, tfs):
    from google.protobuf import json_format
    req = tfs.meta_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    req.model_spec.name = "minilm"
    meta = stubs[0].GetModelMetadata(req, timeout=30)
    sigs = tfs.meta_pb2.SignatureDefMap()
    assert meta.metadata["signature_def"].Unpack(sigs)
    rest = httpx.get(f"{server[0]}/v1/models/minilm/metadata").json()
    assert json_format.MessageToDict(sigs, preserving_proto_field_name=True) == \
        json_format.MessageToDict(json_format.ParseDict(rest["metadata"]["signature_def"], tfs.meta_pb2.SignatureDefMap()),
                                  preserving_proto_field_name=True)
    assert sigs.signature_def["serving_default"].inputs["input_ids"].dtype == tfs.tf.int32.as_datatype_enum
    assert [d.size for d in sigs.signature_def["serving_default"].outputs["last_hidden_state"].tensor_shape.dim] == \
        [-1, -1, 384]
    sreq = tfs.status_pb2.GetModelStatusRequest()
    sreq.model_spec.name = "minilm"
    (st,) = stubs[1].GetModelStatus(sreq, timeout=30).model_version_status
    assert (st.version, tfs.status_pb2.ModelVersionStatus.State.Name(st.state)) == (1, "AVAILABLE")


def _bad(tfs):
    """(name, request builder, method, code, message fragment)."""
    x = _inputs(np.random.default_rng(2), 1, 4)
    C = tfs.grpc.StatusCode

    def with_input(name, value, dtype=None):
        req = _request(tfs, {k: v for k, v in x.items() if k != name})
        if value is not None:
            req.inputs[name].CopyFrom(tfs.tf.make_tensor_proto(value, dtype=dtype))
        return req

    def meta(fields):
        req = tfs.meta_pb2.GetModelMetadataRequest(metadata_field=fields)
        req.model_spec.name = "minilm"
        return req

    def filtered(alias):
        req = _request(tfs, x)
        req.output_filter.append(alias)
        return req

    classify = tfs.classification_pb2.ClassificationRequest()
    classify.model_spec.name = "minilm"
    seq600 = _inputs(np.random.default_rng(3), 1, 600)
    return [
        ("unknown model", lambda: _request(tfs, x, name="bert"), "Predict", C.NOT_FOUND,
         "Servable not found for request: Latest(bert)"),
        ("unknown version", lambda: _request(tfs, x, version=2), "Predict", C.NOT_FOUND, "Specific(minilm, 2)"),
        ("version label", lambda: _request(tfs, x, version_label="stable"), "Predict", C.INVALID_ARGUMENT,
         "Unrecognized servable version label: stable"),
        ("no model spec", lambda: tfs.predict_pb2.PredictRequest(), "Predict", C.INVALID_ARGUMENT, "Missing ModelSpec"),
        ("missing input", lambda: with_input("token_type_ids", None), "Predict", C.INVALID_ARGUMENT,
         "missing ['token_type_ids']"),
        ("float ids", lambda: with_input("input_ids", x["input_ids"].astype(np.float32)), "Predict",
         C.INVALID_ARGUMENT, "a DT_FLOAT tensor cannot feed i32[batch,seq]; send DT_INT32"),
        ("ids out of int32", lambda: with_input("input_ids", x["input_ids"] + (1 << 40)), "Predict",
         C.INVALID_ARGUMENT, "does not fit i32"),
        ("rank", lambda: with_input("input_ids", x["input_ids"][0]), "Predict", C.INVALID_ARGUMENT, "has rank 1"),
        ("seq out of range", lambda: _request(tfs, seq600), "Predict", C.INVALID_ARGUMENT,
         "seq = 600 is outside its range [1, 512]"),
        ("signature", lambda: _request(tfs, x, signature_name="classify"), "Predict", C.FAILED_PRECONDITION,
         'Serving signature key "classify" not found'),
        ("output filter", lambda: filtered("pooled"), "Predict", C.INVALID_ARGUMENT,
         "output tensor alias not found in signature: pooled"),
        ("too large", lambda: with_input("input_ids", np.zeros((64, 8192), np.int32)), "Predict",
         C.RESOURCE_EXHAUSTED, ""),
        ("metadata field", lambda: meta(["graph"]), "GetModelMetadata", C.INVALID_ARGUMENT,
         "Metadata field graph is not supported"),
        ("no metadata field", lambda: meta([]), "GetModelMetadata", C.INVALID_ARGUMENT,
         "must specify at least one metadata_field"),
        ("classify", lambda: classify, "Classify", C.INVALID_ARGUMENT,
         "Expected classification signature method_name to be tensorflow/serving/classify"),
    ]


def test_bad_requests_answer_tf_serving_codes_and_the_server_keeps_serving(server, stubs, tfs):
    good = _inputs(np.random.default_rng(4), 1, 5)
    want = _rest(server[0], good)
    for name, build, method, code, fragment in _bad(tfs):
        with pytest.raises(tfs.grpc.RpcError) as e:
            getattr(stubs[0], method)(build(), timeout=60)
        assert e.value.code() == code and fragment in e.value.details(), (name, e.value.code(), e.value.details())
        got = tfs.tf.make_ndarray(stubs[0].Predict(_request(tfs, good), timeout=60).outputs["last_hidden_state"])
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
    assert httpx.get(f"{server[0]}/health").status_code == 200


def test_the_docs_client_example_runs(server, tfs, capsys):
    """docs/api.md's gRPC example, verbatim but for the port, against the live server."""
    with open(DOCS_API) as f:
        (example,) = [b for b in re.findall(r"```python\n(.*?)```", f.read(), flags=re.S) if "predict_pb2" in b]
    assert '"localhost:8500"' in example
    scope: dict = {}
    exec(compile(example.replace('"localhost:8500"', repr(server[1])), "docs/api.md", "exec"), scope)
    assert capsys.readouterr().out.strip() == "(1, 4, 384)"
    ids = np.array([[101, 7592, 2088, 102]])
    want = _rest(server[0], {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)})
    np.testing.assert_allclose(scope["hidden"], want, atol=1e-5)


def _metric(base: str, name: str) -> float:
    from .test_app_predict import _metric as read
    return read(base, name)


def test_sigterm_drains_a_grpc_call(minilm_artifact, tfs, tmp_path):
    """With --api-key, a call without the key is UNAUTHENTICATED. A Predict held by the batcher
    (--batch-timeout-ms 5000) when SIGTERM lands: new calls answer UNAVAILABLE and /ready 503 while it
    drains, then it completes with the right answer and the process exits cleanly (143)."""
    port = free_port()
    inputs = _inputs(np.random.default_rng(5), 1, 6)
    key = [("authorization", "Bearer k3y")]
    with running_server(minilm_artifact, "--model-name", "minilm", "--grpc-port", str(port), "--batch-timeout-ms",
                        "5000", "--shutdown-grace", "120", "--api-key", "k3y", log_dir=str(tmp_path)) as (base, proc):
        want = _rest(base, inputs, dict(key))   # also compiles the shape, so the held call only waits for the batcher
        stub = tfs.prediction.PredictionServiceStub(tfs.grpc.insecure_channel(f"127.0.0.1:{port}"))
        with pytest.raises(tfs.grpc.RpcError) as unauthenticated:
            stub.Predict(_request(tfs, inputs), timeout=60, metadata=[("authorization", "Bearer nope")])
        assert unauthenticated.value.code() == tfs.grpc.StatusCode.UNAUTHENTICATED
        result: dict = {}

        def call():
            try:
                result["out"] = stub.Predict(_request(tfs, inputs), timeout=300, metadata=key)
            except tfs.grpc.RpcError as e:
                result["error"] = (e.code(), e.details())

        held = threading.Thread(target=call)
        held.start()
        while _metric(base, "hloserve:requests_in_flight") < 1:   # admitted, waiting for company in the batcher
            assert held.is_alive(), result
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(tfs.grpc.RpcError) as refused:
            stub.Predict(_request(tfs, inputs), timeout=60, metadata=key)
        assert refused.value.code() == tfs.grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
        assert httpx.get(f"{base}/ready", timeout=60).status_code == 503
        held.join(300)
        assert proc.wait(300) == 128 + signal.SIGTERM
    assert "out" in result, result
    np.testing.assert_allclose(tfs.tf.make_ndarray(result["out"].outputs["last_hidden_state"]), want, atol=1e-5)
    log = open(next(tmp_path.glob("server-*.log"))).read()
    assert "draining 1 request(s)" in log, log[-2000:]
