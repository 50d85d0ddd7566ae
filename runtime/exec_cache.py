"""On-disk cache of compiled executables, keyed without lowering.

jax's persistent compilation cache (configured in client.py) keys on the
lowered HLO, so a warm process still pays for lowering the artifact's module
(~0.5 s for MiniLM) before it can look anything up. This cache sits in front of
it: the key is computed from what the manifest already pins down (the
function file's sha256, the concrete symbol values, donation, shardings,
devices, jax/jaxlib and backend versions), so a warm start deserializes the
executable directly. A miss falls through to jax (and its cache), and the
result is written here.

Entries live in CACHE_DIR/executables/<key>.bin and are written atomically.
Loading an entry runs its code, so a directory another user owns or that group/others may write is
refused (every lookup a miss, with one warning naming it); the directory is created 0700.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from typing import Any, Mapping, Sequence

import jax

LOG = logging.getLogger("hloserve.runtime")
_FORMAT = 1


class ExecutableCache:
    """A directory of serialized executables; every failure is a miss, never an error."""

    def __init__(self, cache_dir: str):
        self.dir = os.path.join(cache_dir, "executables")
        self.refused = self._untrusted(cache_dir)
        if self.refused:
            LOG.warning("executable cache %s not used: %s (loading an entry runs its code); fix the permissions "
                        "(chmod go-w, or own it) or point HLOSERVE_CACHE elsewhere", self.dir, self.refused)

    @staticmethod
    def _untrusted(cache_dir: str) -> str | None:
        """Why the directory (or the cache root above it) may hold entries written by someone else, or None."""
        for d in (cache_dir, os.path.join(cache_dir, "executables")):
            try:
                st = os.stat(d)
            except OSError:
                continue
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                return f"{d} belongs to another user (uid {st.st_uid})"
            if st.st_mode & 0o022:
                return f"{d} is writable by group or others (mode {st.st_mode & 0o777:o})"
        return None

    @staticmethod
    def key(parts: Mapping[str, Any]) -> str:
        blob = json.dumps({"format": _FORMAT, "jax": jax.__version__, "jaxlib": jax.lib.__version__, **parts},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, f"{key}.bin")

    def get(self, key: str, devices: Sequence[Any]) -> Any | None:
        """The executable for `key` loaded onto `devices` (in compile order), or None."""
        path = self._path(key)
        if self.refused or not os.path.exists(path):
            return None
        from jax.experimental import serialize_executable
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree = pickle.load(f)
            return serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, backend=devices[0].client, execution_devices=list(devices))
        except Exception as e:  # noqa: BLE001 - a bad entry is a miss; it is rewritten after compiling
            LOG.warning("executable cache entry %s is unreadable (%s: %s); recompiling", path, type(e).__name__, e)
            return None

    def evict(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except OSError:
            pass

    def put(self, key: str, compiled: Any) -> None:
        from jax.experimental import serialize_executable
        if self.refused:
            return
        try:
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            tmp = f"{self._path(key)}.{os.getpid()}.partial"
            with open(tmp, "wb") as f:
                pickle.dump((blob, in_tree, out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._path(key))
        except Exception as e:  # noqa: BLE001 - caching is an optimization; the executable still runs
            LOG.info("executable not written to the cache %s (%s: %s)", self.dir, type(e).__name__, e)
