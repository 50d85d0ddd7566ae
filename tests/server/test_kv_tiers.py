"""Prefix-cache tiers (server/core/kv_tiers.py): host RAM and disk below the device's blocks.

The caches alone (LRU by bytes, disk entries checked and a damaged, truncated or foreign one refused
and removed), then the block manager and scheduler over them with MockRunner, whose "KV" is token ids,
so a block loaded back from a tier is checked token by token (a wrong or missing block changes the
context every later token is computed from).
"""
from __future__ import annotations

import os
import random

import numpy as np
import pytest

from hloserve.server.core.block_manager import BlockManager, hash_block
from hloserve.server.core.kv_tiers import (DISK, HOST, BlockLayout, DiskBlockCache, HostBlockCache, KVTiers,
                                           artifact_digest)
from hloserve.server.core.sampling import SamplingParams
from hloserve.server.core.scheduler import Scheduler, SchedulerConfig
from tests.support.mock_runner import MockRunner

BS = 4
LAYOUT = BlockLayout((BS,), "int64")      # MockRunner's block: BS token ids
VOCAB = 64


def block(v: int) -> np.ndarray:
    return np.full(BS, v, np.int64)


def test_host_cache_drops_least_recently_used_past_its_bytes():
    host = HostBlockCache(3 * block(0).nbytes)
    for i in range(3):
        host.put(bytes([i]), block(i))
    assert host.get(bytes([0]))[0] == 0          # 0 is now the most recently used
    host.put(bytes([3]), block(3))
    assert [bytes([i]) in host for i in range(4)] == [True, False, True, True]
    assert host.nbytes == 3 * block(0).nbytes


def disk_cache(tmp_path, capacity=1 << 20, digest="a" * 64) -> DiskBlockCache:
    return DiskBlockCache(str(tmp_path / "kv"), digest, LAYOUT, capacity)


def written(tmp_path, blocks: dict[bytes, np.ndarray], **kw) -> DiskBlockCache:
    disk = disk_cache(tmp_path, **kw)
    for h, a in blocks.items():
        disk.write(h, a)
    disk.close()                                  # the writer thread has written everything queued
    return disk_cache(tmp_path, **kw)


def test_disk_cache_round_trip_and_damaged_truncated_foreign_entries_are_refused(tmp_path):
    hs = [hash_block(b"", [i]) for i in range(5)]
    disk = written(tmp_path, {h: block(i) for i, h in enumerate(hs)})
    assert (disk.read(hs[0]) == block(0)).all()
    with open(disk.path(hs[1]), "r+b") as f:       # one payload byte flipped
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with open(disk.path(hs[2]), "r+b") as f:       # cut short
        f.truncate(os.path.getsize(disk.path(hs[2])) - 3)
    with open(disk.path(hs[3]), "wb") as f:        # not an entry at all
        f.write(b"\x80\x04not json\n" + b"\0" * 32)
    os.replace(disk.path(hs[0]), disk.path(hs[4]))   # another block's entry under this name
    assert [disk.read(h) for h in hs[1:]] == [None] * 4
    assert disk.rejected == 4
    assert not any(os.path.exists(disk.path(h)) for h in hs)    # refused entries are removed (rewritten later)
    foreign = written(tmp_path, {hs[0]: block(0)}, digest="b" * 64)
    os.replace(foreign.path(hs[0]), disk.path(hs[0]))           # another artifact's entry
    assert disk.read(hs[0]) is None and disk.rejected == 5


def test_disk_cache_removes_least_recently_used_entries_past_its_bound(tmp_path):
    entry = LAYOUT.nbytes + 512
    hs = [hash_block(b"", [i]) for i in range(10)]
    disk = disk_cache(tmp_path, capacity=5 * entry)
    for i, h in enumerate(hs):
        disk.write(h, block(i))
        if i == 0:
            disk.close()
            disk = disk_cache(tmp_path, capacity=5 * entry)
            os.utime(disk.path(h), (2e9, 2e9))      # read recently: kept
    disk.close()
    kept = {h for h in hs if os.path.exists(disk.path(h))}
    assert len(kept) <= 5 and hs[0] in kept and hs[-1] in kept


def test_artifact_digest_depends_on_the_whole_manifest():
    a = {"weights": {"w": {"sha256": "1"}}, "model": {"llm": {"block_size": 16}}}
    b = {"weights": {"w": {"sha256": "2"}}, "model": {"llm": {"block_size": 16}}}
    assert artifact_digest(a) == artifact_digest(dict(reversed(list(a.items())))) != artifact_digest(b)


def chain_of(toks: list[int], n: int) -> list[bytes]:
    out = [hash_block(b"", toks[:BS])]
    for i in range(1, n):
        out.append(hash_block(out[-1], toks[BS * i:BS * (i + 1)]))
    return out


