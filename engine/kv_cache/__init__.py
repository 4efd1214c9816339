"""Paged KV cache bookkeeping (pure, no torch): block pool, manager, block hashes, layer specs."""

from deepinfer.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager", "FullAttentionSpec", "KVCacheSpec",
           "MLAAttentionSpec"]
