"""A small disk to fill up, for the disk-full tests: a tmpfs mounted for the test and filled with
one file until only `leave` bytes are free (delete the file to make room again).

    with small_disk(str(tmp_path / "disk"), "4m") as disk:
        filler = fill(disk, leave=64 << 10)
        ...                       # writes under `disk` fail with ENOSPC
        os.remove(filler)         # room again

Mounting needs root (the suite runs as root); where it is not allowed the test is skipped with the
reason. The mount's root is mode 0700, as a cache root must be to be trusted (runtime/paths.py).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from typing import Iterator

import pytest

BLOCK = 1 << 16


@contextlib.contextmanager
def small_disk(path: str, size: str) -> Iterator[str]:
    """A tmpfs of `size` (mount's syntax: "4m") mounted at `path` for the block; unmounted after."""
    os.makedirs(path, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                              capture_output=True, text=True, timeout=60)
    except OSError as e:
        pytest.skip(f"cannot run mount ({e}): the disk-full tests mount a small tmpfs")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} ({proc.stderr.strip() or proc.returncode}): the disk-full "
                    f"tests need root and permission to mount")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", path], capture_output=True, timeout=60)


def fill(disk: str, leave: int = 0) -> str:
    """Fill `disk` with one file until at most `leave` bytes are free; returns the file's path."""
    filler = os.path.join(disk, "filler")
    with open(filler, "ab", buffering=0) as f:
        while (free := shutil.disk_usage(disk).free) > leave:
            try:
                f.write(b"\0" * min(BLOCK, free - leave))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    return filler


def files_under(root: str, *, but: tuple[str, ...] = ("filler",)) -> list[str]:
    """Every file under `root` (relative paths, sorted), but those named in `but`."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names
                  if os.path.relpath(os.path.join(d, n), root) not in but)
