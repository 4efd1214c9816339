"""`MemoryKVStore`: batch semantics of the `KVStore` protocol and the LRU byte cap."""

import asyncio

import pytest

from deepinfer.kvstore import KVStore, MemoryKVStore, open_store


def run(coroutine):
    return asyncio.run(coroutine)


def test_protocol_batch_operations():
    store = MemoryKVStore(1000)
    assert isinstance(store, KVStore)
    run(store.put_many({"a": b"1", "b": b"22"}))
    assert run(store.get_many(["a", "x", "b"])) == [b"1", None, b"22"]
    assert run(store.exists_many(["b", "x", "a"])) == [True, False, True]
    run(store.delete_many(["a", "x"]))
    assert run(store.get_many(["a", "b"])) == [None, b"22"]
    assert store.num_bytes == 2


def test_byte_cap_evicts_least_recently_used():
    store = MemoryKVStore(capacity_bytes=30)
    run(store.put_many({"a": b"x" * 10, "b": b"y" * 10, "c": b"z" * 10}))
    assert run(store.get_many(["a"])) == [b"x" * 10]       # a is now the most recent
    run(store.put_many({"d": b"w" * 10}))                 # evicts b, the least recent
    assert run(store.exists_many(["a", "b", "c", "d"])) == [True, False, True, True]
    assert store.num_bytes == 30


def test_overwrite_counts_bytes_once_and_oversized_values_are_dropped():
    store = MemoryKVStore(capacity_bytes=16)
    run(store.put_many({"a": b"1" * 8}))
    run(store.put_many({"a": b"2" * 4}))
    assert store.num_bytes == 4
    run(store.put_many({"big": b"3" * 17}))
    assert run(store.exists_many(["big", "a"])) == [False, True]
    assert store.num_bytes == 4


def test_open_store_urls():
    assert isinstance(open_store("memory", memory_capacity_bytes=10), MemoryKVStore)
    with pytest.raises(ValueError, match="not supported"):
        open_store("memcached://x")
    with pytest.raises(ValueError, match="capacity_bytes"):
        MemoryKVStore(0)
