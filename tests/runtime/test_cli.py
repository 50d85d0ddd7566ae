"""`hloserve run` and `hloserve bench` through the runtime, in a fresh process (which must not import torch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.runtime.conftest import REPO

CLI = """
import sys, json
from hloserve.server.cli import main
rc = main({argv!r})
print(json.dumps({{"rc": rc, "torch": "torch" in sys.modules}}))
"""


def _cli(argv):
    code = CLI.format(argv=list(argv))
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *out, last = proc.stdout.strip().splitlines()
    return json.loads(last), "\n".join(out), proc.stderr


def test_run_uses_the_runtime(mlp_artifact, tmp_path):
    import torch

    from tests.runtime.models import mlp_entry
    x = np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    r, _, err = _cli(["run", mlp_artifact, "--inputs", str(tmp_path / "in.npz"), "--outputs",
                      str(tmp_path / "out.npz"), "--cache-dir", str(tmp_path / "cache")])
    assert r == {"rc": 0, "torch": False}
    assert "y: float32[3, 64]" in err
    with torch.no_grad():
        want = mlp_entry().module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["y"], want, atol=1e-5, rtol=0)


def test_bench_prints_compile_latency_throughput(mlp_artifact, tmp_path):
    argv = ["bench", mlp_artifact, "--shape", "x:5x64", "--iters", "20", "--cache-dir", str(tmp_path / "c")]
    r, out, err = _cli(argv)
    assert r == {"rc": 0, "torch": False}
    assert "function: forward(x=f32[5,64])" in out
    assert "compile: " in out and "from the persistent cache" not in out
    assert "latency: p50 " in out and "p99 " in out and "over 20 calls" in out
    assert "rows/s (rows per call: 5)" in out
    assert "compiling forward" in err and "executable ready" in err      # progress on stderr
    r, out, _ = _cli([*argv, "-q"])
    assert "(from the persistent cache)" in out                           # second process: cache hit


def test_bench_shape_from_dims(mlp_artifact, tmp_path):
    r, out, _ = _cli(["bench", mlp_artifact, "--shape", "batch=2", "--iters", "3", "--no-cache", "-q"])
    assert "function: forward(x=f32[2,64])" in out


@pytest.mark.parametrize("shape,message", [
    ("x:5x", "--shape 'x:5x': expected INPUT:2x16"),
    ("y:5x64", "function 'forward' has no input 'y'"),
    ("x:100x64", "input 'x' dim 0: batch = 100 is outside its range [1, 64]"),
    ("x:5", "input 'x' has rank 1"),
    ("seq=4", "the shape of input 'x' (f32[batch,64]) needs batch"),
])
def test_bench_errors_are_one_line(mlp_artifact, shape, message, capsys):
    from hloserve.server.cli import main
    assert main(["bench", mlp_artifact, "--shape", shape, "--no-cache", "-q"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hloserve: error: ") and message in lines[0], lines


@pytest.mark.parametrize("damage,match", [
    ("header-length", "header length .* is beyond the file's"),
    ("truncate", "is truncated"),
    ("flip", "does not match its sha256"),
])
def test_inspect_names_a_corrupted_weights_file(mlp_artifact, tmp_path, damage, match):
    """One line naming the file and the fix, exit 1: a bad header length (no huge allocation), a
    truncated file (always checked), flipped bits (with --verify)."""
    import re
    import shutil
    art = str(tmp_path / "art")
    shutil.copytree(mlp_artifact, art)
    weights = os.path.join(art, "weights.safetensors")
    with open(weights, "r+b") as f:
        if damage == "header-length":
            f.write((1 << 62).to_bytes(8, "little"))
        elif damage == "truncate":
            f.truncate(os.path.getsize(weights) - 100)
        else:
            f.seek(-10, os.SEEK_END)
            b = f.read(1)
            f.seek(-10, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
    r, _, err = _cli(["inspect", art, *(["--verify"] if damage == "flip" else [])])
    assert r["rc"] == 1
    (line,) = [ln for ln in err.splitlines() if ln.startswith("hloserve: error:")]
    assert re.search(match, line) and "weights.safetensors" in line and "re-export" in line, line