def test_block_manager_saves_full_blocks_and_finds_them_below_the_device():
    tiers = KVTiers(HostBlockCache(1 << 20), None)
    bm = BlockManager(5, BS, tiers=tiers)              # 4 allocatable blocks
    toks = list(range(10, 22))                          # 3 full blocks
    assert bm.allocate("a", 12).block_ids == (1, 2, 3)
    bm.cache_full_blocks("a", toks, 12)
    saves, loads = bm.take_transfers()
    chain = chain_of(toks, 3)
    assert saves == ((1, chain[0]), (2, chain[1]), (3, chain[2])) and loads == ()
    for b, h in saves:                                  # what the runner does before the next step
        tiers.put(h, block(b))
    bm.free("a")                                        # free queue 4, 3, 2, 1 (tail first)
    assert bm.allocate("b", 8).block_ids == (4, 3)      # evicts block 3 (chain[2]) from the device
    hit = bm.find_cached_prefix(toks + [99, 98])        # two tokens past the blocks: all three may hit
    assert hit.block_ids == (1, 2) and [(h, tier) for h, _, tier in hit.lower] == [(chain[2], HOST)]
    assert hit.num_cached_tokens == 12 and hit.tokens_by_tier(BS) == {"device": 8, "host": 4}
    bm.free("b")                                        # free queue 2, 1, 3, 4
    table = bm.allocate("c", 14, hit)
    assert table.block_ids == (1, 2, 3, 4) and table.num_cached_tokens == 12
    saves, loads = bm.take_transfers()
    assert saves == () and [(b, int(a[0])) for b, a in loads] == [(3, 3)]
    assert bm.find_cached_prefix(toks + [99, 98]).block_ids == (1, 2, 3)   # hashed at once: a device hit
    bm.check_invariants()


def make(num_blocks, tiers, max_num_seqs=4, max_tokens=16):
    bm = BlockManager(num_blocks, BS, tiers=tiers)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, max_model_len=64,
                                      admission_watermark=0.0, enable_prefix_caching=True), bm,
                      seed_rng=random.Random(0))
    return sched, MockRunner(VOCAB, num_blocks, BS, tiers=tiers)


def run(sched, runner, requests, max_steps=400):
    """Add `requests` ({id: (prompt, max_tokens)}), step until idle and every save is made; tokens per request."""
    for rid, (prompt, n) in requests.items():
        sched.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0))
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(max_steps):
        if not sched.has_work():
            break
        plan = sched.schedule()
        for o in sched.update(plan, runner.execute(plan)):
            out[o.request_id] += o.new_token_ids
        sched.blocks.check_invariants()
    assert not sched.has_work()
    return out


def test_preempted_requests_come_back_from_host_with_the_same_tokens():
    requests = {f"r{i}": ([3 + i, 9, 20 + i, 7, 1, 2, 5, 6, 30 + i], 14) for i in range(4)}
    sched, runner = make(64, None)
    want = run(sched, runner, requests)
    assert sched.stats.num_preemptions == 0
    tiers = KVTiers(HostBlockCache(1 << 20), None)
    sched, runner = make(13, tiers)                     # 12 blocks for 4 requests needing 6 each
    got = run(sched, runner, requests)
    assert got == want
    assert sched.stats.num_preemptions > 0
    assert sched.stats.prefix_cache_hits_by_tier.get(HOST, 0) > 0 and tiers.loaded > 0
    for rid, (prompt, _) in requests.items():          # every context read was the request's own tokens
        assert runner.contexts[rid] == prompt + want[rid][:-1]
    for i, plan in enumerate(runner.plans):             # a readmission loads the full blocks back: at most
        for rid in plan.preempted:                      # the partial block is recomputed
            first = next(s for p in runner.plans[i + 1:] for s in p.seqs if s.request_id == rid)
            assert first.start > 0 and len(first.token_ids) <= BS


