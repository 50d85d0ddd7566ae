"""The runtime on real exported artifacts: results vs torch eager, buckets, strict mode, donation, errors.

Tolerance: f32 MLP, atol 1e-5 against torch eager (same weights, same inputs).
"""
from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest

from hloserve import runtime
from hloserve.exporter.errors import ArtifactError, ShapeConstraintError
from hloserve.runtime.client import compile_events

ATOL = 1e-5


@pytest.fixture(scope="module")
def eager_mlp():
    from tests.runtime.models import mlp_entry
    return mlp_entry().module


def _eager(module, x):
    import torch
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def _x(batch, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, 64), dtype=np.float32)


def test_matches_eager_with_padding(mlp_artifact, eager_mlp, tmp_path):
    model = runtime.load(mlp_artifact, cache_dir=str(tmp_path))
    fn = model.functions["forward"]
    for batch in (1, 5, 64):
        x = _x(batch, batch)
        y = fn(x=x)["y"]
        assert y.shape == (batch, 64)
        np.testing.assert_allclose(np.asarray(y), _eager(eager_mlp, x), atol=ATOL, rtol=0)
    # 5 ran in the bucket of 8; 1 and 64 are buckets themselves
    assert sorted(e["batch"] for e in fn.compiled_shapes) == [1, 8, 64]
    assert fn.stats.padded_calls == 1 and fn.stats.calls == 3


def test_weights_live_on_device_once(mlp_artifact, tmp_path):
    import jax
    model = runtime.load(mlp_artifact, cache_dir=str(tmp_path))
    assert set(model.weights) == set(model.manifest.weights)
    assert all(isinstance(w, jax.Array) for w in model.weights.values())
    fn = model.functions["forward"]
    assert all(a is model.weights[n] for a, n in zip(fn._weights, fn.spec.weights))


def test_zero_compiles_after_warmup_over_50_random_batches(mlp_artifact, eager_mlp, tmp_path):
    model = runtime.load(mlp_artifact, cache_dir=str(tmp_path), strict=True)
    fn = model.functions["forward"]
    lines = []
    assert model.warmup(progress=lines.append) == 7            # buckets 1, 2, 4, ..., 64
    assert len(lines) == 7 and "batch=64" in lines[-1]
    compiles, backend = fn.stats.compiles, compile_events().backend_compiles
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 65, size=50)
    for i, b in enumerate(sizes):
        x = _x(int(b), i)
        np.testing.assert_allclose(np.asarray(fn(x=x)["y"]), _eager(eager_mlp, x), atol=ATOL, rtol=0)
    assert fn.stats.compiles == compiles and fn.stats.compiles_after_warmup == 0
    # nothing else compiled either (padding and slicing happen on the host)
    assert compile_events().backend_compiles == backend
    assert fn.stats.calls == 50 and len(set(sizes.tolist())) > 20


def test_strict_mode_raises_on_a_shape_warmup_missed(mlp_artifact, tmp_path):
    model = runtime.load(mlp_artifact, cache_dir=str(tmp_path), strict=True, buckets={"batch": [1, 8, 16]})
    model.warmup(run=False)
    fn = model.functions["forward"]
    fn(x=_x(9))                                               # bucket 16: fine
    with pytest.raises(runtime.RecompileError, match=r"'forward'.*batch=17.*after warm-up"):
        fn(x=_x(17))                                          # above the last bucket
    assert fn.stats.compiles == 3


def test_unplanned_recompile_is_counted_and_logged(mlp_artifact, tmp_path, caplog):
    model = runtime.load(mlp_artifact, cache_dir=str(tmp_path), buckets={"batch": [1, 8]})
    fn = model.functions["forward"]
    with caplog.at_level(logging.INFO, logger="hloserve.runtime"):
        fn(x=_x(3))
        model.warmup(run=False)
        fn(x=_x(20))
    first, *_, last = [r for r in caplog.records if "compile #" in r.getMessage()]
    assert "'forward'" in first.getMessage() and "x=f32[8,64]" in first.getMessage()
    assert "bucket for batch=3" in first.getMessage()
    assert last.levelno == logging.WARNING
    assert "unplanned compile #3 of 'forward' for x=f32[20,64]" in last.getMessage()
    assert "new batch=20" in last.getMessage()
    assert fn.stats.compiles == 3 and fn.stats.compiles_after_warmup == 1


