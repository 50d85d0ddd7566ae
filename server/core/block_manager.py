"""Paged KV-cache block pool with reference counts and prefix caching (pure Python).

The KV cache is `num_blocks` blocks of `block_size` token slots. A request owns
a *block table*: the ids of the blocks holding its tokens in order, token `p`
living in slot `block_table[p // block_size] * block_size + p % block_size`.

Prefix caching: once a block is FULL (all `block_size` of its tokens have
their K/V written), it gets a chained hash

    hash_i = sha256(hash_{i-1} || token ids of block i)        (hash_{-1} = b"")

so equal hashes mean equal *prefixes*, not only equal blocks. A later request
whose prompt starts with the same full blocks reuses them (reference count +1)
instead of recomputing them.

When a request finishes, its blocks' reference counts drop; a block at zero
goes to the free queue but KEEPS its hash, so a later prefix hit can revive
it. Allocation takes the least recently freed block from the front of the
queue and, if that block was cached, evicts its hash first. Freed blocks of a
request are queued tail-first, so the end of a prefix is evicted before its
start (the start is the part most likely shared).

Tiers (core/kv_tiers.py): with a `KVTiers`, a block that becomes full is also
recorded to be saved to host RAM and disk (`take_transfers`: (block, hash) pairs
the runner copies before the next step, while the block still holds them), and a
prefix lookup that runs out of device blocks goes on through host, then disk;
the blocks found there take fresh device blocks at `allocate`, hashed at once,
with their data recorded to be loaded before the step that reads them.

The scheduler sees only `KVBlocks` values (opaque allocation results) and a
few counts; the free queue and the hash table never leave this module.
"""
from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from typing import Any, Protocol, Sequence

NULL_BLOCK = 0  # reserved: padding rows of block tables point here; never allocated


class Tiers(Protocol):
    """What the block manager asks of the tiers below the device (core/kv_tiers.py's KVTiers)."""

    def holds(self, h: bytes) -> bool:
        """Whether the block hashed `h` is kept (a save would be redundant)."""

    def get(self, h: bytes) -> tuple[Any, str] | None:
        """(the block's K/V, its tier's name) or None."""


class BlockManagerError(RuntimeError):
    """A misuse of the block manager (a bug in the caller, not an out-of-blocks condition)."""


