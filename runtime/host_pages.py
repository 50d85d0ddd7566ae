"""Weights and the KV cache on a CPU host in 2 MiB pages.

An artifact's weights are memory-mapped views of its safetensors file, and jax aliases them on the
CPU (no copy): a step then streams its matrices out of the page cache through 4 KiB mappings, and
the hardware prefetchers stop at every 4 KiB page. From 2 MiB pages a 1 GiB read with both cores of
a 2-core AMD EPYC ran 0-5% faster (once 59 against 34 GB/s), and the 1B shape's decode step 8-15%
faster (2026-11-30, docs/performance.md, "Weights in 2 MiB pages"). So on a CPU, each large weight
is copied once at load into anonymous memory aligned to 2 MiB and advised MADV_HUGEPAGE (the
kernel backs it with huge pages where it has them free; where it had not at the copy,
MADV_COLLAPSE asks again), and the device array aliases that copy. Where the kernel has no
transparent huge pages the copy still holds the weights, in 4 KiB pages, as fast as before.

The server's KV cache is XLA's own buffer (a copy jax aliased could not be donated from step to
step), so it moves onto huge pages in place, once, while it is all zeros (`zeroed_in_huge_pages`),
and a background thread faults those pages in before the steps write them (`populate_in_background`).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
from typing import Any

import numpy as np

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE          # smaller weights stay views: a huge page each would mostly be padding
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)   # Linux 6.1+; Python names it from 3.13 on


def copy_in_huge_pages(view: np.ndarray) -> np.ndarray:
    """A read-only copy of `view` starting on a 2 MiB boundary of anonymous memory advised for huge
    pages (the mapping lives as long as the returned array)."""
    size = -(-view.nbytes // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -np.frombuffer(buf, np.uint8, count=1).ctypes.data % HUGE_PAGE
    advise(buf, getattr(mmap, "MADV_HUGEPAGE", None), start, size)
    out = np.frombuffer(buf, view.dtype, count=view.size, offset=start).reshape(view.shape)
    np.copyto(out, view)
    advise(buf, _MADV_COLLAPSE, start, size)
    out.flags.writeable = False
    return out


def advise(buf: mmap.mmap, option: int | None, start: int, length: int) -> None:
    """madvise, where this kernel and Python know `option` (an advice is a hint: refusals are fine)."""
    if option is None or not hasattr(buf, "madvise"):
        return
    try:
        buf.madvise(option, start, length)
    except OSError:
        pass


def zeroed_in_huge_pages(array: Any, populate: bool = False) -> int:
    """Move a freshly zeroed device array's CPU buffers onto 2 MiB pages, in place: state a step reads
    every call and keeps (the server's KV cache, donated from step to step, so its buffer stays where
    it is). Each buffer's 2 MiB-aligned interior is advised MADV_HUGEPAGE and its pages dropped
    (MADV_DONTNEED: anonymous memory reads back as zeros, which is what the array holds), so the
    steps' first writes fault it back in huge pages. Collapsing the touched pages instead
    (MADV_COLLAPSE) took 3 s a GiB. A decode step reads each sequence's blocks, a few KiB apiece, and
    from 4 KiB pages the hardware prefetchers stop at every page boundary (docs/performance.md, "The
    KV cache in 2 MiB pages"). Only for an array of zeros that nothing else has read the address of;
    a buffer in memory that is not anonymous and private is left as it is. Returns the bytes moved:
    0 off Linux, for arrays on other devices, or where the kernel refuses.

    With `populate`, a background thread then faults the pages in (`populate_in_background`), so the
    steps do not: a step that writes a block for the first time paid for zeroing its pages, and on a
    2-core EPYC VM that ran at ~0.5 GB/s (1 GiB in 1.95 s), 4% of a fresh server's first long prompts
    and up to a third of its first c=16 round on the 1B shapes, whose blocks are 0.2-1.8 MB
    (docs/performance.md, "A fresh server's first prompts pay for the KV cache's pages")."""
    if sys.platform != "linux":
        return 0
    done, moved = 0, []
    for shard in getattr(array, "addressable_shards", ()):
        data = shard.data
        if shard.device.platform != "cpu" or data.nbytes < HUGE_PAGE:
            continue
        start = data.unsafe_buffer_pointer()
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        last = (start + data.nbytes) // HUGE_PAGE * HUGE_PAGE
        if last > first and _anonymous_private(first, last) \
                and _madvise(first, last - first, getattr(mmap, "MADV_HUGEPAGE", 14)) \
                and _madvise(first, last - first, getattr(mmap, "MADV_DONTNEED", 4)):
            done += last - first
            moved.append((first, last - first))
    if populate and done <= 0.8 * available_bytes():      # every shard's pages, or none
        for first, length in moved:
            populate_in_background(first, length)
    return done


def available_bytes() -> float:
    """The memory this process may still fault in: MemAvailable of /proc/meminfo, and below it the
    room left under its cgroup's limit (a container's: /proc/meminfo there reports the whole host's);
    infinite where neither says. A cache larger than this is left to fault in as steps write it
    (populating it all would bring the out-of-memory killer, where the blocks a server uses may fit)."""
    room = [float("inf")]
    try:
        with open("/proc/meminfo") as f:
            room += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),                     # v2
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f, open(usage) as g:
                room.append(int(f.read()) - int(g.read()))          # "max" (no limit) is not a number
        except (OSError, ValueError):
            pass
    return min(room)


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux 5.14+
POPULATE_PIECE = 64 << 20


def populate_in_background(address: int, length: int) -> threading.Thread:
    """Fault [address, address + length) in, writable, from a daemon thread at SCHED_IDLE priority
    (it takes only cores nothing else wants: a server's warm-up, its idle seconds), 64 MiB a call.
    MADV_POPULATE_WRITE maps the pages without writing them, so it changes no value a step reads or
    writes meanwhile; where the kernel refuses (older than 5.14, memory gone) it stops."""
    def run() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        for at in range(address, address + length, POPULATE_PIECE):
            if not _madvise(at, min(POPULATE_PIECE, address + length - at), _MADV_POPULATE_WRITE):
                return
    thread = threading.Thread(target=run, name="hloserve-populate", daemon=True)
    thread.start()
    return thread


def _anonymous_private(first: int, last: int) -> bool:
    """Whether [first, last) lies in private anonymous mappings of this process (/proc/self/maps: no
    file, 'p' in the permissions), where dropped pages come back as zeros."""
    covered = first
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if hi <= covered or lo > covered:
                continue
            if not fields[1].endswith("p") or fields[4] != "0" or (len(fields) > 5 and fields[5] != "[heap]"):
                return False
            covered = hi
            if covered >= last:
                return True
    return False


def _madvise(address: int, length: int, option: int) -> bool:
    """madvise(2) on memory this process did not map through Python (a device buffer); False where
    the kernel refuses."""
    return _libc_madvise()(address, length, option) == 0


@functools.cache
def _libc_madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise
