"""`RedisKVStore`: the KV block store on Redis, through redis-py's asyncio client.

Every key is prefixed with `namespace` ("deepinfer:kv:" by default; the engine's keys are
`{model_fingerprint}:{block_hash_hex}`, so full keys read `deepinfer:kv:{fp}:{hash}`). Batches
go out as one command (MGET, DEL) or one non-transactional pipeline (SET ... EX, EXISTS), over
a bounded connection pool with connect and socket timeouts. `redis://[:password@]host:port/db`
and `rediss://` (TLS) URLs are parsed by redis-py. Any failure — refused connection, timeout,
an error reply — is raised as `KVStoreError`; the pool reconnects on the next call.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from deepinfer.kvstore.base import KVStoreError

NAMESPACE = "deepinfer:kv:"


class RedisKVStore:
    """Args:
        url: `redis://[:password@]host:port/db` or `rediss://...`.
        ttl_s: expiry of every stored key in seconds (None = no expiry).
        timeout_s: connect and per-command socket timeout in seconds.
        max_connections: size of the connection pool.
        namespace: prefix of every key.
    """

    def __init__(self, url: str, *, ttl_s: int | None = None, timeout_s: float = 2.0,
                 max_connections: int = 16, namespace: str = NAMESPACE):
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s={ttl_s} must be >= 1 second, or None for no expiry.")
        self.url = url
        self.ttl_s = ttl_s
        self.namespace = namespace
        self._client = redis_asyncio.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            max_connections=max_connections, decode_responses=False)

    def _keys(self, keys: list[str]) -> list[str]:
        return [self.namespace + key for key in keys]

    async def _run(self, coroutine):
        try:
            return await coroutine
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise KVStoreError(f"redis at {self._safe_url()}: {exc!r}") from exc

    def _safe_url(self) -> str:
        """The URL without its password, for messages."""
        scheme, _, rest = self.url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2]}"

    async def put_many(self, items: dict[str, bytes]) -> None:
        if not items:
            return

        async def put() -> None:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, value in items.items():
                    pipe.set(self.namespace + key, value, ex=self.ttl_s)
                await pipe.execute()

        await self._run(put())

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        return list(await self._run(self._client.mget(self._keys(keys))))

    async def exists_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []

        async def exists() -> list[int]:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in self._keys(keys):
                    pipe.exists(key)
                return await pipe.execute()

        return [bool(n) for n in await self._run(exists())]

    async def delete_many(self, keys: list[str]) -> None:
        if keys:
            await self._run(self._client.delete(*self._keys(keys)))

    async def close(self) -> None:
        await self._client.aclose()
