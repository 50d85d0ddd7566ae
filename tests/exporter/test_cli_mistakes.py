"""The CLI as a newcomer meets it: a mistake is one line, a non-zero exit, within a second, and
nothing left behind."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hloserve(*argv: str, cwd: str = REPO, python: tuple[str, ...] = ()) -> tuple[int, str]:
    p = subprocess.run([sys.executable, *python, "-m", "hloserve.server.cli", *argv], capture_output=True,
                       text=True, cwd=cwd, timeout=300)
    return p.returncode, p.stderr


@pytest.mark.parametrize("argv,fragment", [
    (["export", "all-minilm-l6-v2", "-o", "{out}", "--platforms", "gpu"], "--platforms gpu: lowering platforms are"),
    (["export", "all-minilm-l6-v2", "-o", "{file}"], "is a file; give a directory"),
    (["export", "all-minilm-l6-v2", "-o", "{busy}"], "non-empty directory that is not an artifact"),
    (["export", "all-minilm-l6-v2", "-o", "{out}", "--dynamic", "input_ids:0=batch[1,"], "is not DIM=NAME[min,max]"),
    (["export", "all-minilm-l6-v2", "-o", "{out}", "--dynamic", "input_ids0=batch"], "needs INPUT:DIM=NAME"),
    (["export", "all-minilm-l6-v2", "-o", "{out}", "--dynamic", "input_ids:0=batch[9,2]"], "is empty (min > max)"),
    (["export", "all-minilm-l6-v2", "-o", "{out}", "--pad", "batch;seq"], "give dim names separated by commas"),
])
def test_bad_export_options_fail_fast_with_one_line(tmp_path, argv, fragment):
    (tmp_path / "file").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    paths = {"out": str(tmp_path / "out"), "file": str(tmp_path / "file"), "busy": str(tmp_path / "busy")}
    rc, err = _hloserve(*[a.format(**paths) for a in argv])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 1 and len(lines) == 1 and fragment in lines[0], err
    assert not os.path.exists(tmp_path / "out")


def test_bad_options_are_refused_before_torch_or_jax_is_imported(tmp_path):
    """Fail fast: a mistake in the options is found before the heavy imports (seen in -X importtime's
    list of the modules the run imported, not on a clock)."""
    rc, err = _hloserve("export", "all-minilm-l6-v2", "-o", str(tmp_path / "o"), "--pad", "batch;seq",
                        python=("-X", "importtime"))
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in err.splitlines() if ln.startswith("import time:")}
    assert rc == 1 and "hloserve.server" in imported, err[-2000:]
    assert not {"torch", "jax", "transformers"} & imported, sorted(imported & {"torch", "jax", "transformers"})


def test_a_failed_export_leaves_no_directory(tmp_path):
    rc, err = _hloserve("export", "pkg_not_there:make", "-o", str(tmp_path / "out"))
    assert rc == 1 and "cannot import pkg_not_there:make" in err
    assert not os.path.exists(tmp_path / "out")


def test_debug_is_accepted_after_the_subcommand(tmp_path):
    rc, err = _hloserve("inspect", str(tmp_path / "nope"), "--debug")
    assert rc != 0 and "ArtifactError" in err          # --debug shows the traceback


def test_module_factory_imports_from_the_current_directory(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\ndef make():\n    return torch.nn.Linear(4, 2), (torch.zeros(1, 4),)\n")
    rc, err = _hloserve("export", "mymodels:make", "-o", str(tmp_path / "art"), "-q", cwd=str(tmp_path))
    assert rc == 0, err
    assert os.path.exists(tmp_path / "art" / "manifest.json")