def test_warmup_needs_sizes_for_dims_that_are_not_paddable(state_artifact, tmp_path):
    from hloserve.exporter.errors import HloserveError
    model = runtime.load(state_artifact, cache_dir=str(tmp_path))
    with pytest.raises(HloserveError, match=r"dim 'k' is not paddable.*warmup\(sizes="):
        model.warmup()
    assert model.warmup(sizes={"n": [64], "k": [1, 4]}) == 2


@pytest.mark.parametrize("inputs,match", [
    ({}, r"needs input 'x'"),
    ({"x": _x(2), "z": _x(2)}, r"no input 'z'"),
    ({"x": _x(2).astype(np.int32)}, r"input 'x' has dtype int32, expected f32"),
    ({"x": np.zeros((2, 64), np.complex64)}, r"input 'x' has dtype complex64"),
    ({"x": np.zeros((2, 64, 1), np.float32)}, r"input 'x' has rank 3 .*expected rank 2"),
    ({"x": np.zeros((64,), np.float32)}, r"input 'x' has rank 1"),
    ({"x": np.zeros((2, 63), np.float32)}, r"input 'x' dim 1 is 63, expected 64"),
    ({"x": np.zeros((65, 64), np.float32)}, r"input 'x' dim 0: batch = 65 is outside its range \[1, 64\]"),
    ({"x": np.zeros((0, 64), np.float32)}, r"input 'x' dim 0: batch = 0 is outside"),
])
def test_bad_inputs_name_the_input(mlp_artifact, tmp_path, inputs, match):
    model = runtime.load(mlp_artifact, cache_dir=str(tmp_path))
    with pytest.raises(ShapeConstraintError, match=match):
        model.functions["forward"](**inputs)
    assert model.functions["forward"].stats.compiles == 0    # rejected before compiling


def test_jax_array_of_wrong_dtype_is_rejected(mlp_artifact, tmp_path):
    import jax.numpy as jnp
    model = runtime.load(mlp_artifact, cache_dir=str(tmp_path))
    with pytest.raises(ShapeConstraintError, match=r"input 'x' has dtype bfloat16, expected f32"):
        model.functions["forward"](x=jnp.zeros((2, 64), jnp.bfloat16))


def _copy(src, tmp_path):
    dst = str(tmp_path / "art")
    shutil.copytree(src, dst)
    return dst


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("damage,verify,match", [
    ("missing", True, r"does not exist; create it with `hloserve export"),
    ("no_manifest", True, r"is not an hloserve artifact: manifest.json is missing"),
    ("manifest_json", True, r"manifest.json is not valid JSON.*re-export"),
    ("function_bytes", True, r"functions/forward.jax_exported does not match its sha256"),
    ("function_bytes", False, r"function 'forward' cannot be deserialized.*corrupted, re-export"),
    ("function_missing", True, r"functions/forward.jax_exported is missing"),
    ("weights_bytes", True, r"weight '.*' does not match its sha256"),
    ("weights_truncated", True, r"weights.safetensors is truncated"),
])
def test_bad_artifacts_give_one_clear_error(mlp_artifact, tmp_path, damage, verify, match):
    art = _copy(mlp_artifact, tmp_path)
    fn_file = os.path.join(art, "functions", "forward.jax_exported")
    weights = os.path.join(art, "weights.safetensors")
    if damage == "missing":
        art = str(tmp_path / "nope")
    elif damage == "no_manifest":
        os.remove(os.path.join(art, "manifest.json"))
    elif damage == "manifest_json":
        with open(os.path.join(art, "manifest.json"), "a") as f:
            f.write("}{")
    elif damage == "function_bytes":
        with open(fn_file, "r+b") as f:
            f.truncate(os.path.getsize(fn_file) // 3)
    elif damage == "function_missing":
        os.remove(fn_file)
    elif damage == "weights_bytes":
        _flip_byte(weights, os.path.getsize(weights) - 10)
    elif damage == "weights_truncated":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) - 100)
    with pytest.raises(ArtifactError, match=match):
        runtime.load(art, cache_dir=str(tmp_path / "cache"), verify=verify)


