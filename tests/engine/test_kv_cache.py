"""Block pool and KV cache manager: prefix hits, eviction order, ref counts (no torch)."""

import pytest

from deepinfer.engine.kv_cache import BlockPool, KVCacheManager
from deepinfer.engine.kv_cache.hashing import ROOT_HASH, hash_block_tokens
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8))


def test_hash_chain_is_stable_and_depends_on_parent_and_extra():
    h1 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(ROOT_HASH, [5, 6, 7, 8])
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], b"model-a") != \
        hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], b"model-b")
    # pinned value: the encoding must never change silently (other processes share these keys)
    assert h1 == 2821693476514209883


def test_pool_allocates_uncached_first_then_evicts_lru():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.free([b, a])  # b evicted before a
    assert pool.num_free_blocks == 4
    c, d = pool.allocate(2)  # the two never-used blocks
    assert {c.block_id, d.block_id} == {2, 3}
    assert pool.get_cached_block(111) is a and pool.get_cached_block(222) is b
    (e,) = pool.allocate(1)
    assert e is b and pool.get_cached_block(222) is None and e.block_hash is None
    assert pool.get_cached_block(111) is a


def test_pool_refuses_over_allocation_and_double_free():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)


def test_prefix_hit_shares_blocks_and_ref_counts():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert manager.get_computed_blocks(first) == ([], 0)
    assert len(manager.allocate_slots(first, 10)) == 3

    second = make_request("b", list(range(8)) + [99, 98, 97])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert [b.block_id for b in hits] == manager.get_block_ids("a")[:2]
    new_ids = manager.allocate_slots(second, 3, hits)
    assert len(new_ids) == 1
    assert [b.ref_cnt for b in hits] == [2, 2]
    manager.free(first)
    assert [b.ref_cnt for b in hits] == [1, 1]
    manager.free(second)
    assert manager.block_pool.num_free_blocks == 10
    assert manager.usage == 0.0


def test_last_token_is_never_a_hit():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(8)))
    manager.allocate_slots(first, 8)
    manager.free(first)
    again = make_request("b", list(range(8)))
    _, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 4  # the second block holds the last token: recomputed


def test_freed_prefix_survives_until_evicted_tail_first():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    manager.allocate_slots(first, 8)
    manager.free(first)  # tail first: block of [7, 8] is the first to go
    other = make_request("x", [50, 51])
    manager.allocate_slots(other, 2)
    again = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 6


def test_allocate_fails_without_side_effects():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.block_pool.num_free_blocks == 2
    assert manager.get_block_ids("a") == []


def test_evictable_hits_are_not_double_counted_as_free():
    manager = KVCacheManager(num_blocks=3, block_size=2)
    first = make_request("a", [1, 2, 3, 4])
    manager.allocate_slots(first, 4)
    manager.free(first)
    second = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 4
    # needs 4 blocks in all: 2 hits + 2 new, but only 1 block is free besides the hits
    assert manager.allocate_slots(second, 4, hits) is None
    assert manager.block_pool.num_free_blocks == 3


def test_prefix_cache_counters():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(9)))
    manager.get_computed_blocks(first)
    manager.allocate_slots(first, 9)
    second = make_request("b", list(range(9)))
    manager.get_computed_blocks(second)
    assert manager.prefix_cache_queries == 18
    assert manager.prefix_cache_hits == 8


def test_a_cache_salt_isolates_every_block_of_the_chain():
    """Issue 26.3: the salt enters the first block's hash and the chain carries it, so
    requests with other salts (or none) share no block, in the cache or the KV store."""
    from deepinfer.engine.kv_cache.hashing import extend_block_hashes

    tokens = list(range(100, 116))

    def chain(salt):
        hashes: list[int] = []
        extend_block_hashes(hashes, lambda a, b: tokens[a:b], 16, 4, b"model", salt)
        return hashes

    plain, alice, bob = chain(None), chain("alice"), chain("bob")
    assert len(plain) == 4 and chain("alice") == alice
    for a, b in ((plain, alice), (alice, bob), (plain, bob)):
        assert not set(a) & set(b)
    assert chain("") == plain   # no salt (the API refuses an empty one)


def test_requests_with_another_salt_get_no_prefix_hit():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 113))
    salted = SamplingParams(max_tokens=8, cache_salt="alice")
    first = Request("a", tokens, salted)
    assert manager.get_computed_blocks(first) == ([], 0)
    manager.allocate_slots(first, len(tokens))
    manager.free(first)
    assert Request("x", tokens, salted).cache_salt == "alice"
    for request_id, params, hits in (("b", SamplingParams(max_tokens=8), 0),
                                     ("c", SamplingParams(max_tokens=8, cache_salt="bob"), 0),
                                     ("d", salted, 12)):
        assert manager.get_computed_blocks(Request(request_id, tokens, params))[1] == hits
