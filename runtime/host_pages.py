"""Weights on a CPU host in 2 MiB pages.

An artifact's weights are memory-mapped views of its safetensors file, and jax aliases them on the
CPU (no copy): a step then streams its matrices out of the page cache through 4 KiB mappings, and
the hardware prefetchers stop at every 4 KiB page. From 2 MiB pages a 1 GiB read with both cores of
a 2-core AMD EPYC ran 0-5% faster (once 59 against 34 GB/s), and the 1B shape's decode step 8-15%
faster (2026-11-30, docs/performance.md, "Weights in 2 MiB pages"). So on a CPU, each large weight
is copied once at load into anonymous memory aligned to 2 MiB and advised MADV_HUGEPAGE (the
kernel backs it with huge pages where it has them free; where it had not at the copy,
MADV_COLLAPSE asks again), and the device array aliases that copy. Where the kernel has no
transparent huge pages the copy still holds the weights, in 4 KiB pages, as fast as before.
"""
from __future__ import annotations

import mmap

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
