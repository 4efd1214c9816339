"""The `KVStore` protocol and `KVStoreError` (`kvstore.backends.open_store(url)` builds one).

A store maps string keys to opaque byte values. The engine side (engine/kv_transfer.py) builds
keys as `{model_fingerprint}:{block_hash_hex}` and values with `kvstore.codec`; a backend only
moves bytes. Every operation takes a batch, so a network backend pays one round trip per call.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class KVStoreError(Exception):
    """The store could not be reached or answered badly; callers treat it as a miss."""


@runtime_checkable
class KVStore(Protocol):
    async def put_many(self, items: dict[str, bytes]) -> None:
        """Store every (key, value); an existing key is overwritten.

        Raises:
            KVStoreError: the backend failed (some items may have been stored).
        """
        ...

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Values in `keys` order, None where a key is absent.

        Raises:
            KVStoreError: the backend failed.
        """
        ...

    async def exists_many(self, keys: list[str]) -> list[bool]:
        """Whether each key is present, in `keys` order.

        Raises:
            KVStoreError: the backend failed.
        """
        ...

    async def delete_many(self, keys: list[str]) -> None:
        """Remove keys (absent ones are ignored).

        Raises:
            KVStoreError: the backend failed.
        """
        ...

    async def close(self) -> None:
        """Release connections; the store is unusable afterwards."""
        ...
