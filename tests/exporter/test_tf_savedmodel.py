"""`hloserve tf`: artifacts as TensorFlow SavedModels (XlaCallModule), checked against the PJRT runtime.

Every SavedModel is written once per session. TensorFlow's own loaders run it: `tf.saved_model.load`
(eager, TF2) and the `saved_model_cli` of the installed TensorFlow (a TF1 session, as TF Serving runs
it). Outputs must equal `hloserve.runtime.load`'s within 1e-5 at three shapes from one SavedModel.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hloserve.exporter.tf_savedmodel import (SavedModelError, choose_call_module_version, plan_function,
                                             to_savedmodel)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUESTS = os.path.join(REPO, "deploy", "tf_serving", "requests")
# TensorFlow's XLA and jax's XLA compile the same StableHLO with their own fusions and sum orders, so
# f32 results differ by reordering alone. A dot of n terms reordered moves by ~sqrt(n) * 2^-24 of its
# magnitude (MiniLM: n <= 1536, ~2.3e-6); six layers of residual sums and LayerNorms add about that
# per layer, ~1.4e-5. Bound: 3e-5 of the output's largest magnitude (observed: 3.9e-6 on an Intel Xeon,
# ~1e-6 on an AMD EPYC). Integer outputs must be equal.
REL = 3e-5
MINILM_SHAPES = [(1, 7), (3, 16), (2, 33)]   # (batch, seq)
TINY_SHAPES = [(1, 2), (4, 9), (16, 64)]     # batch in [1, 16], seq in [2, 64], both ends included
TF_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


# -- fixtures: one artifact and one SavedModel per model per session ----------------------------
@pytest.fixture(scope="session")
def tf():
    import tensorflow   # a dev dependency: a failed import fails these tests, never skips them
    return tensorflow


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> str:
    from hloserve.exporter.export import export_artifact
    from tests.exporter.tf_models import entries
    out = str(tmp_path_factory.mktemp("tiny") / "art")
    export_artifact(out, entries(), source="tests.exporter.tf_models:entries")
    return out


@pytest.fixture(scope="session")
def tiny_savedmodel(tf, tiny_artifact, tmp_path_factory):
    return to_savedmodel(tiny_artifact, str(tmp_path_factory.mktemp("tiny_sm") / "1"))


@pytest.fixture(scope="session")
def minilm_savedmodel(tf, minilm_artifact, tmp_path_factory):
    return to_savedmodel(minilm_artifact, str(tmp_path_factory.mktemp("minilm_sm") / "1"))


@pytest.fixture(scope="session")
def minilm_runtime(minilm_artifact):
    from hloserve.runtime import load
    return load(minilm_artifact, cache_dir=None)


@pytest.fixture(scope="session")
def tiny_runtime(tiny_artifact):
    from hloserve.runtime import load
    return load(tiny_artifact, cache_dir=None)


def minilm_inputs(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 29000, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[0, seq // 2 + 1:] = 0   # a padded row
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((batch, seq), np.int32)}


def tiny_inputs(name: str, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name == "encode":
        return {"tokens": rng.integers(0, 100, (batch, seq)).astype(np.int32),
                "x": rng.standard_normal((batch, seq, 16)).astype(np.float32)}
    return {"y": rng.standard_normal((batch, seq, 32)).astype(np.float32),
            "mask": (rng.random((batch, seq)) < 0.7).astype(np.int32)}


def assert_same(got: dict, want: dict, what: str) -> float:
    assert set(got) == set(want), what
    worst = 0.0
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {k}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        np.testing.assert_allclose(g, w, atol=REL * float(np.abs(w).max(initial=0.0)), rtol=0, err_msg=f"{what} {k}")
        worst = max(worst, float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)), initial=0.0)))
    return worst


def call_signature(tf, sig, inputs: dict) -> dict:
    return {k: v.numpy() for k, v in sig(**{k: tf.constant(v) for k, v in inputs.items()}).items()}


def saved_model_cli(*args: str) -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, env=TF_ENV, timeout=300)
    assert proc.returncode == 0, f"saved_model_cli {' '.join(args)}:\n{proc.stderr[-3000:]}"
    return proc.stdout


# -- version choice (no TensorFlow needed) --------------------------------------------------------
def test_call_module_version_choice(tiny_artifact):
    from hloserve.runtime import artifact
    manifest = artifact.read_manifest(tiny_artifact)
    plan = plan_function(tiny_artifact, manifest, "encode")
    assert plan.module_version == 10 and plan.platforms == ("cpu",) and not plan.uses_shardy
    v10, v9 = dataclasses.replace(plan, module_version=10), dataclasses.replace(plan, module_version=9)
    shardy = dataclasses.replace(v10, uses_shardy=True)
    rows = [  # (plans, TensorFlow's max, requested) -> version, or the error's fragment
        ([v10], 10, None, 10),
        ([v10], 9, None, 9),            # "must be <= 9": the module runs as 9
        ([v9], 10, None, 9),
        ([v10], 10, 9, 9),
        ([v10, v9], 9, None, 9),
        ([v10], 9, 10, "supports at most 9; pass --xla-call-module-version 9"),
        ([v10], 10, 8, "pass --xla-call-module-version 10"),
        ([v10], 6, None, "upgrade TensorFlow"),
        ([shardy], 9, None, "Shardy"),
        ([shardy], 10, None, 10),
    ]
    for plans, tf_max, requested, want in rows:
        if isinstance(want, int):
            assert choose_call_module_version(plans, tf_max, requested) == want, (tf_max, requested)
        else:
            with pytest.raises(SavedModelError, match=want):
                choose_call_module_version(plans, tf_max, requested)


# -- MiniLM: the real checkpoint ------------------------------------------------------------------
@pytest.mark.slow
def test_minilm_tf_load_matches_runtime_at_three_shapes(tf, minilm_savedmodel, minilm_runtime):
    info = minilm_savedmodel
    assert list(info.signatures) == ["serving_default", "forward"]
    assert info.signatures["serving_default"].inputs == (
        ("input_ids", "int32", (None, None)), ("attention_mask", "int32", (None, None)),
        ("token_type_ids", "int32", (None, None)))
    assert info.variables == 102 and info.variable_bytes > 80 * 2**20   # weights are variables, not constants
    assert os.path.getsize(os.path.join(info.path, "saved_model.pb")) < 2 * 2**20
    loaded = tf.saved_model.load(info.path)
    for key in ("serving_default", "forward"):
        sig = loaded.signatures[key]
        for b, s in MINILM_SHAPES:
            x = minilm_inputs(b, s)
            want = {k: np.asarray(v) for k, v in minilm_runtime.functions["forward"](**x).items()}
            assert_same(call_signature(tf, sig, x), want, f"{key} at {b}x{s}")


@pytest.mark.slow
def test_minilm_saved_model_cli_show_and_run(tmp_path, minilm_savedmodel, minilm_runtime):
    shown = saved_model_cli("show", "--dir", minilm_savedmodel.path, "--all")
    for key in ("serving_default", "forward"):
        assert f"signature_def['{key}']" in shown
    assert "shape: (-1, -1, 384)" in shown and "dtype: DT_INT32" in shown and "XlaCallModule" in shown
    for i, (b, s) in enumerate(MINILM_SHAPES):
        x = minilm_inputs(b, s, seed=i)
        for k, v in x.items():
            np.save(tmp_path / f"{k}_{i}.npy", v)
        out = tmp_path / f"out_{i}"
        saved_model_cli("run", "--dir", minilm_savedmodel.path, "--tag_set", "serve",
                        "--signature_def", "serving_default", "--outdir", str(out),
                        "--inputs", ";".join(f"{k}={tmp_path / f'{k}_{i}.npy'}" for k in x))
        got = {"last_hidden_state": np.load(out / "last_hidden_state.npy")}
        want = {k: np.asarray(v) for k, v in minilm_runtime.functions["forward"](**x).items()}
        assert_same(got, want, f"saved_model_cli run at {b}x{s}")


@pytest.mark.slow
def test_minilm_rest_bodies_decode_and_run(tf, minilm_artifact, minilm_savedmodel, minilm_runtime):
    """deploy/tf_serving/requests/*.json: both forms give the same arrays and the same outputs."""
    from hloserve.runtime import artifact
    from hloserve.server.predict import decode_predict_request, encode_predict_response
    manifest = artifact.read_manifest(minilm_artifact)
    loaded = tf.saved_model.load(minilm_savedmodel.path)
    responses = {}
    arrays = {}
    for form in ("instances", "inputs"):
        with open(os.path.join(REQUESTS, f"minilm_{form}.json")) as f:
            req = decode_predict_request(f.read(), manifest)
        arrays[form] = req.inputs
        tf_out = call_signature(tf, loaded.signatures[req.signature_name], dict(req.inputs))
        rt_out = {k: np.asarray(v) for k, v in minilm_runtime.functions[req.function](**req.inputs).items()}
        assert_same(tf_out, rt_out, f"{form} body")
        responses[form] = encode_predict_response(rt_out, req)
    for k in arrays["instances"]:
        np.testing.assert_array_equal(arrays["instances"][k], arrays["inputs"][k])
    assert np.array_equal(np.asarray(responses["instances"]["predictions"]), np.asarray(responses["inputs"]["outputs"]))
    assert np.asarray(responses["instances"]["predictions"]).shape == (2, 12, 384)


# -- a dynamic-shape model with two functions, int8 weights and a derived output dim --------------
@pytest.mark.slow
def test_tiny_every_function_is_a_signature_and_matches_runtime(tf, tiny_savedmodel, tiny_runtime):
    info = tiny_savedmodel
    assert list(info.signatures) == ["serving_default", "encode", "pool"]
    assert info.signatures["encode"].outputs == (("y", "float32", (None, None, 32)), ("ids", "int32", (None, None)))
    assert info.signatures["encode"].inputs[0] == ("tokens", "int32", (None, None))   # int64 narrowed at export
    loaded = tf.saved_model.load(info.path)
    dtypes = {v.name.split(":")[0]: v.dtype.name for v in loaded.weights}
    assert dtypes["w_q"] == "int8" and dtypes["offsets"] == "int32" and dtypes["w_scale"] == "float32"
    for key, fn in (("serving_default", "encode"), ("encode", "encode"), ("pool", "pool")):
        for b, s in TINY_SHAPES:
            x = tiny_inputs(fn, b, s)
            want = {k: np.asarray(v) for k, v in tiny_runtime.functions[fn](**x).items()}
            got = call_signature(tf, loaded.signatures[key], x)
            assert_same(got, want, f"{key} at {b}x{s}")
        assert got.get("y", got.get("embedding")).shape[0] == b
    # the tf.functions are attributes too (callable with positional tensors)
    x = tiny_inputs("pool", 2, 5)
    assert_same({"embedding": loaded.pool(*[tf.constant(v) for v in x.values()])["embedding"].numpy()},
                {"embedding": np.asarray(tiny_runtime.functions["pool"](**x)["embedding"])}, "tf.function pool")


@pytest.mark.slow
def test_tiny_saved_model_cli_runs_a_non_default_signature(tmp_path, tiny_savedmodel, tiny_runtime):
    shown = saved_model_cli("show", "--dir", tiny_savedmodel.path, "--tag_set", "serve", "--signature_def", "pool")
    assert "inputs['mask']" in shown and "shape: (-1, 8)" in shown
    x = tiny_inputs("pool", 3, 11)
    for k, v in x.items():
        np.save(tmp_path / f"{k}.npy", v)
    saved_model_cli("run", "--dir", tiny_savedmodel.path, "--tag_set", "serve", "--signature_def", "pool",
                    "--outdir", str(tmp_path / "out"),
                    "--inputs", ";".join(f"{k}={tmp_path / f'{k}.npy'}" for k in x))
    want = {k: np.asarray(v) for k, v in tiny_runtime.functions["pool"](**x).items()}
    assert_same({"embedding": np.load(tmp_path / "out" / "embedding.npy")}, want, "saved_model_cli pool")


@pytest.mark.slow
def test_version_9_older_stablehlo_and_no_platform_check_run_the_same(tf, tiny_artifact, tiny_runtime, tmp_path):
    """The "must be <= 9" case: a version-10 module written as version 9, StableHLO re-serialized for 1.0.0,
    and the platform check off (`--platforms none`)."""
    info = to_savedmodel(tiny_artifact, str(tmp_path / "v9"), call_module_version=9, stablehlo_version="1.0.0",
                         functions=["pool"], platforms=[])
    assert info.call_module_version == 9 and info.stablehlo_version == "1.0.0" and list(info.signatures) == [
        "serving_default", "pool"]
    assert info.platforms == ("CPU",) and not info.platform_check
    loaded = tf.saved_model.load(info.path)
    x = tiny_inputs("pool", 5, 13)
    want = {k: np.asarray(v) for k, v in tiny_runtime.functions["pool"](**x).items()}
    assert_same(call_signature(tf, loaded.signatures["pool"], x), want, "version 9")


@pytest.mark.slow
def test_conversion_errors_say_what_to_do(tf, tiny_artifact, tmp_path):
    out = str(tmp_path / "sm")
    cases = [
        (dict(call_module_version=99), "supports at most 10"),
        (dict(platforms=["tpu"]), "re-export the artifact with `hloserve export ... --platforms tpu`"),
        (dict(functions=["decode"]), "has no function 'decode'; it has ['encode', 'pool']"),
        (dict(serving_default="pool", functions=["encode"]), "not among the exported functions"),
        (dict(stablehlo_version="0.1.0"), "cannot re-serialize"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(SavedModelError, match=None) as e:
            to_savedmodel(tiny_artifact, out, **kwargs)
        assert fragment in str(e.value), (kwargs, str(e.value))
        assert not os.path.exists(out)
    os.makedirs(out)
    open(os.path.join(out, "notes.txt"), "w").close()
    with pytest.raises(SavedModelError, match="is not a SavedModel"):
        to_savedmodel(tiny_artifact, out)


# -- the CLI and the no-torch promise ---------------------------------------------------------------
@pytest.mark.slow
def test_cli_export_with_savedmodel_derived_input_dims(tf, tmp_path):
    """`hloserve export factories:two_dims --savedmodel`: inputs (B, S), (B, 2S), (B, S+1) all None-shaped."""
    art, sm = str(tmp_path / "art"), str(tmp_path / "sm")
    env = dict(TF_ENV, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests", "exporter"), REPO]))
    proc = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "export", "factories:two_dims", "-o", art,
                           "--savedmodel", sm], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "signature serving_default -> forward(x: float32[None, None, 16], pairs: float32[None, None, 16]" \
        in proc.stderr
    from hloserve.runtime import load
    rt = load(art, cache_dir=None)
    loaded = tf.saved_model.load(sm)
    rng = np.random.default_rng(0)
    for b, s in [(1, 2), (3, 7), (2, 20)]:
        x = {"x": rng.standard_normal((b, s, 16)).astype(np.float32),
             "pairs": rng.standard_normal((b, 2 * s, 16)).astype(np.float32),
             "shifted": rng.standard_normal((b, s + 1, 16)).astype(np.float32)}
        want = {k: np.asarray(v) for k, v in rt.functions["forward"](**x).items()}
        assert_same(call_signature(tf, loaded.signatures["serving_default"], x), want, f"two_dims at {b}x{s}")
    bad = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "tf", art, "-o", sm,
                          "--xla-call-module-version", "42"], capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("hloserve: error:")]
    assert bad.returncode == 1 and len(errors) == 1 and "--xla-call-module-version 10" in errors[0], bad.stderr


@pytest.mark.slow
def test_conversion_never_imports_torch(tiny_artifact, tmp_path):
    code = ("import sys, json\n"
            "from hloserve.exporter.tf_savedmodel import to_savedmodel\n"
            f"info = to_savedmodel({tiny_artifact!r}, {str(tmp_path / 'sm')!r})\n"
            "print(json.dumps(['torch' in sys.modules, info.call_module_version]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=TF_ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [False, 10]


@pytest.mark.slow
def test_cpu_tpu_artifact_runs_in_tensorflow_on_cpu(tf, tmp_path):
    """The artifact for Cloud TPU (`--platforms cpu,tpu`) also serves from TF on CPU: the module's
    platform-index argument picks CPU, so one artifact feeds both deployment paths."""
    from hloserve.exporter.export import export_artifact
    from hloserve.runtime import load
    from tests.exporter.tf_models import entries
    art = str(tmp_path / "art")
    export_artifact(art, entries()[1:], source="tests.exporter.tf_models:entries", platforms=("cpu", "tpu"))
    info = to_savedmodel(art, str(tmp_path / "sm"))
    assert info.platforms == ("CPU", "TPU") and info.platform_check
    with pytest.raises(SavedModelError, match="cannot be disabled for a module lowered for several platforms"):
        to_savedmodel(art, str(tmp_path / "sm2"), platforms=[])
    loaded = tf.saved_model.load(info.path)
    rt = load(art, cache_dir=None)
    for b, s in TINY_SHAPES:
        x = tiny_inputs("pool", b, s)
        want = {k: np.asarray(v) for k, v in rt.functions["pool"](**x).items()}
        assert_same(call_signature(tf, loaded.signatures["pool"], x), want, f"cpu,tpu module at {b}x{s}")