def test_a_restart_serves_a_known_prefix_from_disk_and_recomputes_a_damaged_block(tmp_path):
    prompt = list(range(1, 35))                          # 8 full blocks + 2 tokens
    def tiers():
        return KVTiers(HostBlockCache(1 << 20), disk_cache(tmp_path))
    first = tiers()
    sched, runner = make(32, first)
    want = run(sched, runner, {"a": (prompt, 4)})
    first.close()
    second = tiers()                                     # a new process: nothing on the device or in RAM
    sched, runner = make(32, second)
    assert run(sched, runner, {"b": (prompt, 4)}) == {"b": want["a"]}
    assert sched.stats.prefix_cache_hits_by_tier == {"device": 0, DISK: 32}
    assert runner.contexts["b"] == prompt + want["a"][:-1]
    second.close()
    chain = chain_of(prompt, 8)
    with open(second.disk.path(chain[5]), "r+b") as f:   # block 5's entry cut short
        f.truncate(40)
    third = tiers()
    sched, runner = make(32, third)
    assert run(sched, runner, {"c": (prompt, 4)}) == {"c": want["a"]}
    assert sched.stats.prefix_cache_hits_by_tier[DISK] == 20 and third.disk.rejected == 1
    assert runner.contexts["c"] == prompt + want["a"][:-1]
    third.close()
    assert os.path.getsize(third.disk.path(chain[5])) > 40       # recomputed and saved again


@pytest.mark.parametrize("host", [0, 1 << 20])
def test_tiers_off_or_host_only_still_serve(host, tmp_path):
    tiers = KVTiers(HostBlockCache(host), None) if host else None
    sched, runner = make(16, tiers)
    out = run(sched, runner, {"a": (list(range(5, 15)), 5)})
    assert out == {"a": list(range(15, 20))}


def test_pending_saves_are_held_land_in_order_and_a_lookup_lands_them_first(tmp_path):
    """put_later (the runner's gather, still on the device): held at once, in the tiers only at
    land(), in the order made; a lookup of a pending hash lands them first; close() lands them too."""
    h = [hash_block(b"", [i]) for i in range(3)]
    tiers = KVTiers(HostBlockCache(1 << 20), None)
    tiers.put_later(h[:2], np.stack([block(1), block(2), block(0)]))   # padded: the last row is no block
    tiers.put_later(h[1:], np.stack([block(5), block(3)]))             # h[1] saved again, later: this one wins
    assert all(tiers.holds(x) for x in h) and len(tiers.host) == 0 and tiers.saved == 0
    got, tier = tiers.get(h[2])
    assert tier == HOST and (got == block(3)).all()
    assert [int(tiers.host.get(x)[0]) for x in h] == [1, 5, 3] and tiers.saved == 4
    tiers.land()                                                        # nothing left: nothing saved twice
    assert tiers.saved == 4 and len(tiers.host) == 3

    disk = KVTiers(None, disk_cache(tmp_path))
    disk.put_later(h[:1], np.stack([block(7)]))
    assert disk.holds(h[0]) and not os.path.exists(disk.disk.path(h[0]))
    disk.close()                                                        # a pending save is not lost at shutdown
    assert (disk_cache(tmp_path).read(h[0]) == block(7)).all()


class WatchedTiers(KVTiers):
    """KVTiers counting the lookups of blocks whose save was still pending, and what they found."""

    def __init__(self, *a):
        super().__init__(*a)
        self.pending_gets: list[bool] = []      # found, for each get of a pending hash
        self.pending_holds = 0

    def holds(self, h):
        self.pending_holds += h in self._pending_hashes
        return super().holds(h)

    def get(self, h):
        pending = h in self._pending_hashes
        got = super().get(h)
        if pending:
            self.pending_gets.append(got is not None)
        return got


def test_async_scheduling_with_tiers_gives_the_serial_tokens():
    """With async scheduling a step is planned while the last one runs, so its lookups ask for blocks
    whose save is still pending (landed at collect): such a block is found (its save lands first)
    and not saved twice; preempted requests come back from host RAM with the tokens they have in the
    serial loop, every context their own tokens. (Six requests sharing a block, 10 blocks for them:
    the sizes where both lookups happen.)"""
    from hloserve.server.core.engine import Engine
    requests = {f"r{i}": ([40, 41, 42, 43, 3 + i, 9, 20 + i, 7, 1, 2, 5, 6, 30 + i, 8], 14) for i in range(6)}
    sched, runner = make(64, None)
    want = run(sched, runner, requests)
    tiers = WatchedTiers(HostBlockCache(1 << 20), None)
    sched, runner = make(11, tiers)
    eng = Engine(sched, runner, vocab_size=VOCAB, async_scheduling=True)
    streams = {rid: eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0), request_id=rid)
               for rid, (p, n) in requests.items()}
    for _ in range(400):
        if all(s.finished for s in streams.values()):
            break
        eng.run_once()
    got = {rid: [t for o in s.drain() for t in o.new_token_ids] for rid, s in streams.items()}
    assert got == want
    assert tiers.pending_gets and all(tiers.pending_gets) and tiers.pending_holds > 0
    assert sched.stats.num_preemptions > 0 and sched.stats.prefix_cache_hits_by_tier.get(HOST, 0) > 0
    for rid, (prompt, _) in requests.items():
        assert runner.contexts[rid] == prompt + want[rid][:-1]
