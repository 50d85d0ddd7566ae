"""Block manager: exact block ids (allocation order, prefix hits, eviction order) and property tests."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from hloserve.server.core.block_manager import BlockManager, BlockManagerError, KVBlocks, hash_block


def test_allocation_order_and_null_block():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.total_blocks == 5 and bm.num_free_blocks == 5
    assert bm.allocate("a", 5).block_ids == (1, 2)          # 5 tokens -> 2 blocks; block 0 is never handed out
    assert bm.allocate("b", 4).block_ids == (3,)
    assert bm.allocate("a", 9).block_ids == (1, 2, 4)       # append-only growth
    assert bm.allocate("a", 9).block_ids == (1, 2, 4)       # no-op when it already fits
    assert bm.num_free_blocks == 1 and bm.usage == pytest.approx(0.8)
    assert bm.allocate("b", 12) is None                    # needs 2 more, 1 free: nothing changes
    assert bm.blocks_of("b").block_ids == (3,) and bm.num_free_blocks == 1
    bm.check_invariants()


def test_free_returns_blocks_tail_first_and_lru_reuse():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    bm.allocate("a", 6)                                     # blocks 1, 2, 3
    bm.allocate("b", 2)                                     # block 4
    assert bm.free("a") == 3
    # free queue: 5 (never used), then a's blocks tail first: 3, 2, 1
    assert bm.allocate("c", 8).block_ids == (5, 3, 2, 1)
    bm.check_invariants()


def test_prefix_hit_exact_ids_and_last_token_not_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10, 20))                             # 10 tokens: 2 full blocks + 2
    bm.allocate("a", len(prompt))                            # blocks 1, 2, 3
    bm.cache_full_blocks("a", prompt, num_computed_tokens=10)
    hit = bm.find_cached_prefix(prompt + [99])
    assert hit == KVBlocks((1, 2), 8)
    assert bm.allocate("b", 11, hit).block_ids == (1, 2, 4)  # shares 1, 2 (ref 2), new block 4
    # an 8-token prompt equal to two full blocks: the last block is recomputed (its logits are needed)
    assert bm.find_cached_prefix(prompt[:8]) == KVBlocks((1,), 4)
    # a different first block breaks the chain even if the second block's tokens match
    assert bm.find_cached_prefix([0] + prompt[1:]).block_ids == ()
    bm.check_invariants()


def test_a_salt_keeps_prefixes_apart():
    """Blocks cached under one salt (a LoRA adapter's load key) are not hits under another or none."""
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10, 20))
    bm.allocate("a", len(prompt))
    bm.cache_full_blocks("a", prompt, num_computed_tokens=10, salt=b"sql#1")
    assert bm.find_cached_prefix(prompt + [99], b"sql#1") == KVBlocks((1, 2), 8)
    assert bm.find_cached_prefix(prompt + [99]).block_ids == ()
    assert bm.find_cached_prefix(prompt + [99], b"sql#2").block_ids == ()
    bm.check_invariants()


def test_freed_cached_blocks_are_revived_then_evicted_in_lru_order():
    bm = BlockManager(num_blocks=5, block_size=2)
    p = [1, 2, 3, 4, 5]
    bm.allocate("a", 5)                                      # blocks 1, 2, 3
    bm.cache_full_blocks("a", p, 5)                          # blocks 1, 2 hashed (3 is partial)
    bm.free("a")                                             # free queue: 4, 3, 2, 1
    assert bm.num_free_blocks == 4
    hit = bm.find_cached_prefix(p + [6])                     # at most (6 - 2) // 2 blocks: two left to compute
    assert hit == KVBlocks((1, 2), 4)
    assert bm.find_cached_prefix(p) == KVBlocks((1,), 2)     # 5 tokens: (5 - 2) // 2, never one token left
    assert bm.allocate("b", 5, hit).block_ids == (1, 2, 4)   # revived 1, 2 out of the free queue; new 4
    assert bm.num_free_blocks == 1
    bm.free("b")                                             # queue: 3, 4, 2, 1
    # c needs 3 fresh blocks: takes 3, 4 (uncached) then 2, evicting 2's hash; 1 stays cached
    bm.allocate("c", 6)
    assert bm.blocks_of("c").block_ids == (3, 4, 2)
    assert bm.find_cached_prefix(p + [6]) == KVBlocks((1,), 2)   # the chain now stops after block 1
    bm.check_invariants()


def test_duplicate_full_blocks_are_not_deduplicated():
    bm = BlockManager(num_blocks=6, block_size=2)
    p = [7, 8, 9]
    bm.allocate("a", 3)
    bm.allocate("b", 3)                                      # computed at the same time: no hit for b
    bm.cache_full_blocks("a", p, 3)
    bm.cache_full_blocks("b", p, 3)
    assert bm.find_cached_prefix(p + [1]) == KVBlocks((1,), 2)   # the first writer's copy
    assert bm.blocks_of("b").block_ids == (3, 4)             # b keeps its own block (append-only)
    bm.check_invariants()


def test_misuse_errors():
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockManager(1, 4)
    bm = BlockManager(4, 2)
    bm.allocate("a", 2)
    with pytest.raises(BlockManagerError, match="prefix hits apply to its first allocation"):
        bm.allocate("a", 4, KVBlocks((1,), 2))
    assert bm.free("nope") == 0


def test_hash_chain_depends_on_parent():
    assert hash_block(b"", [1, 2]) != hash_block(hash_block(b"", [0, 0]), [1, 2])


# -- property tests --------------------------------------------------------------
ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free", "cache"]), st.integers(0, 5),
                         st.integers(1, 40), st.integers(0, 3)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_invariants_hold_under_random_operations(seq):
    bs = 4
    bm = BlockManager(num_blocks=12, block_size=bs)
    # a few shared prompt families so prefix hits happen
    families = [[f * 100 + i for i in range(40)] for f in range(4)]
    live: dict[str, tuple[list[int], int]] = {}   # request -> (tokens, tokens allocated)
    for op, r, n, fam in seq:
        rid = f"r{r}"
        if op == "alloc" and rid not in live:
            toks = families[fam][:n]
            hit = bm.find_cached_prefix(toks)
            # a hit never points at a block that is handed to someone else with other content:
            for i, b in enumerate(hit.block_ids):
                assert bm._hash_of[b] == _chain(toks, i + 1, bs)
            got = bm.allocate(rid, n, hit)
            if got is not None:
                assert got.block_ids[:len(hit.block_ids)] == hit.block_ids
                live[rid] = (toks, n)
        elif op == "grow" and rid in live:
            toks, have = live[rid]
            before = bm.blocks_of(rid).block_ids
            if bm.allocate(rid, min(have + n, 40)) is not None:
                live[rid] = (toks, min(have + n, 40))
                after = bm.blocks_of(rid).block_ids
                assert after[:len(before)] == before                # block tables are append-only
        elif op == "cache" and rid in live:
            toks, have = live[rid]
            full = families[int(toks[0]) // 100][:have] if toks else []
            live[rid] = (full, have)
            bm.cache_full_blocks(rid, full, have)
        elif op == "free" and rid in live:
            bm.free(rid)
            del live[rid]
        bm.check_invariants()   # ref counts >= 0, free + used == total, hash table consistent, refs == tables


def _chain(toks, nblocks, bs):
    h = b""
    for i in range(nblocks):
        h = hash_block(h, toks[i * bs:(i + 1) * bs])
    return h
