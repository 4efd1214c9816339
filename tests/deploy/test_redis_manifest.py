"""The disaggregated overlay's Redis, started with the manifest's own flags, works as the
workers' KV block store: the workers' rendered `DEEPINFER_KV_STORE` URL (password included)
stores and loads blocks, a client without the password is refused, and eviction is LRU under
the configured cap (a cache: a lost block is recomputed, never an error).
"""

from __future__ import annotations

import asyncio
import shutil
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from deepinfer.kvstore import open_store
from manifests import container_env, containers, render_overlay
from tests.conftest import RedisServer


def rendered_redis_and_store_url() -> tuple[list[str], str]:
    objects = render_overlay("disaggregated")
    found = {c["name"]: (w, c) for w, c in containers(objects)}
    workload, container = found["redis"]
    env = container_env(objects, container, "deepinfer")
    args = [arg.replace("$(REDIS_PASSWORD)", env["REDIS_PASSWORD"]) for arg in container["args"]]
    workload, worker = next((w, c) for w, c in containers(objects) if c["name"] == "worker")
    return args, container_env(objects, worker, "deepinfer")["DEEPINFER_KV_STORE"]


def test_the_workers_store_url_reaches_the_manifests_redis():
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    args, url = rendered_redis_and_store_url()
    server = RedisServer(extra_args=tuple(args)).start()
    try:
        parts = urlsplit(url)
        local = urlunsplit(parts._replace(netloc=f":{parts.password}@127.0.0.1:{server.port}"))

        async def round_trip() -> list[bytes | None]:
            store = open_store(local)
            try:
                await store.put_many({"manifest-check": b"\x01\x02"})
                return await store.get_many(["manifest-check", "absent"])
            finally:
                await store.close()

        assert asyncio.run(round_trip()) == [b"\x01\x02", None]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        client = redis.Redis.from_url(local)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert int(client.config_get("maxmemory")["maxmemory"]) == 12 * 1024**3
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("save") == {"save": ""}      # no snapshots to disk
    finally:
        server.stop()
