"""`MemoryKVStore`: an in-process LRU of byte values under a byte cap (the embedded default).

Least recently used entries (by put or get) are evicted once the values' total size would pass
`capacity_bytes`; a single value larger than the cap is not stored. Thread-safe: the lock makes
each batch atomic, so tests and several event loops may share one instance.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class MemoryKVStore:
    """Args:
        capacity_bytes: the most value bytes held at once (keys are not counted).
    """

    def __init__(self, capacity_bytes: int = 1 << 30):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 1.")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    async def put_many(self, items: dict[str, bytes]) -> None:
        with self._lock:
            for key, value in items.items():
                self._pop(key)
                if len(value) > self.capacity_bytes:
                    continue
                while self.num_bytes + len(value) > self.capacity_bytes:
                    self._pop(next(iter(self._items)))
                self._items[key] = value
                self.num_bytes += len(value)

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            values = []
            for key in keys:
                value = self._items.get(key)
                if value is not None:
                    self._items.move_to_end(key)
                values.append(value)
            return values

    async def exists_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._items for key in keys]

    async def delete_many(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._pop(key)

    async def close(self) -> None:
        with self._lock:
            self._items.clear()
            self.num_bytes = 0

    def _pop(self, key: str) -> None:
        value = self._items.pop(key, None)
        if value is not None:
            self.num_bytes -= len(value)
