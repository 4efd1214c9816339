"""KV store round trips through the engine (engine/kv_transfer.py) on a tiny random Llama:
greedy tokens are identical whether the prompt's KV is computed or loaded, and every failure
of the store (corrupt value, other model, store down) falls back to recomputing."""

import asyncio

import pytest
import redis
import torch

from deepinfer.engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.kv_cache.spec import FullAttentionSpec, MLAAttentionSpec
from deepinfer.engine.kv_transfer import KVBlockCopier, KVTransfer
from deepinfer.engine.outputs import KVBlocks
from deepinfer.engine.request import RequestStatus
from deepinfer.engine.sampling_params import SamplingParams
from kv_runner_fake import FakeRunner
from deepinfer.kvstore import MemoryKVStore
from tests.tiny_models import save_tiny_llama

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(100, 170)),          # 70 tokens: 17 blocks may load, a partial last block
           list(range(2000, 2016)),        # 16 tokens: a full last block is still recomputed
           [5, 6, 7]]                      # shorter than a block: nothing to load


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory, smollm2_tokenizer):
    """The tiny Llama's twin: same config.json, other random weights."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-other"), smollm2_tokenizer,
                           seed=1)


def make_core(model_dir, *, kv_store="memory", role="both", num_blocks=256) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        kv_transfer=KVTransferConfig(role=role, kv_store=kv_store, timeout_s=0.5))
    return EngineCore(config)


def fresh(core, store=None) -> EngineCore:
    """Forget the engine's local prefix cache (as a new replica would start) and, if given,
    switch it to `store`."""
    core.scheduler.kv_cache_manager.reset_prefix_cache()
    if store is not None:
        core.kv_transfer.store = store
    return core


def run(core, prompts, params=GREEDY, kv_transfer_params=None):
    """Generate to the end, then wait for the block saves; (token ids per prompt, outputs)."""
    requests = [core.make_request(p, params, f"r{i}", kv_transfer_params=kv_transfer_params)
                for i, p in enumerate(prompts)]
    for request in requests:
        core.add_request(request)
    finals = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    outs = [finals[r.request_id] for r in requests]
    core.kv_transfer.flush()  # saves land in the background; let them finish
    return [o.token_ids for o in outs], outs


def free_blocks(core) -> int:
    return core.scheduler.kv_cache_manager.block_pool.num_free_blocks


def delta(core, before):
    """KV store counters since `before` (a KVStoreStats)."""
    after = core.get_stats().kv_store
    return {name: getattr(after, name) - getattr(before, name)
            for name in ("hits", "misses", "corrupt", "errors", "bytes_loaded", "blocks_saved")}


@pytest.fixture(scope="module")
def cold(tiny_llama_dir):
    return run(make_core(tiny_llama_dir, kv_store="none"), PROMPTS)[0]


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    """One engine with a store, reused: `fresh()` makes it a new replica on a given store."""
    return make_core(tiny_llama_dir)


def test_store_hit_gives_the_cold_tokens(core, cold):
    fresh(core, MemoryKVStore())
    before = core.get_stats().kv_store
    assert run(core, PROMPTS)[0] == cold
    assert delta(core, before)["blocks_saved"] == 17 + 4  # full prompt blocks only
    before = core.get_stats().kv_store
    tokens, outs = run(fresh(core), PROMPTS)
    assert tokens == cold
    assert [o.num_cached_tokens for o in outs] == [68, 12, 0]  # 17 and 3 blocks loaded
    assert delta(core, before) == {"hits": 20, "misses": 0, "corrupt": 0, "errors": 0,
                                   "bytes_loaded": 20 * 2 * 2 * BLOCK * 2 * 16 * 4,
                                   "blocks_saved": 1}  # layers, K/V, tokens, heads, head_dim
    # (the one block saved again: the 16-token prompt's last block, recomputed for its logits)
    assert free_blocks(core) == 256


def test_corrupt_block_is_recomputed(core, cold):
    store = MemoryKVStore()
    run(fresh(core, store), PROMPTS[:1])
    keys = list(store._items)   # saved in block order
    value = bytearray(store._items[keys[5]])
    value[-7] ^= 0x40
    store._items[keys[5]] = bytes(value)
    before = core.get_stats().kv_store
    tokens, outs = run(fresh(core), PROMPTS[:1])
    assert tokens == cold[:1]
    stats = delta(core, before)
    assert (stats["hits"], stats["misses"], stats["corrupt"]) == (5, 12, 1)
    assert outs[0].num_cached_tokens == 5 * BLOCK


def test_a_block_swapped_to_another_key_is_recomputed(core, cold):
    """Issue 26.6: a valid block (correct CRC) copied under another prompt's key used to load
    and give a silently wrong answer; the key is bound into the value, so it is a corrupt miss
    and the tokens are the cold ones."""
    store = MemoryKVStore()
    run(fresh(core, store), PROMPTS[:2])
    keys = list(store._items)   # saved in block order: 17 of PROMPTS[0], then 4 of PROMPTS[1]
    store._items[keys[17]] = store._items[keys[0]]   # PROMPTS[1]'s first block <- another's
    before = core.get_stats().kv_store
    tokens, outs = run(fresh(core), PROMPTS[1:2])
    assert tokens == cold[1:2]
    stats = delta(core, before)
    assert (stats["hits"], stats["corrupt"]) == (0, 1)
    assert outs[0].num_cached_tokens == 0


def test_other_model_never_reads_these_blocks(core, other_llama_dir):
    store = MemoryKVStore()
    run(fresh(core, store), PROMPTS)
    other = make_core(other_llama_dir)
    assert other.kv_transfer.fingerprint_hex != core.kv_transfer.fingerprint_hex
    other_cold = run(other, PROMPTS)[0]
    tokens, outs = run(fresh(other, store), PROMPTS)
    assert tokens == other_cold
    assert other.get_stats().kv_store.hits == 0
    assert all(o.num_cached_tokens == 0 for o in outs)


def test_prefill_hands_off_to_decode_then_redis_down(tiny_llama_dir, cold, redis_server):
    prefill = make_core(tiny_llama_dir, kv_store=redis_server.url, role="prefill")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tokens, outs = run(prefill, PROMPTS[:2], one, kv_transfer_params={"do_remote_decode": True})
    assert [t[0] for t in tokens] == [c[0] for c in cold[:2]]
    params = [o.kv_transfer_params for o in outs]
    assert [p["num_stored_tokens"] for p in params] == [68, 16]
    assert all(p["do_remote_prefill"] and p["block_size"] == BLOCK for p in params)
    keys = redis.Redis.from_url(redis_server.url).keys("*")
    namespace = f"deepinfer:kv:{prefill.kv_transfer.fingerprint_hex}:"
    assert len(keys) == 17 + 4 and all(k.decode().startswith(namespace) for k in keys)
    decode = make_core(tiny_llama_dir, kv_store=redis_server.url, role="decode")
    tokens, outs = run(decode, PROMPTS[:2], kv_transfer_params=params[0])
    assert tokens == cold[:2]
    assert [o.num_cached_tokens for o in outs] == [68, 12]
    assert decode.get_stats().kv_store.blocks_saved == 0  # a decode worker saves nothing

    redis_server.stop()   # the store goes away: the same request is recomputed
    before = decode.get_stats().kv_store
    tokens, outs = run(fresh(decode), PROMPTS[:2], kv_transfer_params=params[0])
    assert tokens == cold[:2]
    stats = delta(decode, before)
    assert stats["hits"] == 0 and stats["errors"] >= 1
    assert free_blocks(decode) == 256


class SlowStore(MemoryKVStore):
    """A memory store whose reads wait until `release` is set (a fetch stays in flight)."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def get_many(self, keys):
        await self.release.wait()
        return await super().get_many(keys)


