"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, block tables.

Plain Python, no torch: the model runner owns the tensors, this module only hands out block ids.
A token at position p of a request lives in slot block_table[p // block_size] * block_size
+ p % block_size of every layer's cache.
"""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Free list plus reference counts; a block returns to the free list when its count hits 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be > 0")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free KV blocks")
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._ref_counts[block] += 1

    def free(self, block: int) -> None:
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} freed twice")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]


class KVCacheManager:
    """Maps each request to its block table and grows it all-or-nothing."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

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

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover num_tokens; on failure nothing changes and False returns."""
        table = self.block_tables.setdefault(request_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > self.allocator.num_free:
            if not table:
                del self.block_tables[request_id]
            return False
        for _ in range(max(missing, 0)):
            table.append(self.allocator.allocate())
        return True

    def free(self, request_id: str) -> None:
        for block in reversed(self.block_tables.pop(request_id, [])):
            self.allocator.free(block)
