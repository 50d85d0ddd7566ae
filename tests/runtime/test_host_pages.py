"""Weights on a CPU host in 2 MiB pages (runtime/host_pages.py): the copy holds the file's values,
jax aliases it (no second copy), and where the kernel has transparent huge pages, huge pages back it."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch

from hloserve.runtime import host_pages


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise, never), None where it has none."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_copy_holds_the_values_read_only_on_a_huge_page_boundary():
    view = np.arange(3 * 1024 * 1024, dtype=np.int16).reshape(3, 1024, 1024)[:, ::-1]   # not contiguous
    copy = host_pages.copy_in_huge_pages(view)
    np.testing.assert_array_equal(copy, view)
    assert copy.dtype == view.dtype and copy.flags.c_contiguous and not copy.flags.writeable
    assert copy.ctypes.data % host_pages.HUGE_PAGE == 0
    with pytest.raises(ValueError):
        copy[0, 0, 0] = 1


def test_a_loaded_models_large_weights_are_aliased_copies_in_huge_pages(tmp_path):
    """A Linear of 1024 x 1024 f32 (4 MiB) loaded on the CPU: its device array is the 2 MiB-aligned
    copy itself (jax aliased it: one copy of the weights, not two), the outputs are torch's; and with
    the kernel's THP on, huge pages back the copy."""
    from hloserve.exporter.export import EntryPoint, export_artifact
    from hloserve.runtime import load

    torch.manual_seed(0)
    module = torch.nn.Linear(1024, 1024).eval()
    x = torch.randn(4, 1024)
    export_artifact(str(tmp_path / "art"), [EntryPoint("forward", module, (x,), input_names=["x"],
                                                       output_names=["y"])], source="test")
    model = load(str(tmp_path / "art"), cache_dir=str(tmp_path / "cache"))
    big = [a for a in model.weights.values() if a.nbytes >= host_pages.MIN_BYTES]
    small = [a for a in model.weights.values() if a.nbytes < host_pages.MIN_BYTES]
    assert len(big) == 1 and len(small) == 1
    address = big[0].unsafe_buffer_pointer()
    assert address % host_pages.HUGE_PAGE == 0
    with torch.no_grad():
        want = module(x).numpy()
    got = np.asarray(model.functions["forward"](x=x.numpy())["y"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if _thp_mode() in ("always", "madvise"):
        assert _huge_bytes_at(address) >= host_pages.HUGE_PAGE, "the weight's copy is in 4 KiB pages"


def test_jax_aliases_a_huge_page_copy_on_the_cpu():
    """What the load relies on: device_put of the aligned copy keeps its buffer (no second copy)."""
    copy = host_pages.copy_in_huge_pages(np.ones((1024, 1024), np.float32))
    placed = jax.device_put(copy, jax.devices("cpu")[0])
    assert placed.unsafe_buffer_pointer() == copy.ctypes.data


def test_a_zeroed_cache_moves_onto_huge_pages_in_place_and_keeps_serving_its_values():
    """The server's KV cache (server/core/model_runner.py): XLA's zeros, dropped and advised for huge
    pages; it still reads as zeros, a donated update writes into the same buffer, and with the
    kernel's THP on, huge pages back the written cache."""
    shape = (4, 1024, 1024)                                        # 8 MiB of int16: 3-4 whole huge pages
    cache = jax.jit(lambda: jax.numpy.zeros(shape, np.int16))()
    address = cache.unsafe_buffer_pointer()
    moved = host_pages.zeroed_in_huge_pages(cache)
    assert moved >= 3 * host_pages.HUGE_PAGE and moved % host_pages.HUGE_PAGE == 0
    assert not np.asarray(cache).any()
    write = jax.jit(lambda c, v: c + v, donate_argnums=0)
    cache = write(cache, np.int16(3))
    assert cache.unsafe_buffer_pointer() == address, "the donated cache moved: the advice is lost"
    got = np.asarray(cache)
    assert got.min() == got.max() == 3
    if _thp_mode() in ("always", "madvise"):
        first = -(-address // host_pages.HUGE_PAGE) * host_pages.HUGE_PAGE
        assert _huge_bytes_at(first) >= host_pages.HUGE_PAGE, "the written cache is in 4 KiB pages"


def test_a_zeroed_cache_is_faulted_in_by_a_background_thread_and_keeps_its_values():
    """With populate=True a daemon thread maps the cache's pages in (MADV_POPULATE_WRITE) before any
    step writes them, in huge pages where the kernel's THP is on; values written meanwhile and after
    are the values read (the thread maps pages, it writes nothing)."""
    import os
    import threading
    shape = (8, 1024, 1024)                                        # 16 MiB of int16
    cache = jax.jit(lambda: jax.numpy.zeros(shape, np.int16))()
    address = cache.unsafe_buffer_pointer()
    write = jax.jit(lambda c, v: c + v, donate_argnums=0)
    moved = host_pages.zeroed_in_huge_pages(cache, populate=True)
    assert moved >= 7 * host_pages.HUGE_PAGE
    for t in threading.enumerate():
        if t.name == "hloserve-populate":
            t.join(30)
            assert not t.is_alive()
    release = tuple(int(v) for v in os.uname().release.split(".")[:2] if v.isdigit())
    first = -(-address // host_pages.HUGE_PAGE) * host_pages.HUGE_PAGE
    if _thp_mode() in ("always", "madvise") and release >= (5, 14):    # mapped in, nothing written yet
        assert _huge_bytes_at(first) >= 7 * host_pages.HUGE_PAGE
    assert not np.asarray(cache).any()
    cache = write(cache, np.int16(2))
    got = np.asarray(cache)
    assert cache.unsafe_buffer_pointer() == address and got.min() == got.max() == 2
    again = jax.jit(lambda: jax.numpy.zeros(shape, np.int16))()       # ... and with a step writing meanwhile
    host_pages.zeroed_in_huge_pages(again, populate=True)
    again = write(again, np.int16(5))
    for t in threading.enumerate():
        if t.name == "hloserve-populate":
            t.join(30)
    got = np.asarray(again)
    assert got.min() == got.max() == 5


def test_a_cache_larger_than_the_available_memory_is_not_populated(monkeypatch):
    """Faulting in more than MemAvailable would bring the out-of-memory killer: such a cache is left
    to fault in as the steps write it."""
    import threading
    started = []
    monkeypatch.setattr(host_pages, "available_bytes", lambda: 4 * host_pages.HUGE_PAGE)
    monkeypatch.setattr(host_pages, "populate_in_background", lambda *a: started.append(a))
    cache = jax.jit(lambda: jax.numpy.zeros((8, 1024, 1024), np.int16))()   # 16 MiB > 0.8 x 8 MiB
    assert host_pages.zeroed_in_huge_pages(cache, populate=True) >= 7 * host_pages.HUGE_PAGE
    assert started == [] and not any(t.name == "hloserve-populate" for t in threading.enumerate())
    monkeypatch.undo()
    assert host_pages.available_bytes() > 16 << 20            # this machine's own figure


def test_the_available_memory_is_the_room_under_a_containers_limit(monkeypatch):
    """In a container /proc/meminfo reports the host; the cgroup's limit less its usage bounds it."""
    import io
    files = {"/proc/meminfo": "MemTotal: 100000000 kB\nMemAvailable: 90000000 kB\n",
             "/sys/fs/cgroup/memory.max": str(4 << 30), "/sys/fs/cgroup/memory.current": str(1 << 30)}

    def fake_open(path, *a, **k):
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])
    monkeypatch.setattr(host_pages, "open", fake_open, raising=False)
    assert host_pages.available_bytes() == 3 << 30
    files["/sys/fs/cgroup/memory.max"] = "max"                       # no limit: the host's figure
    assert host_pages.available_bytes() == 90000000 * 1024


def test_memory_that_is_not_anonymous_and_private_is_left_alone(tmp_path):
    """Dropped pages of a file mapping would read the file back, not zeros: refused."""
    import mmap
    path = tmp_path / "f"
    path.write_bytes(b"\1" * (4 * host_pages.HUGE_PAGE))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
    start = np.frombuffer(m, np.uint8, count=1).ctypes.data
    assert not host_pages._anonymous_private(start, start + host_pages.HUGE_PAGE)
    anon = mmap.mmap(-1, 4 * host_pages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = np.frombuffer(anon, np.uint8, count=1).ctypes.data
    assert host_pages._anonymous_private(start, start + 2 * host_pages.HUGE_PAGE)
    m.close(), anon.close()