def test_abort_while_loading_leaks_nothing(core):
    store = SlowStore()
    fresh(core, store)
    request = core.make_request(PROMPTS[0], GREEDY, "slow")
    core.add_request(request)
    core.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    core.abort_requests(["slow"])
    core.kv_transfer._loop.call_soon_threadsafe(store.release.set)
    core.step()
    assert not core.has_unfinished_requests()
    assert free_blocks(core) == 256
    assert not core.kv_transfer._loads and core.executor.kv.num_staged == 0


def test_a_slow_fetch_delays_one_step_not_every_step(core, monkeypatch):
    """The grace wait for a fetch is spent once, in the step after it started; later steps
    only poll it (running requests keep their step rate while it lasts)."""
    import deepinfer.engine.kv_transfer as kv_transfer

    waits = []
    real_wait = kv_transfer.concurrent.futures.wait
    monkeypatch.setattr(kv_transfer.concurrent.futures, "wait",
                        lambda futures, timeout: waits.append(len(futures))
                        or real_wait(futures, timeout))
    store = SlowStore()
    fresh(core, store)
    request = core.make_request(PROMPTS[0], GREEDY, "slow-grace")
    core.add_request(request)
    for _ in range(4):
        core.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert waits == [1]
    core.kv_transfer._loop.call_soon_threadsafe(store.release.set)
    while core.has_unfinished_requests():
        core.step()
    assert waits == [1] and not core.kv_transfer._loads


