"""A full disk under the runtime's caches (a small tmpfs, tests/support/disk.py): loading and running
go on without caching, with one warning; nothing half-written is left that a later start would read;
the next load on a disk with room computes the same and caches again.

The write points: the weights stamp (runtime/model.py), jax's persistent cache and hloserve's
executable cache (runtime/exec_cache.py), and the CPU kernel library (runtime/kernels/cpu/build.py).
"""
from __future__ import annotations

import logging
import os
import shutil

import jax
import numpy as np
import pytest

from hloserve import runtime
from hloserve.runtime._private import unreadable_compile_cache_entries
from hloserve.runtime.artifact import LLMSpec, pack_step
from hloserve.runtime.client import configure_compile_cache
from tests.support.disk import fill, files_under, small_disk

from .test_golden import ART, GOLDEN


@pytest.fixture
def disk(tmp_path):
    with small_disk(str(tmp_path / "disk"), "4m") as root:
        yield root


@pytest.fixture
def jax_cache_kept():
    """jax's persistent-cache setting is process-wide: put back as it was after the test."""
    enabled, where = jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir
    yield
    configure_compile_cache(where if enabled and where else None)


def prefill_logits(model) -> np.ndarray:
    """The golden tiny Llama's prefill logits for the prompt stored beside it."""
    prompt = np.load(os.path.join(GOLDEN, "tiny_llama_v1_expected.npz"))["prompt"].tolist()
    llm = LLMSpec.of(model.manifest, ART)
    cache = np.zeros(llm.kv_cache.concrete_shape(6), llm.kv_cache.numpy_dtype)
    out = model.functions["prefill"](**pack_step([(prompt, 0, [1, 2])], 8, pad_tokens=16, pad_seqs=2), kv_cache=cache)
    return np.asarray(out["logits"])[:1]


def test_a_load_on_a_full_cache_disk_runs_uncached_and_leaves_nothing_half_written(disk, jax_cache_kept, caplog):
    """16 KiB free: the weights stamp fits, jax's entry for the prefill (~31 KB) is cut short, hloserve's
    (~130 KB) does not fit. The load runs and computes the golden logits; one warning says caching
    stopped; jax's cut entry is removed and nothing else is left but the stamp. With room, the next
    load computes the same logits and writes both caches' entries."""
    want = np.load(os.path.join(GOLDEN, "tiny_llama_v1_expected.npz"))["prefill_logits"]
    tol = dict(rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))    # test_golden.py's bound
    xla = os.path.join(disk, "xla")
    filler = fill(disk, leave=16 << 10)
    with caplog.at_level(logging.INFO, logger="hloserve.runtime"):
        np.testing.assert_allclose(prefill_logits(runtime.load(ART, cache_dir=xla)), want, **tol)
    full = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1 and "not cached for the rest of this process" in full[0], full
    assert "1 entries of jax's cache left cut short removed" in full[0], full[0]
    assert not jax.config.jax_enable_compilation_cache                       # jax writes nothing more either
    left = files_under(disk)
    assert [f for f in left if not f.startswith("xla/verified/")] == [], left
    assert all(f.endswith(".json") for f in left), left                      # the stamp, whole

    os.remove(filler)
    np.testing.assert_allclose(prefill_logits(runtime.load(ART, cache_dir=xla)), want, **tol)
    written = files_under(disk)
    assert any(f.startswith("xla/executables/") and f.endswith(".xla") for f in written), written
    assert any(f.endswith("-cache") for f in written), written
    assert unreadable_compile_cache_entries(xla, 0) == []


def test_the_kernel_library_on_a_full_cache_disk_is_kept_for_the_process_only(disk, tmp_path, caplog):
    """Built, it cannot be kept in the cache (its record fits, the library does not): it is kept in
    the process's private place with one warning, and the cache holds no file, neither the library
    nor the record written for it. With room it is kept in the cache, where the next start loads it
    (its record checks)."""
    from hloserve.runtime.kernels.cpu import build
    lib = build.library()
    if lib is None:
        pytest.skip("the CPU kernels are off or cannot be built here")
    path = os.path.join(disk, "kernels", lib.digest[:24], "libhloserve_cpu.so")

    def built(name: str) -> str:     # a fresh build's output: what _keep gets
        return shutil.copy(lib.path, tmp_path / name)

    filler = fill(disk, leave=4 << 10)     # room for the record, not for the library
    with caplog.at_level(logging.WARNING, logger="hloserve.runtime"):
        kept = build._keep(built("a.so"), path, lib.digest, str(tmp_path / "private.so"))
    assert kept == str(tmp_path / "private.so") and open(kept, "rb").read() == open(lib.path, "rb").read()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "cannot be kept in" in warning and "No space left on device" in warning, warning
    assert files_under(disk) == []

    os.remove(filler)
    assert build._keep(built("b.so"), path, lib.digest, str(tmp_path / "private2.so")) == path
    assert build._check_built(path, lib.digest) is None
