"""Paged KV cache bookkeeping (pure, no torch): block pool, manager, block hashes, layer specs."""

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager", "FullAttentionSpec", "KVCacheSpec",
           "MLAAttentionSpec"]