def test_preemption_after_loading_gives_the_cold_tokens(tiny_llama_dir, core, cold):
    store = MemoryKVStore()
    run(fresh(core, store), PROMPTS)
    # 24 blocks cannot hold all three requests' prompts and outputs at once
    small = make_core(tiny_llama_dir, num_blocks=24)
    tokens, _ = run(fresh(small, store), PROMPTS)
    assert tokens == cold
    assert small.scheduler.num_preemptions > 0
    assert small.get_stats().kv_store.hits > 0
    assert free_blocks(small) == 24


@pytest.mark.parametrize("layout", ["full", "mla"])
def test_blocks_round_trip_bitwise_for_any_layout(layout):
    """Save blocks 3 and 5 of one cache, load them into blocks 0 and 7 of another: the same
    bits, for K/V [2, num_blocks, ...] in float32 and MLA's [num_blocks, ...] in bfloat16."""
    spec, dtype = ((FullAttentionSpec(3, 2, 8, 4), torch.float32) if layout == "full" else
                   (MLAAttentionSpec(3, kv_lora_rank=16, qk_rope_head_dim=8, dtype_bytes=2),
                    torch.bfloat16))
    store = MemoryKVStore()
    source, target = (FakeRunner(spec, 8, dtype, seed=0, block_size=BLOCK),
                      FakeRunner(spec, 8, dtype, seed=1, block_size=BLOCK))
    source_copier, target_copier = KVBlockCopier(source), KVBlockCopier(target)
    saver = KVTransfer(KVTransferConfig(), source_copier, b"\x01" * 8, BLOCK, store=store)
    source_copier.save([KVBlocks("a", [3, 5], [11, 12])])      # the worker copies out,
    saver._send_saves(source_copier.take_kv_reads())          # the core side stores
    saver.flush()
    loader = KVTransfer(KVTransferConfig(), target_copier, b"\x01" * 8, BLOCK, store=store)
    blocks = loader._submit(loader._fetch([11, 12, 13])).result()
    assert blocks.shape == (2, loader.header.num_bytes)  # 13 was never stored
    target_copier.stage_kv_blocks("b", [11, 12], blocks)
    target_copier.load([KVBlocks("b", [0, 7], [11, 12])])
    assert target_copier.num_staged == 0
    axis = source.kv_block_dim
    assert axis == (1 if layout == "full" else 0)
    for src, dst in zip(source.kv_caches, target.kv_caches):
        assert torch.equal(src.select(axis, 3), dst.select(axis, 0))
        assert torch.equal(src.select(axis, 5), dst.select(axis, 7))
    assert loader.header.dtype == ("float32" if layout == "full" else "bfloat16")
    saver.close()
    loader.close()


class SlowPutStore(MemoryKVStore):
    """A memory store whose writes wait until `release` is set."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def put_many(self, items):
        await self.release.wait()
        await super().put_many(items)


@pytest.mark.parametrize("abort", [False, True])
def test_handoff_answer_waits_for_its_saves(core, abort):
    store = SlowPutStore()
    fresh(core, store)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = core.make_request(PROMPTS[0], one, "handoff",
                                kv_transfer_params={"do_remote_decode": True})
    core.add_request(request)
    finals = []
    while not request.is_finished:
        finals += [o for o in core.step() if o.finished]
    finals += [o for o in core.step() if o.finished]
    assert finals == [] and core.has_unfinished_requests()  # held: the blocks are not stored
    if abort:
        core.abort_requests(["handoff"])  # the client left while the saves were in flight
    core.kv_transfer._loop.call_soon_threadsafe(store.release.set)
    while core.has_unfinished_requests():
        finals += [o for o in core.step() if o.finished]
    core.kv_transfer.flush()  # after an abort the answer need not wait for the saves
    assert len(finals) == 1 and len(store) == 17
    assert finals[0].kv_transfer_params["num_stored_tokens"] == (0 if abort else 68)
    assert free_blocks(core) == 256


def test_foreign_fingerprint_log_is_bounded(core, cold, caplog):
    """`kv_transfer_params` come from the client: a megabyte fingerprint is not logged whole,
    and the prompt is still served (recomputed or loaded under this worker's own keys)."""
    huge = {"do_remote_prefill": True, "model_fingerprint": "A" * 1_000_000,
            "num_stored_tokens": 10 ** 30, "block_size": "x"}
    with caplog.at_level("WARNING", logger="deepinfer.engine.kv_transfer"):
        tokens, _ = run(fresh(core, MemoryKVStore()), PROMPTS[:1], kv_transfer_params=huge)
    assert tokens == cold[:1]
    warnings = [r.getMessage() for r in caplog.records if "fingerprint" in r.getMessage()]
    assert warnings and all(len(message) < 1000 for message in warnings)
    assert free_blocks(core) == 256
