"""TF Serving REST predict bodies (row "instances" and columnar "inputs") <-> arrays, by hand-computed cases."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hloserve.runtime import artifact
from hloserve.server.predict import (PredictRequest, PredictRequestError, decode_predict_request,
                                     encode_predict_response, resolve_signature)

REQUESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "deploy", "tf_serving", "requests")


def fn(name, inputs, outputs):
    t = artifact.TensorSpec
    return artifact.FunctionSpec(name, (), tuple(t(*i) for i in inputs), tuple(t(*o) for o in outputs), {}, (), (),
                                 {}, "1.0.0", ("cpu",))


def manifest(*functions):
    return artifact.Manifest(1, {}, "test", {f.name: f for f in functions}, {}, {}, {})


ENCODER = fn("forward", [("input_ids", "i32", ("batch", "seq")), ("attention_mask", "i32", ("batch", "seq"))],
             [("last_hidden_state", "f32", ("batch", "seq", 2))])
SCALAR_IN = fn("score", [("x", "f32", ("batch", 3))], [("y", "f32", ("batch",)), ("flags", "bool", ("batch",))])
M = manifest(ENCODER, SCALAR_IN)


def test_row_and_columnar_forms_give_the_same_arrays():
    rows = {"instances": [{"input_ids": [101, 7, 102], "attention_mask": [1, 1, 1]},
                          {"input_ids": [101, 8, 0], "attention_mask": [1, 1, 0]}]}
    cols = {"signature_name": "serving_default",
            "inputs": {"input_ids": [[101, 7, 102], [101, 8, 0]], "attention_mask": [[1, 1, 1], [1, 1, 0]]}}
    a, b = decode_predict_request(rows, M), decode_predict_request(json.dumps(cols), M)
    assert (a.function, a.row_format, b.row_format, a.signature_name) == ("forward", True, False, "serving_default")
    for k in ("input_ids", "attention_mask"):
        assert a.inputs[k].dtype == np.int32 and a.inputs[k].shape == (2, 3)
        np.testing.assert_array_equal(a.inputs[k], b.inputs[k])
    np.testing.assert_array_equal(a.inputs["input_ids"], [[101, 7, 102], [101, 8, 0]])
    assert list(a.inputs) == ["input_ids", "attention_mask"]


def test_one_input_signatures_take_bare_values():
    rows = decode_predict_request({"signature_name": "score", "instances": [[1, 2, 3], [4, 5, 6.5]]}, M)
    cols = decode_predict_request({"signature_name": "score", "inputs": [[1, 2, 3], [4, 5, 6.5]]}, M)
    named = decode_predict_request({"signature_name": "score", "instances": [{"x": [1, 2, 3]}, {"x": [4, 5, 6.5]}]}, M)
    for r in (rows, cols, named):
        assert r.function == "score" and r.inputs["x"].dtype == np.float32
        np.testing.assert_array_equal(r.inputs["x"], [[1, 2, 3], [4, 5, 6.5]])


def test_responses_mirror_the_request_form():
    outs = {"y": np.array([0.5, 1.5], np.float32), "flags": np.array([True, False])}
    row = PredictRequest("score", "score", {}, True, ("y", "flags"))
    col = PredictRequest("score", "score", {}, False, ("y", "flags"))
    assert encode_predict_response(outs, row) == {"predictions": [{"y": 0.5, "flags": True},
                                                                   {"y": 1.5, "flags": False}]}
    assert encode_predict_response(outs, col) == {"outputs": {"y": [0.5, 1.5], "flags": [True, False]}}
    one = PredictRequest("serving_default", "forward", {}, True, ("last_hidden_state",))
    hidden = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    assert encode_predict_response({"last_hidden_state": hidden}, one) == {"predictions": hidden.tolist()}
    one_col = PredictRequest("serving_default", "forward", {}, False, ("last_hidden_state",))
    assert encode_predict_response({"last_hidden_state": hidden}, one_col) == {"outputs": hidden.tolist()}
    # float32 values survive the JSON round trip exactly
    v = np.array([[0.1, 1 / 3]], np.float32)
    back = json.loads(json.dumps(encode_predict_response({"y": v}, PredictRequest("s", "score", {}, False, ("y",)))))
    assert np.array_equal(np.asarray(back["outputs"], np.float32), v)


def test_signature_names():
    assert resolve_signature(None, M) == "forward" and resolve_signature("serving_default", M) == "forward"
    assert resolve_signature("score", M) == "score"
    with pytest.raises(PredictRequestError, match=r"Serving signature key \"classify\" not found; the model has "
                                                  r"\['serving_default', 'forward', 'score'\]"):
        resolve_signature("classify", M)


@pytest.mark.parametrize("body, fragment", [
    ({"instances": [], "inputs": {}}, "exactly one of 'instances'"),
    ({"signature_name": "forward"}, "exactly one of 'instances'"),
    ({"instances": [1], "extra": 1}, "unknown request field(s) ['extra']"),
    ({"instances": []}, "non-empty list"),
    ({"instances": [[1, 2]]}, "instance 0 must be an object with the inputs ['input_ids', 'attention_mask']"),
    ({"instances": [{"input_ids": [1]}]}, "instance 0: missing ['attention_mask']"),
    ({"instances": [{"input_ids": [1], "attention_mask": [1], "x": 1}]}, "unknown ['x']"),
    ({"instances": [{"input_ids": [1, 2], "attention_mask": [1, 1]}, {"input_ids": [1], "attention_mask": [1]}]},
     "instance 1 has shape [1] but instance 0 has [2]"),
    ({"instances": [{"input_ids": [[1, 2]], "attention_mask": [[1, 1]]}]}, "has rank 2, expected 1"),
    ({"inputs": {"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}}, "ragged"),
    ({"inputs": {"input_ids": [[1.5]], "attention_mask": [[1]]}}, "1.5 is not an integer; the input is i32"),
    ({"inputs": {"input_ids": [[2 ** 40]], "attention_mask": [[1]]}}, "does not fit i32"),
    ({"inputs": {"input_ids": [["a"]], "attention_mask": [[1]]}}, "'a' is not an integer"),
    ({"inputs": {"input_ids": [[{"b64": "AA=="}]], "attention_mask": [[1]]}}, "string tensors"),
    ({"inputs": {"input_ids": [1, 2], "attention_mask": [1, 2]}}, "has rank 1 (shape [2]), expected i32[batch,seq]"),
    ({"signature_name": "score", "inputs": [[1, 2], [3]]}, "not a rectangular numeric tensor"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_bodies_are_named(body, fragment):
    with pytest.raises(PredictRequestError) as e:
        decode_predict_request(body, M)
    assert fragment in str(e.value), str(e.value)


def test_row_response_needs_a_shared_batch_dim():
    req = PredictRequest("score", "score", {}, True, ("y", "flags"))
    with pytest.raises(PredictRequestError, match="send the columnar 'inputs' form"):
        encode_predict_response({"y": np.zeros(2, np.float32), "flags": np.zeros(3, bool)}, req)


def test_stored_minilm_bodies_agree():
    """deploy/tf_serving/requests: the documented row and columnar bodies decode to the same arrays."""
    minilm = manifest(fn("forward", [(n, "i32", ("batch", "seq")) for n in
                                     ("input_ids", "attention_mask", "token_type_ids")],
                         [("last_hidden_state", "f32", ("batch", "seq", 384))]))
    with open(os.path.join(REQUESTS, "minilm_instances.json")) as f:
        rows = decode_predict_request(f.read(), minilm)
    with open(os.path.join(REQUESTS, "minilm_inputs.json")) as f:
        cols = decode_predict_request(f.read(), minilm)
    assert rows.row_format and not cols.row_format
    for k in rows.inputs:
        np.testing.assert_array_equal(rows.inputs[k], cols.inputs[k])
    assert rows.inputs["input_ids"].shape == (2, 12) and rows.inputs["attention_mask"][1].sum() == 4
