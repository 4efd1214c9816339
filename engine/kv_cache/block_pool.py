"""`BlockPool`: the physical KV blocks, their reference counts and the prefix-cache index.

A block is in exactly one of three places:
- in use: `ref_cnt > 0` (held by one or more requests' block tables);
- free and uncached: no hash, reusable at once;
- free and cached: `ref_cnt == 0` but its hash is still indexed, so a later request with the same
  prefix can take it back; these are evicted least-recently-freed first when the pool runs dry.

Built from numbers alone (block count); pure module, no torch import.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Free list, `ref_cnt`, block hash -> block, and the LRU of cached free blocks.

    Args:
        num_blocks: physical blocks in the KV cache.
        enable_caching: keep hashes of freed full blocks for prefix reuse.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free_uncached: deque[KVCacheBlock] = deque(self.blocks)
        self._free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()  # id -> block, LRU first
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_cached.pop(block.block_id, None)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (uncached first, then evict cached LRU).

        Raises:
            ValueError: fewer than `num_blocks` blocks are free (callers check first).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"need {num_blocks} KV blocks, only {self.num_free_blocks} free.")
        allocated = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block = self._free_uncached.popleft()
            else:
                _, block = self._free_cached.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block. Pass blocks in eviction order: earlier blocks of
        the list are evicted first, so free a request's blocks tail-first to keep its prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._free_cached[block.block_id] = block
                else:
                    self._free_uncached.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Index a full, in-use block under its hash (no-op if that hash is already indexed)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return  # another request computed the same block; keep the first copy indexed
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget an in-use block's hash (its KV is not what the hash says: a failed step)."""
        self._evict(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached free block's hash (used blocks keep theirs)."""
        for block in list(self._free_cached.values()):
            self._evict(block)
            self._free_uncached.append(block)
        self._free_cached.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            self.cached_block_hash_to_block.pop(block.block_hash, None)
            block.block_hash = None
