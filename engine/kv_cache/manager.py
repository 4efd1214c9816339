"""`KVCacheManager`: block tables per request on top of the `BlockPool`.

allocate_slots() grows a request's block table to hold its next tokens, get_computed_blocks()
finds the longest cached prefix, free() gives everything back (tail first, so the prefix stays
cached longest). Full blocks are indexed by their hash chain as soon as their tokens are scheduled,
so a request arriving one step later already hits them.

Built from numbers alone; pure module, no torch import.
"""

from __future__ import annotations

from deepinfer.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from deepinfer.engine.kv_cache.hashing import extend_block_hashes
from deepinfer.engine.multimodal import block_mm_extra
from deepinfer.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Args:
        num_blocks: physical KV blocks.
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        hash_extra: bytes mixed into every block hash (model fingerprint, dtype, block size).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_extra: bytes = b""):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # blocks of the request already indexed
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0     # prompt tokens found

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        images = request.mm_inputs
        extend_block_hashes(request.block_hashes, request.token_ids_slice, num_tokens,
                            self.block_size, self.hash_extra, request.cache_salt,
                            (lambda start, end: block_mm_extra(images, start, end))
                            if images else None)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix of the request's full blocks found in the cache.

        The last token is always recomputed (its logits are needed), so at most
        `(num_tokens - 1) // block_size` blocks hit. Returns (blocks, num_computed_tokens); the
        blocks are not yet referenced (allocate_slots takes them).
        """
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def lookup_prefix(self, request: Request) -> tuple[list[int], int]:
        """The hashes of the request's blocks that may hit (all full blocks but the one holding
        its last token) and how many of them, from the first, the local cache holds. Counts no
        statistics (the KV store lookup asks this before the request is scheduled)."""
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        num_local = 0
        while num_local < len(hashes) and self.block_pool.get_cached_block(hashes[num_local]):
            num_local += 1
        return hashes, num_local

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_external_tokens: int = 0) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Args:
            request: its `num_computed_tokens` counts tokens already in the KV cache, *not*
                including `new_computed_blocks`.
            num_new_tokens: tokens to be computed this step.
            new_computed_blocks: prefix-cache hits from get_computed_blocks (first schedule only).
            num_external_tokens: tokens after the hits whose KV is loaded from the KV store into
                the first newly allocated blocks (a multiple of block_size; first schedule only).
        Returns:
            the ids of newly allocated blocks (appended to the block table), or None when not
            enough blocks are free (nothing changes then).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                        + num_external_tokens)
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_to_allocate = num_needed - len(blocks) - len(new_computed_blocks)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_to_allocate > self.block_pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.allocate(max(num_to_allocate, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        num_known = min(num_tokens, request.num_tokens)  # draft tokens are never cached
        self._update_hashes(request, num_known)
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = num_known // self.block_size
        for index in range(start, end):
            self.block_pool.cache_block(blocks[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free_blocks_past(self, request: Request, num_tokens: int) -> int | None:
        """Free the request's blocks wholly past its first `num_tokens` tokens (lookahead
        blocks of rejected draft tokens), tail first; a block holding any of those tokens is
        kept. Such blocks never hold a block hash (drafts are never cached).

        Returns:
            the block count kept, or None when no block was freed.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        num_kept = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= num_kept:
            return None
        tail = blocks[num_kept:]
        assert all(b.block_hash is None for b in tail), \
            f"request {request.request_id}: a cached block past token {num_tokens}"
        del blocks[num_kept:]
        self._num_cached_blocks[request.request_id] = min(
            self._num_cached_blocks.get(request.request_id, 0), num_kept)
        self.block_pool.free(list(reversed(tail)))
        return num_kept

    def uncache_blocks(self, request: Request, num_valid_tokens: int) -> None:
        """Take the request's blocks past its first `num_valid_tokens` tokens out of the
        prefix cache: a step that was to compute them failed (EngineCore's fault isolation),
        so their KV is not what their hashes say."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        first = num_valid_tokens // self.block_size
        for block in blocks[first:]:
            self.block_pool.uncache_block(block)
        if request.request_id in self._num_cached_blocks:
            self._num_cached_blocks[request.request_id] = min(
                self._num_cached_blocks[request.request_id], first)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (idempotent)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