def test_missing_flatbuffers_is_named_not_called_corruption(mlp_artifact):
    """jax reads a function with flatbuffers, which jax itself does not install (hloserve does): in a
    process where it cannot be imported, loading says which package to install."""
    from tests.runtime.conftest import run_python
    code = f"""
import sys
sys.modules["flatbuffers"] = None          # import flatbuffers raises ImportError
from hloserve import runtime
from hloserve.runtime.artifact.errors import ArtifactError
try:
    runtime.load({mlp_artifact!r}, cache_dir=None)
except ArtifactError as e:
    print(e)
"""
    out = run_python(code)
    assert "function 'forward' cannot be read without a package jax needs" in out
    assert "pip install flatbuffers" in out and "corrupted" not in out


def test_unknown_platform_and_device(mlp_artifact, tmp_path):
    from hloserve.runtime.client import PlatformError
    with pytest.raises(PlatformError, match="platform 'quantum' is unknown"):
        runtime.load(mlp_artifact, platform="quantum", cache_dir=None)
    with pytest.raises(PlatformError, match="device index 99 is out of range"):
        runtime.load(mlp_artifact, devices=[99], cache_dir=None)


def test_xla_options_from_the_environment(mlp_artifact, eager_mlp, tmp_path, monkeypatch):
    """$HLOSERVE_XLA_OPTIONS reaches every executable of a load (booleans as XLA's parser takes them),
    keys the executable cache apart from the same load without it, and a malformed or unknown option
    fails with one line naming it."""
    from hloserve.runtime.client import PlatformError, compiler_options
    monkeypatch.setenv("HLOSERVE_XLA_OPTIONS", "xla_gpu_enable_dynamic_slice_fusion=true; xla_gpu_graph_min_graph_size=2")
    assert compiler_options("cpu") == {"xla_gpu_enable_dynamic_slice_fusion": "True", "xla_gpu_graph_min_graph_size": "2"}
    cache = str(tmp_path / "cache")
    x = _x(3)
    fn = runtime.load(mlp_artifact, cache_dir=cache).functions["forward"]
    np.testing.assert_allclose(np.asarray(fn(x=x)["y"]), _eager(eager_mlp, x), atol=ATOL, rtol=0)
    monkeypatch.delenv("HLOSERVE_XLA_OPTIONS")
    plain = runtime.load(mlp_artifact, cache_dir=cache).functions["forward"]
    plain(x=x)
    assert plain.stats.compiles == 1 and not any(plain.from_executable_cache(e) for e in plain.compiled_shapes)
    monkeypatch.setenv("HLOSERVE_XLA_OPTIONS", "graph_min_graph_size=1")
    with pytest.raises(PlatformError, match="HLOSERVE_XLA_OPTIONS: 'graph_min_graph_size=1' is not name=value with an xla_"):
        runtime.load(mlp_artifact, cache_dir=None)
    monkeypatch.setenv("HLOSERVE_XLA_OPTIONS", "xla_gpu_enable_dynamic_slice_fusion=maybe")
    with pytest.raises(Exception, match="xla_gpu_enable_dynamic_slice_fusion"):
        runtime.load(mlp_artifact, cache_dir=None).functions["forward"](x=x)


def test_missing_platform_names_the_extra_to_install(mlp_artifact):
    import jax
    from hloserve.runtime.client import PlatformError
    try:
        jax.devices("gpu")
    except RuntimeError:
        pass
    else:
        pytest.skip("this machine has a GPU backend; the error path needs one without")
    with pytest.raises(PlatformError, match=r"platform 'cuda' is not available .*pip install 'hloserve\[cuda\]'"):
        runtime.load(mlp_artifact, platform="cuda", cache_dir=None)


