"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, block tables, and automatic
prefix caching (vLLM's APC): a full, computed block gets a hash chained over every token up to
its end, so a later request whose leading tokens are the same shares the block instead of
computing it again.

Plain Python, no torch: the model runner owns the tensors, this module only hands out block ids.
A token at position p of a request lives in slot block_table[p // block_size] * block_size
+ p % block_size of every layer's cache.

A request's cache_salt (vLLM's) is mixed into its first block's parent, so requests with
different salts never share a block, and usage.cached_tokens tells no caller what a caller
of another salt sent.

Invariant: a block is written only while it is private (reference count 1) and has no hash.
A block gets its hash only once every token in it is computed (commit), is shared only
through its hash, and a request writes only positions at or past its num_computed_tokens, so
a cached block is never written again; its KV stays valid until it is evicted.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, count: int, parent: bytes,
                 done: Sequence[bytes] = ()) -> list[bytes]:
    """SHA-256 hashes of the first `count` full blocks of token_ids: block i's hash covers block
    i - 1's hash and its own tokens (block 0's parent is `parent`, from the engine's salt), so
    equal hashes mean equal whole prefixes. `done`: hashes already computed, extended."""
    out = list(done[:count])
    for i in range(len(out), count):
        tokens = token_ids[i * block_size:(i + 1) * block_size]
        out.append(hashlib.sha256((out[-1] if out else parent) + struct.pack(f"<{block_size}I", *tokens)).digest())
    return out


@dataclass
class PrefixCacheStats:
    """Since start, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits): the tokens of
    every admitted request (a preempted one again when it comes back), and those the cache had."""

    queries: int = 0
    hits: int = 0


class BlockAllocator:
    """Reference counts and two kinds of free block: fresh ones (never used, or freed holding
    nothing reusable) and cached ones (freed but still holding a block hash, kept in LRU order
    of release). allocate() takes a fresh block first, and only then evicts the least
    recently released cached block: a fresh block holds nothing a later request could hit."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be > 0")
        self.num_blocks = num_blocks
        self._fresh: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # free and cached, oldest first
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._fresh) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def allocate(self) -> int:
        if self._fresh:
            block = self._fresh.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        else:
            raise MemoryError("no free KV blocks")
        self._ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Share a block; a free cached block (a prefix hit) leaves the eviction order."""
        if self._ref_counts[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is not allocated")
            del self._evictable[block]
        self._ref_counts[block] += 1

    def free(self, block: int) -> None:
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} freed twice")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._fresh.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Give a full, computed block its hash; False (it stays uncached) when another block
        already holds that prefix: two requests computed it in the same step, one copy serves hits."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._hash_of[block], self._block_of[block_hash] = block_hash, block
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def cached(self, block: int) -> bool:
        return block in self._hash_of

    def forget_hashes(self) -> None:
        """Drop every block hash (the KV behind them can no longer be trusted): cached free blocks turn fresh."""
        self._fresh.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()


class KVCacheManager:
    """Maps each request to its block table, grows it all-or-nothing, and (with
    enable_prefix_caching) finds the cached full blocks its head can share and caches its own."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 salt: bytes = b"") -> None:
        """salt: mixed into every block hash (nothing needs it while a worker serves one model;
        it would keep two models' blocks apart if they ever shared a cache). Tenants are kept
        apart per request, by the cache_salt find_cached and commit take."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.stats = PrefixCacheStats()
        self._root = hashlib.sha256(b"tessera-kv" + salt).digest()
        self._hashes: dict[str, list[bytes]] = {}    # request -> hashes of its full blocks so far
        self._committed: dict[str, int] = {}         # request -> leading table blocks already cached

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The cached blocks holding the longest run of the request's leading full blocks, at
        most (len(token_ids) - 1) // block_size of them: the last token is always computed
        (its logits are sampled), so the request's first write lands past every shared block.
        Only blocks cached under the same cache_salt match."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        count = (len(token_ids) - 1) // self.block_size
        for block_hash in self._block_hashes(request_id, token_ids, count, cache_salt):
            block = self.allocator.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup in the hit-rate statistics."""
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Make the request's table cover num_tokens, starting a new table with the shared
        `cached` blocks (find_cached); on failure nothing changes and False returns."""
        table = self.block_tables.setdefault(request_id, [])
        if cached and table:
            raise ValueError("cached blocks can only start a new block table")
        missing = max(self.blocks_for(num_tokens) - len(table) - len(cached), 0)
        revived = sum(1 for b in cached if self.allocator.ref_count(b) == 0)   # they leave the free pool
        if missing + revived > self.allocator.num_free:
            if not table:
                del self.block_tables[request_id]
            return False
        for block in cached:     # before allocating, which could otherwise evict them
            self.allocator.incref(block)
        if cached:
            table.extend(cached)
            self._committed[request_id] = len(cached)
        for _ in range(missing):
            table.append(self.allocator.allocate())
        return True

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int,
               cache_salt: str | None = None) -> None:
        """The request's first num_computed tokens have their KV written: cache its full blocks
        among them (under its cache_salt, as find_cached), so later requests can share them."""
        table = self.block_tables.get(request_id)
        if not self.enable_prefix_caching or table is None:
            return
        full = min(num_computed // self.block_size, len(table))
        done = self._committed.get(request_id, 0)
        if full <= done:
            return
        hashes = self._block_hashes(request_id, token_ids, full, cache_salt)
        for i in range(done, full):
            self.allocator.cache(table[i], hashes[i])
        self._committed[request_id] = full

    def writable(self, request_id: str, start: int, end: int) -> bool:
        """Whether every block holding positions [start, end) of the request is private and
        uncached: the only blocks a step may write."""
        table = self.block_tables[request_id]
        blocks = table[start // self.block_size:self.blocks_for(end)]
        return all(self.allocator.ref_count(b) == 1 and not self.allocator.cached(b) for b in blocks)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the KV behind the hashes may be gone: a pipeline stage restarted)."""
        self.allocator.forget_hashes()

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last first: its tail (least likely shared) is evicted
        before its head."""
        for block in reversed(self.block_tables.pop(request_id, [])):
            self.allocator.free(block)
        self._hashes.pop(request_id, None)
        self._committed.pop(request_id, None)

    def _block_hashes(self, request_id: str, token_ids: Sequence[int], count: int,
                      cache_salt: str | None) -> list[bytes]:
        hashes = self._hashes.get(request_id, [])
        if len(hashes) < count:
            parent = self._salted_root(cache_salt) if not hashes else b""    # only block 0 uses it
            hashes = self._hashes[request_id] = block_hashes(token_ids, self.block_size, count, parent, hashes)
        return hashes[:count]

    def _salted_root(self, cache_salt: str | None) -> bytes:
        if not cache_salt:
            return self._root
        # a block hash's input starts with a 32-byte hash, never with this tag: no salt can
        # make its root equal some unsalted block's hash and join that chain
        return hashlib.sha256(b"tessera-cache-salt" + self._root + cache_salt.encode()).digest()
