"""`RedisKVStore` against a private redis-server: batches, namespace, TTL, password URLs, and
a store that is down raising `KVStoreError` (never hanging)."""

import asyncio
import subprocess

import pytest

from deepinfer.kvstore import KVStoreError, open_store
from deepinfer.kvstore.redis_store import NAMESPACE, RedisKVStore


def run(coroutine):
    return asyncio.run(coroutine)


def test_batch_operations_and_namespace(redis_server):
    async def scenario():
        store = open_store(redis_server.url)
        try:
            await store.put_many({"fp:01": b"\x00\x01binary", "fp:02": b"two"})
            values = await store.get_many(["fp:01", "fp:03", "fp:02"])
            exists = await store.exists_many(["fp:02", "fp:03"])
            await store.delete_many(["fp:01"])
            after = await store.get_many(["fp:01", "fp:02"])
            raw = await store._client.keys("*")
            return values, exists, after, raw
        finally:
            await store.close()

    values, exists, after, raw = run(scenario())
    assert values == [b"\x00\x01binary", None, b"two"]
    assert exists == [True, False]
    assert after == [None, b"two"]
    assert raw == [(NAMESPACE + "fp:02").encode()]


def test_ttl_is_set_on_every_key(redis_server):
    async def scenario():
        store = RedisKVStore(redis_server.url, ttl_s=100)
        try:
            await store.put_many({"k1": b"v", "k2": b"w"})
            return [await store._client.ttl(NAMESPACE + k) for k in ("k1", "k2")]
        finally:
            await store.close()

    ttls = run(scenario())
    assert all(0 < t <= 100 for t in ttls)


def test_password_url(redis_server):
    subprocess.run(["redis-cli", "-p", str(redis_server.port), "CONFIG", "SET", "requirepass",
                    "s3cret"], check=True, capture_output=True)
    url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/1"

    async def scenario(store_url):
        store = open_store(store_url)
        try:
            await store.put_many({"k": b"v"})
            return await store.get_many(["k"])
        finally:
            await store.close()

    assert run(scenario(url)) == [b"v"]
    with pytest.raises(KVStoreError) as info:
        run(scenario(url.replace("s3cret", "wrong")))
    assert "wrong" not in str(info.value)  # the password never lands in messages


def test_store_down_raises_kvstore_error(redis_server):
    redis_server.stop()

    async def scenario():
        store = open_store(redis_server.url, timeout_s=0.5)
        try:
            with pytest.raises(KVStoreError):
                await store.get_many(["a"])
            with pytest.raises(KVStoreError):
                await store.put_many({"a": b"1"})
        finally:
            await store.close()

    run(scenario())
