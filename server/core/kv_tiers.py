"""Prefix-cache tiers below the device: full KV blocks kept in host RAM and on disk (data, never code).

A full block's chained hash (core/block_manager.py: equal hash = equal prefix) names its K/V in
every tier. The device holds what running requests use; when a block becomes full, the runner
copies it once to `KVTiers` (the plan's `kv_saves`), which keeps it

    host   HostBlockCache: numpy arrays in RAM, least recently used dropped past a byte bound
    disk   DiskBlockCache: one file per block under DIR/<artifact digest>/<hash>.kvb, written by a
           background thread (a step never waits on the disk), least recently used (mtime) removed
           past a byte bound, so replicas mounting one directory share what each computed, and a
           restart serves a known prefix from disk

and a prefix lookup that runs out of device blocks goes on through host, then disk
(`BlockManager.find_cached_prefix`): the blocks found there are copied into fresh device blocks
before the step that reads them (the plan's `kv_loads`). A preempted request's full blocks were
saved when they filled, so its readmission loads them instead of recomputing them.

A disk entry is one JSON header line (format, the artifact's digest, the block's hash, dtype,
shape, the payload's sha256) and then the raw K/V bytes. Nothing is unpickled: the header is parsed
as JSON and checked against what the lookup expects, the payload's digest is recomputed, and a
damaged, truncated or foreign entry is a miss (removed, counted, logged once): the block is
recomputed and saved again, never trusted. A directory another user owns or that group/others may
write is refused, as for the executable cache (an entry decides what the model attends to). A disk
that fills stops disk writes for the process, with one warning; serving goes on.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
from typing import Sequence

import numpy as np
from hloserve.runtime.paths import disk_full, untrusted, write_atomically

log = logging.getLogger("hloserve.server.kv_tiers")
FORMAT = 1
SUFFIX = ".kvb"
HOST, DISK = "host", "disk"
WRITE_QUEUE = 4096   # blocks waiting for the disk writer; past it a block is not written (counted)


def artifact_digest(manifest_json: dict) -> str:
    """The key of an artifact's blocks: sha256 of its manifest (which pins every weight's and
    function's sha256 and the KV layout), so blocks of another model or export never match."""
    return hashlib.sha256(json.dumps(manifest_json, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """What one block's K/V is: the cache's shape without its num_blocks dim, and its dtype."""
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class HostBlockCache:
    """Blocks in host RAM by hash, least recently used first out past `capacity_bytes`."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._blocks: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        return h in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, h: bytes) -> np.ndarray | None:
        a = self._blocks.get(h)
        if a is not None:
            self._blocks.move_to_end(h)
        return a

    def put(self, h: bytes, a: np.ndarray) -> None:
        if a.nbytes > self.capacity_bytes:
            return
        old = self._blocks.pop(h, None)
        self.nbytes += a.nbytes - (old.nbytes if old is not None else 0)
        self._blocks[h] = a
        while self.nbytes > self.capacity_bytes:
            _, dropped = self._blocks.popitem(last=False)
            self.nbytes -= dropped.nbytes


@dataclasses.dataclass(frozen=True)
class EntryHeader:
    """The first line of a disk entry (JSON)."""
    format: int
    artifact: str
    block: str          # the block's chained hash, hex
    dtype: str
    shape: tuple[int, ...]
    payload_sha256: str

    def to_line(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> "EntryHeader":
        d = json.loads(line.decode("utf-8"))
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format') if isinstance(d, dict) else '?'} is not {FORMAT}")
        return cls(FORMAT, str(d["artifact"]), str(d["block"]), str(d["dtype"]), tuple(int(x) for x in d["shape"]),
                   str(d["payload_sha256"]))


class DiskBlockCache:
    """Blocks as files under `root/<digest>/`; every failure to read is a miss, never an error."""

    def __init__(self, root: str, digest: str, layout: BlockLayout, capacity_bytes: int):
        self.dir = os.path.join(root, digest)
        self.digest, self.layout, self.capacity_bytes = digest, layout, capacity_bytes
        self.entry_bytes = layout.nbytes + 512      # payload + header, for the byte bound
        self.writes = self.rejected = self.dropped = 0
        self.full = False
        self.refused = untrusted(root, self.dir)
        if self.refused:
            log.warning("KV disk cache %s not used: %s (an entry decides what the model attends to); fix the "
                        "permissions (chmod go-w, or own it) or point --kv-disk-dir elsewhere", self.dir, self.refused)
            return
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        except OSError as e:
            self.refused = f"{self.dir} cannot be made ({e.strerror or e})"
            log.warning("KV disk cache not used: %s", self.refused)
            return
        self._count = len(self._entries())
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="hloserve-kv-disk", daemon=True)
        self._writer.start()

    def path(self, h: bytes) -> str:
        return os.path.join(self.dir, h.hex() + SUFFIX)

    def __contains__(self, h: bytes) -> bool:
        return not self.refused and os.path.exists(self.path(h))

    def read(self, h: bytes) -> np.ndarray | None:
        """The block saved under `h`, checked; None (the file removed) if it is absent, damaged or foreign."""
        if self.refused:
            return None
        path = self.path(h)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            return None
        try:
            line, sep, payload = blob.partition(b"\n")
            if not sep:
                raise ValueError("no header line")
            header = EntryHeader.parse(line)
            want = (self.digest, h.hex(), self.layout.dtype, self.layout.shape)
            got = (header.artifact, header.block, header.dtype, header.shape)
            if got != want:
                raise ValueError(f"written for {got}, looked up for {want}")
            if len(payload) != self.layout.nbytes or hashlib.sha256(payload).hexdigest() != header.payload_sha256:
                raise ValueError("payload digest mismatch (truncated or overwritten)")
        except Exception as e:  # noqa: BLE001 - a bad entry is a miss: the block is recomputed and saved again
            self.rejected += 1
            log.warning("KV disk cache entry %s not used (%s: %s); recomputing the block", path, type(e).__name__, e)
            self._remove(path)
            return None
        try:
            os.utime(path)            # least recently used by mtime
        except OSError:
            pass
        return np.frombuffer(payload, self.layout.dtype).reshape(self.layout.shape)

    def write(self, h: bytes, a: np.ndarray) -> None:
        """Queue `a` to be written under `h` (the writer thread writes it whole or not at all)."""
        if self.refused or self.full:
            return
        try:
            self._queue.put_nowait((h, a))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self.refused:
            return
        self._queue.put((None, None))
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            h, a = self._queue.get()
            if h is None:
                return
            if not self.full and h not in self:
                self._write_one(h, a)

    def _write_one(self, h: bytes, a: np.ndarray) -> None:
        payload = memoryview(np.ascontiguousarray(a)).cast("B")      # written and hashed where it lies
        header = EntryHeader(FORMAT, self.digest, h.hex(), self.layout.dtype, self.layout.shape,
                             hashlib.sha256(payload).hexdigest())
        try:
            write_atomically(self.path(h), [header.to_line(), payload])
        except OSError as e:
            if disk_full(e):
                self.full = True
                log.warning("the disk holding %s is full (%s): KV blocks are not written to it for the rest of "
                            "this process; free space there or lower --kv-disk-cache-mib", self.dir, e.strerror or e)
            else:
                log.info("KV block not written to %s (%s)", self.dir, e)
            return
        self.writes += 1
        self._count += 1
        if self._count * self.entry_bytes > self.capacity_bytes:
            self._trim()

    def _entries(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.dir) if n.endswith(SUFFIX)]
        except OSError:
            return []

    def _trim(self) -> None:
        """Remove the least recently used entries (by mtime) until the directory holds 90% of the bound
        (replicas sharing it each trim what they see)."""
        stamped = []
        for name in self._entries():
            try:
                stamped.append((os.stat(os.path.join(self.dir, name)).st_mtime, name))
            except OSError:
                continue
        stamped.sort()
        keep = int(0.9 * self.capacity_bytes) // self.entry_bytes
        for _, name in stamped[:max(0, len(stamped) - keep)]:
            self._remove(os.path.join(self.dir, name))
        self._count = min(len(stamped), keep)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass


class KVTiers:
    """The tiers below the device, as the block manager (lookups) and the runner (copies) see them.

    `holds(h)`: a save would be redundant. `get(h)`: (the block, the tier it came from) or None; a
    disk hit is kept in host RAM too. `put(h, a)`: into host RAM and queued for the disk.

    `put_later(hashes, blocks)`: saves whose K/V is still being computed (the runner's gather, a
    device array sent with a step): reading it now would wait for the device, so it is read at
    `land()` (the runner's `collect`, while the step behind the gather runs; `close()`). Until then
    the hashes are held, and a `get` of one lands every pending save first, so a block is never
    missed, nor served before its save: one wait for the device in that rare case (a prefix looked
    up in the step right after it filled, its device block already reused).
    """

    def __init__(self, host: HostBlockCache | None, disk: DiskBlockCache | None):
        self.host, self.disk = host, disk
        self.saved = self.loaded = 0
        self._pending: list[tuple[Sequence[bytes], object]] = []   # (hashes, their blocks), in order
        self._pending_hashes: set[bytes] = set()

    def holds(self, h: bytes) -> bool:
        return (h in self._pending_hashes or (self.host is not None and h in self.host)
                or (self.disk is not None and h in self.disk))

    def get(self, h: bytes) -> tuple[np.ndarray, str] | None:
        if h in self._pending_hashes:
            self.land()
        a = self.host.get(h) if self.host is not None else None
        if a is not None:
            return a, HOST
        a = self.disk.read(h) if self.disk is not None else None
        if a is None:
            return None
        if self.host is not None:
            self.host.put(h, a)
        return a, DISK

    def put(self, h: bytes, a: np.ndarray) -> None:
        self.saved += 1
        if self.host is not None:
            self.host.put(h, a)
        if self.disk is not None:
            self.disk.write(h, a)

    def put_all(self, hashes: Sequence[bytes], arrays: Sequence[np.ndarray]) -> None:
        for h, a in zip(hashes, arrays):
            self.put(h, a)

    def put_later(self, hashes: Sequence[bytes], blocks) -> None:
        """Save `blocks` ([>= len(hashes), *block], anything np.asarray reads; rows past the hashes are
        padding) under `hashes` at the next `land()`."""
        self._pending.append((hashes, blocks))
        self._pending_hashes.update(hashes)

    def land(self) -> None:
        """The pending saves read to the host and put, in the order they were made."""
        pending, self._pending = self._pending, []
        self._pending_hashes.clear()
        for hashes, blocks in pending:
            data = np.asarray(blocks)
            # each block its own copy: a view would keep the whole padded gather alive past the host bound
            self.put_all(hashes, [np.array(a) for a in data[:len(hashes)]])

    def close(self) -> None:
        """Land the pending saves, then write what is queued for the disk."""
        self.land()
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, float]:
        """The runner's counters for /metrics (hloserve:kv_*)."""
        out = {"kv_tier_saved_blocks_total": self.saved, "kv_tier_loaded_blocks_total": self.loaded}
        if self.host is not None:
            out.update(kv_host_cache_blocks=len(self.host), kv_host_cache_bytes=self.host.nbytes)
        if self.disk is not None:
            out.update(kv_disk_cache_writes_total=self.disk.writes, kv_disk_cache_rejected_total=self.disk.rejected,
                       kv_disk_cache_dropped_total=self.disk.dropped)
        return out


def make_tiers(*, host_bytes: int, disk_bytes: int, disk_root: str, digest: str,
               layout: BlockLayout) -> KVTiers | None:
    """The tiers a server keeps (a bound of 0 turns a tier off); None when both are off."""
    host = HostBlockCache(host_bytes) if host_bytes > 0 else None
    disk = DiskBlockCache(disk_root, digest, layout, disk_bytes) if disk_bytes > 0 else None
    if disk is not None and disk.refused:
        disk = None
    return KVTiers(host, disk) if host is not None or disk is not None else None