@dataclasses.dataclass(frozen=True)
class KVBlocks:
    """An allocation result: the interface between the scheduler and the block manager.

    It hides the block manager's internals from the scheduler: the scheduler
    keeps these values and reads block ids from them, nothing else.

    Attributes:
      block_ids: blocks in block-table order.
      num_cached_tokens: tokens already computed in these blocks (prefix-cache
        hits; always a multiple of block_size). 0 for freshly allocated blocks.
      lower: prefix-cache hits past the device's, from find_cached_prefix: (hash, the block's
        K/V, its tier) each, in order after block_ids; `allocate` gives them fresh blocks.
    """
    block_ids: tuple[int, ...] = ()
    num_cached_tokens: int = 0
    lower: tuple[tuple[bytes, Any, str], ...] = dataclasses.field(default=(), compare=False)

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        """Cached tokens per tier ("device", "host", "disk")."""
        out = {"device": len(self.block_ids) * block_size}
        for _, _, tier in self.lower:
            out[tier] = out.get(tier, 0) + block_size
        return out


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block: sha256(parent hash || int64 token ids)."""
    return hashlib.sha256(parent + array.array("q", token_ids).tobytes()).digest()


@dataclasses.dataclass
class _ReqState:
    """Per-request bookkeeping.

    Invariant: `blocks` is append-only while the request holds it (a block
    table never changes an entry it already has, so the runner's copy stays
    valid); `hashes[i]` is the chained hash of full block i for i < len(hashes).
    """
    blocks: list[int] = dataclasses.field(default_factory=list)
    hashes: list[bytes] = dataclasses.field(default_factory=list)


class BlockManager:
    """The block pool.

    Data and invariants (checked by `check_invariants`, property-tested):
      _ref[b]        reference count of block b; never negative; _ref[0] == 0.
      _free          OrderedDict of blocks with _ref == 0 (b != 0), least recently
                     freed first. A block is in _free iff its ref count is 0, so
                     len(_free) + (#blocks with ref > 0) == num_blocks - 1 == total.
      _hash_of[b]    the hash of the full block b, or None.
      _cached        hash -> block; _cached[h] == b implies _hash_of[b] == h. A block
                     is un-hashed BEFORE it is handed out again, so a prefix hit
                     never returns a freed-and-reused block.
      _reqs          request id -> its block table (append-only) and block hashes.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 tiers: Tiers | None = None):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the reserved null block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[bytes, int] = {}
        self._reqs: dict[str, _ReqState] = {}
        self.tiers = tiers if enable_prefix_caching else None
        self._saves: list[tuple[int, bytes]] = []    # full blocks to copy to the tiers before the next step
        self._loads: list[tuple[int, Any]] = []      # (fresh block, K/V from a tier) to copy in before it

    # -- counts ---------------------------------------------------------------
    @property
    def total_blocks(self) -> int:
        """Allocatable blocks (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (0.0 .. 1.0)."""
        return 1.0 - len(self._free) / self.total_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_of(self, request_id: str) -> KVBlocks:
        st = self._reqs.get(request_id)
        return KVBlocks(tuple(st.blocks)) if st else KVBlocks()

    # -- prefix lookup ----------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], salt: bytes = b"") -> KVBlocks:
        """The longest run of cached full blocks that prefix `token_ids`; `salt` starts the hash chain
        (a LoRA adapter's key: the same tokens under another adapter are other K/V).

        At most (len - 2) // block_size blocks: the last token is always left
        to compute, because the step needs its logits, and the one before it
        too, so that what is left is never one token alone (the attention
        kernel computes a lone token in another order than a token of a
        chunk: the scheduler's `chunk_tokens`). Nothing is reserved here;
        `allocate` takes the hit (the blocks may be evicted in between).
        """
        bs = self.block_size
        if not self.enable_prefix_caching:
            return KVBlocks()
        ids, lower, parent = [], [], salt
        for i in range(max(len(token_ids) - 2, 0) // bs):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            b = self._cached.get(parent) if not lower else None
            if b is not None:
                ids.append(b)
                continue
            got = self.tiers.get(parent) if self.tiers is not None else None
            if got is None:
                break
            lower.append((parent, *got))
        return KVBlocks(tuple(ids), (len(ids) + len(lower)) * bs, tuple(lower))

    # -- allocation -------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int, cached: KVBlocks = KVBlocks()) -> bool:
        """Whether `allocate(request_id, num_tokens, cached)` would succeed."""
        return self.new_blocks_needed(request_id, num_tokens, cached) <= self.num_free_blocks

    def new_blocks_needed(self, request_id: str, num_tokens: int, cached: KVBlocks = KVBlocks()) -> int:
        """Free blocks that `allocate(request_id, num_tokens, cached)` would take (revived hits included)."""
        st = self._reqs.get(request_id)
        have = len(st.blocks) if st else 0
        revive = sum(1 for b in cached.block_ids if self._ref[b] == 0) if not have else 0
        return max(0, self.num_blocks_needed(num_tokens) - have - len(cached.block_ids)) + revive

    def allocate(self, request_id: str, num_tokens: int, cached: KVBlocks = KVBlocks()) -> KVBlocks | None:
        """Grow the request's block table to hold `num_tokens` tokens in total.

        `cached` (from find_cached_prefix, first allocation only) starts the
        table with prefix-hit blocks. Returns the whole table, or None with
        nothing changed when there are not enough free blocks.
        """
        st = self._reqs.get(request_id)
        if cached.block_ids and st is not None and st.blocks:
            raise BlockManagerError(f"request {request_id!r} already has blocks; prefix hits apply to its first allocation only")
        if not self.can_allocate(request_id, num_tokens, cached):
            return None
        if st is None:
            st = self._reqs[request_id] = _ReqState()
        for b in cached.block_ids:  # revive or share the prefix-hit blocks
            if self._hash_of[b] is None:
                raise BlockManagerError(f"block {b} is not cached (stale KVBlocks from find_cached_prefix?)")
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            st.blocks.append(b)
            st.hashes.append(self._hash_of[b])
        for h, data, _ in cached.lower:              # hits of the lower tiers: fresh blocks, loaded before the step
            b = self._take_free()
            if h not in self._cached:
                self._cached[h] = b
                self._hash_of[b] = h
            st.blocks.append(b)
            st.hashes.append(h)
            self._loads.append((b, data))
        while len(st.blocks) < self.num_blocks_needed(num_tokens):
            st.blocks.append(self._take_free())
        return KVBlocks(tuple(st.blocks), cached.num_cached_tokens)

    def _take_free(self) -> int:
        """The least recently freed block, un-hashed (evicted from the prefix cache) and referenced once."""
        b, _ = self._free.popitem(last=False)
        h = self._hash_of[b]
        if h is not None:
            del self._cached[h]
            self._hash_of[b] = None
        self._ref[b] = 1
        return b

    def take_transfers(self) -> tuple[tuple[tuple[int, bytes], ...], tuple[tuple[int, Any], ...]]:
        """(saves, loads) recorded since the last call, for the next step's plan: the runner copies each
        saved (block, hash) to the tiers, then each loaded (block, K/V) into its block, before the step."""
        saves, loads = tuple(self._saves), tuple(self._loads)
        self._saves.clear()
        self._loads.clear()
        return saves, loads

    @property
    def has_transfers(self) -> bool:
        return bool(self._saves or self._loads)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          salt: bytes = b"") -> None:
        """Hash the request's blocks that became full (first `num_computed_tokens` of `token_ids` are in
        the cache), the chain started with `salt` (find_cached_prefix).

        If another block already holds the same hash (two requests computed
        the same prefix at once), the first one stays the cached copy and this
        block is not de-duplicated, so block tables stay append-only.
        """
        st = self._reqs.get(request_id)
        if st is None or not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = st.hashes[-1] if st.hashes else salt
        for i in range(len(st.hashes), min(num_computed_tokens // bs, len(st.blocks))):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            st.hashes.append(parent)
            b = st.blocks[i]
            if parent not in self._cached and self._hash_of[b] is None:
                self._cached[parent] = b
                self._hash_of[b] = parent
            if self.tiers is not None and not self.tiers.holds(parent):
                self._saves.append((b, parent))

    def free(self, request_id: str) -> int:
        """Release the request's blocks at once; returns how many reached ref count 0."""
        st = self._reqs.pop(request_id, None)
        if st is None:
            return 0
        released = 0
        for b in reversed(st.blocks):  # tail first: evicted before the shared head
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise BlockManagerError(f"block {b} ref count went negative freeing {request_id!r}")
            if self._ref[b] == 0:
                self._free[b] = None
                released += 1
        return released

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of free blocks (e.g. after the weights changed)."""
        for b in self._free:
            h = self._hash_of[b]
            if h is not None:
                del self._cached[h]
                self._hash_of[b] = None

    # -- invariants -------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise BlockManagerError if any documented invariant is broken (tests call this)."""
        used = {b for b in range(1, self.num_blocks) if self._ref[b] > 0}
        if any(r < 0 for r in self._ref) or self._ref[NULL_BLOCK] != 0:
            raise BlockManagerError("a ref count is negative or the null block is referenced")
        if NULL_BLOCK in self._free or any(self._ref[b] != 0 for b in self._free):
            raise BlockManagerError("the free queue holds a referenced block or the null block")
        if len(self._free) + len(used) != self.total_blocks:
            raise BlockManagerError(f"free {len(self._free)} + used {len(used)} != total {self.total_blocks}")
        for h, b in self._cached.items():
            if self._hash_of[b] != h:
                raise BlockManagerError(f"cached hash maps to block {b}, which holds another hash")
        counts = collections.Counter(b for st in self._reqs.values() for b in st.blocks)
        for b in range(1, self.num_blocks):
            if counts.get(b, 0) != self._ref[b]:
                raise BlockManagerError(f"block {b}: ref count {self._ref[b]} but {counts.get(b, 0)} tables hold it")
