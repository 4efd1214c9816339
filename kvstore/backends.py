"""`open_store(url)`: the `KVStore` backend a URL names, imported on first use (redis-py only
where a Redis URL is given)."""

from __future__ import annotations

from deepinfer.kvstore.base import KVStore


def open_store(url: str, *, memory_capacity_bytes: int = 1 << 30, ttl_s: int | None = None,
               timeout_s: float = 2.0) -> KVStore:
    """Build a store from its URL.

    Args:
        url: "memory" (in-process LRU), or `redis://[:password@]host:port/db` /
            `rediss://...` (TLS).
        memory_capacity_bytes: byte cap of the memory store (values only).
        ttl_s: expiry of Redis keys in seconds (None = never).
        timeout_s: Redis connect and socket timeout in seconds.
    Raises:
        ValueError: an unknown URL scheme.
    """
    if url == "memory":
        from deepinfer.kvstore.memory import MemoryKVStore

        return MemoryKVStore(memory_capacity_bytes)
    if url.startswith(("redis://", "rediss://")):
        from deepinfer.kvstore.redis_store import RedisKVStore

        return RedisKVStore(url, ttl_s=ttl_s, timeout_s=timeout_s)
    raise ValueError(f"kv store {url!r} is not supported; use 'memory', 'redis://host:port/db' "
                     "or 'rediss://...'.")