def test_donated_state_is_updated_in_place(state_artifact, tmp_path):
    import jax.numpy as jnp
    model = runtime.load(state_artifact, cache_dir=str(tmp_path))
    fn = model.functions["step"]
    state = jnp.zeros((1 << 20,), jnp.float32)
    ptr = state.unsafe_buffer_pointer()
    want = np.zeros(1 << 20, np.float32)
    for i in range(5):
        slots = np.array([i, 100 + i, 1000 * i + 7], np.int32)
        out = fn(state=state, slots=slots, values=np.full(3, i + 1, np.float32))
        assert state.is_deleted()                                   # donated, not copied
        state = out["updated:state"]
        assert state.unsafe_buffer_pointer() == ptr                 # same buffer, written in place
        want[slots] = i + 1
        assert float(out["total"]) == 3 * (i + 1)
    np.testing.assert_array_equal(np.asarray(state), want)


@pytest.mark.slow
def test_donated_1gib_state_peak_memory_stays_below_1_5gib(state_artifact):
    from tests.runtime.conftest import run_python
    code = f"""
import resource, psutil, numpy as np, jax.numpy as jnp
from hloserve import runtime
model = runtime.load({state_artifact!r}, cache_dir=None)
fn = model.functions["step"]
base = psutil.Process().memory_info().rss
state = jnp.zeros((1 << 28,), jnp.float32)             # 1 GiB
ptr = state.unsafe_buffer_pointer()
rng = np.random.default_rng(0)
for i in range(100):
    slots = rng.integers(0, 1 << 28, 64).astype(np.int32)
    state = fn(state=state, slots=slots, values=np.full(64, i, np.float32))["updated:state"]
    state.block_until_ready()   # one update at a time: measure donation, not the async dispatch queue
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024  # VmHWM: this address space only (ru_maxrss survives exec, so it would include the forking parent)
print(base, peak, int(state.unsafe_buffer_pointer() == ptr), fn.stats.calls)
"""
    base, peak, same, calls = map(int, run_python(code).split())
    print(f"RSS before the state {base / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB")
    assert calls == 100 and same == 1
    assert peak - base < 1.5 * 2**30          # the state once (1 GiB), never a second copy
    assert peak < 1.5 * 2**30                 # the whole process, jax runtime included


def test_weight_check_is_remembered_until_the_file_changes(mlp_artifact, tmp_path):
    art = _copy(mlp_artifact, tmp_path)
    cache = str(tmp_path / "cache")
    runtime.load(art, cache_dir=cache)
    assert len(os.listdir(os.path.join(cache, "verified"))) == 1
    weights = os.path.join(art, "weights.safetensors")
    st = os.stat(weights)
    _flip_byte(weights, st.st_size - 10)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))   # same size and mtime: the stamp still matches
    runtime.load(art, cache_dir=cache)                        # (documented: only "full" re-hashes then)
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        runtime.load(art, cache_dir=cache, verify="full")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # any write moves the mtime
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        runtime.load(art, cache_dir=cache)


def test_executable_cache_refuses_a_directory_others_can_write(mlp_artifact, tmp_path, caplog):
    """Loading an entry runs its code: a world-writable cache is not read (nor written), and says so."""
    import logging

    from hloserve.runtime.exec_cache import ExecutableCache
    cache = tmp_path / "cache"
    runtime.load(mlp_artifact, cache_dir=str(cache)).functions["forward"](x=_x(2))   # fills it
    assert os.listdir(cache / "executables")
    os.chmod(cache / "executables", 0o777)
    with caplog.at_level(logging.WARNING, logger="hloserve.runtime"):
        assert ExecutableCache(str(cache)).refused
    assert any("writable by group or others" in r.getMessage() for r in caplog.records)
    m = runtime.load(mlp_artifact, cache_dir=str(cache))
    m.functions["forward"](x=_x(2))
    assert m.functions["forward"].stats.compiles == 1 and not m.functions["forward"].from_executable_cache(
        dict(m.functions["forward"].compiled_shapes[0]))
