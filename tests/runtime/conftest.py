"""Artifacts exported once per session for the runtime tests."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def mlp_artifact(tmp_path_factory) -> str:
    from hloserve.exporter.export import export_artifact
    from tests.runtime.models import mlp_entry
    out = str(tmp_path_factory.mktemp("mlp") / "art")
    export_artifact(out, [mlp_entry()], source="tests.runtime.models:mlp_entry")
    return out


@pytest.fixture(scope="session")
def state_artifact(tmp_path_factory) -> str:
    from hloserve.exporter.export import export_artifact
    from tests.runtime.models import state_entry
    out = str(tmp_path_factory.mktemp("state") / "art")
    export_artifact(out, [state_entry()], source="tests.runtime.models:state_entry")
    return out


def run_python(code: str, *, env: dict | None = None, timeout: float = 300) -> str:
    """Run `code` in a fresh interpreter (the repo on sys.path); returns stdout, fails with stderr."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, full_env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout
