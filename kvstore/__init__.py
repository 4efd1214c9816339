"""Content-addressed KV block store: the `KVStore` protocol, the block codec, and two backends.

- `kvstore.base` — `KVStore` (async batch put / get / exists / delete) and `KVStoreError`.
- `kvstore.backends` — `open_store(url)`: the backend a URL names.
- `kvstore.codec` — versioned header (layout, dtype, shape, CRC-32 of the payload) + raw bytes.
- `kvstore.memory` — `MemoryKVStore`, an in-process LRU with a byte cap (the embedded default).
- `kvstore.redis_store` — `RedisKVStore` on redis-py's asyncio client (imported lazily).

Imports nothing of ours and no torch/numpy: values are bytes, keys are strings.
"""

from deepinfer.kvstore.backends import open_store
from deepinfer.kvstore.base import KVStore, KVStoreError
from deepinfer.kvstore.codec import CodecError, decode_block, encode_block
from deepinfer.kvstore.memory import MemoryKVStore

__all__ = ["KVStore", "KVStoreError", "open_store", "CodecError", "decode_block",
           "encode_block", "MemoryKVStore"]
