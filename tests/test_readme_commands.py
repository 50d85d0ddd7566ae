"""The README's command walkthrough, executed: every `hloserve` line of its "Using it" block whose
inputs exist here runs through the real CLI (in a scratch directory, in order, so `out/minilm`
exported by one line is what the next ones inspect, bench and convert) and must exit 0. Lines whose
inputs are placeholders for the reader's own files (path/to/..., model.pt2, mypkg, SRC, out/m,
in.npz) are parsed only (tests/test_docs.py), and `serve` lines run as servers elsewhere
(tests/server/test_serve_default.py executes the README's Python example against one)."""
from __future__ import annotations

import os
import shlex

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDERS = ("path/to/", "model.pt2", "mypkg", "SRC", "out/m ", "in.npz")


def walkthrough() -> list[list[str]]:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    block = text.split("## Using it", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        line = line.strip()
        if not line.startswith("hloserve ") or any(p in line + " " for p in PLACEHOLDERS):
            continue
        argv = shlex.split(line, comments=True)[1:]
        if argv[0] != "serve":
            out.append(argv)
    return out


def test_readme_walkthrough_runs(tmp_path, monkeypatch):
    from hloserve.server.cli import main
    commands = walkthrough()
    assert [a[0] for a in commands] == ["export", "export", "export", "inspect", "bench", "tf"], commands
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert main(argv) == 0, " ".join(argv)
    assert os.path.exists(tmp_path / "savedmodel" / "minilm" / "1" / "saved_model.pb")
    functions = os.listdir(tmp_path / "out" / "smollm2" / "functions")
    assert all(any(f.startswith(name + ".") for f in functions) for name in ("prefill", "decode")), functions
