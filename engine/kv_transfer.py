"""The engine's only bridge to the KV block store (`kvstore/`): save full prompt blocks after the
step that computed them, load the longest stored prefix of a new request before its prefill.

Keys are the prefix cache's block hash chain (engine/kv_cache/hashing.py, with the model
fingerprint, dtype and block size mixed in), namespaced `{model_fingerprint}:{block_hash:016x}`;
values are `kvstore.codec` blocks holding one block of every layer, `[num_layers, *block_shape]`
in the cache dtype (see `ModelRunner.read_kv_blocks`). Anything wrong with the store — down,
slow, a missing or corrupt value — is a miss: the tokens are recomputed, never an error.

Two sides (engine/executor.py is the seam between them):
- `KVTransfer`, core side: the store connection and its bookkeeping (which requests wait for a
  fetch, hand-offs and their held answers, stats, back-off when the store is down). It deals in
  bytes only, never tensors. The step loop calls `add_request`/`discard` per request and
  `end_step` once per step; the store's coroutines run on one background thread with its own
  asyncio loop.
- `KVBlockCopier`, worker side (behind the executor, beside the `ModelRunner` that owns the
  KV tensors): fetched blocks are staged there (`Executor.stage_kv_blocks`, pinned memory on
  CUDA) and copied into freshly allocated blocks right before the forward pass whose
  `SchedulerOutput.kv_loads` names them; blocks named in `kv_saves` are copied out right after
  the step that wrote them (the copy must precede any reuse of the block: on CUDA one stream
  orders it before later steps' writes, and the host does not wait for it:
  `ModelRunner.start_read_kv_blocks` returns pinned memory and an event). The core collects
  those reads (`Executor.take_kv_reads`) and hands waiting for the copy, encoding and the
  store round trip to the background.
Fetching before allocating means a request waiting for the store (WAITING_FOR_REMOTE_KV) holds no
KV blocks, so an abort or a preemption meanwhile has nothing to leak, and a store that answers
late costs staging memory, not cache capacity. A preempted request fetches again whatever of its
prompt the local cache lost meanwhile.

Disaggregation (DESIGN.md): a request with `kv_transfer_params={"do_remote_decode": true}`
saves all its full prompt blocks; its last output is held until those writes finish, then carries
`{"do_remote_prefill": true, "num_stored_tokens", "block_size", "model_fingerprint"}`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from deepinfer.engine.config import KVTransferConfig
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.outputs import KVBlocks, KVStoreStats, RequestOutput
from deepinfer.engine.request import Request
from deepinfer.kvstore import KVStore, KVStoreError, open_store
from deepinfer.kvstore.codec import BlockHeader, CodecError, decode_block, encode_block

if TYPE_CHECKING:
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0)
FETCH_BATCH_BLOCKS = 32          # keys per store round trip when fetching a prefix
STORE_DOWN_BACKOFF_S = 1.0       # after a store error, skip the store this long
MAX_SAVE_BACKLOG_BYTES = 1 << 30  # saves beyond this many bytes in flight are dropped
FETCH_GRACE_S = 0.002           # a step waits this long, once, for fetches that just started
IDLE_WAIT_S = 0.005             # the step loop's wait while only store traffic is in flight


def model_fingerprint(model_dir: Path, dtype: torch.dtype, block_size: int) -> bytes:
    """8 bytes naming what the KV of a token sequence depends on: the model's config.json, its
    weight files (names, sizes, first and last MiB: cheap for huge checkpoints, stable across
    machines), the cache dtype and the block size."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = path.stat().st_size
        digest.update(path.name.encode() + size.to_bytes(8, "little"))
        with path.open("rb") as weights:
            digest.update(weights.read(1 << 20))
            weights.seek(max(size - (1 << 20), 0))
            digest.update(weights.read(1 << 20))
    digest.update(str(dtype).encode() + block_size.to_bytes(4, "little"))
    return digest.digest()


class _Stats:
    """Counters and latency histograms, updated from both threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = dict(hits=0, misses=0, corrupt=0, errors=0, bytes_loaded=0,
                           bytes_saved=0, blocks_saved=0)
        self.latency = {kind: [0] * (len(LATENCY_BUCKETS_S) + 1) for kind in ("load", "save")}
        self.latency_sum_s = {"load": 0.0, "save": 0.0}

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.counts[name] += delta

    def observe(self, kind: str, seconds: float) -> None:
        index = next((i for i, bound in enumerate(LATENCY_BUCKETS_S) if seconds <= bound),
                     len(LATENCY_BUCKETS_S))
        with self.lock:
            self.latency[kind][index] += 1
            self.latency_sum_s[kind] += seconds

    def snapshot(self) -> KVStoreStats:
        def cumulative(counts: list[int]) -> tuple[int, ...]:
            total, out = 0, []
            for count in counts:
                total += count
                out.append(total)
            return tuple(out)

        with self.lock:
            return KVStoreStats(**self.counts, latency_buckets_s=LATENCY_BUCKETS_S,
                                load_latency_counts=cumulative(self.latency["load"]),
                                load_latency_sum_s=self.latency_sum_s["load"],
                                save_latency_counts=cumulative(self.latency["save"]),
                                save_latency_sum_s=self.latency_sum_s["save"])


class KVWorker(Protocol):
    """What `KVTransfer` needs of the worker side (an `Executor`, or a `KVBlockCopier`)."""

    def kv_block_header(self) -> BlockHeader: ...

    def stage_kv_blocks(self, request_id: str, block_hashes: list[int],
                        payloads: np.ndarray) -> None: ...

    def drop_staged_kv_blocks(self, request_ids) -> None: ...

    def take_kv_reads(self) -> list[tuple[list[KVBlocks], KVBlockRead]]: ...


class KVTransfer:
    """Core side (see the module doc). Args:
        config: the store URL, role and timeouts.
        worker: the worker side, which copies blocks in and out of the KV cache.
        fingerprint: `model_fingerprint(...)`, also the block hashes' `extra`.
        block_size: tokens per block.
        store: an already built store (tests share one); None opens `config.kv_store`.
    """

    def __init__(self, config: KVTransferConfig, worker: KVWorker, fingerprint: bytes,
                 block_size: int, store: KVStore | None = None):
        self.config = config
        self.worker = worker
        self.block_size = block_size
        self.fingerprint_hex = fingerprint.hex()
        self.store = store if store is not None else open_store(
            config.kv_store, memory_capacity_bytes=config.memory_store_bytes,
            ttl_s=config.ttl_s or None, timeout_s=config.timeout_s)
        self.header = worker.kv_block_header()
        self.stats = _Stats()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="deepinfer-kv-transfer")
        self._thread.start()
        self._wake = threading.Event()
        self._down_until = 0.0
        self._save_backlog_bytes = 0
        # request id -> (index of its first block fetched, their hashes, the fetch)
        self._loads: dict[str, tuple[int, list[int], concurrent.futures.Future]] = {}
        self._fresh_loads: list[concurrent.futures.Future] = []  # not yet given their grace
        # hand-off request id -> (its full prompt block hashes, [(hashes saved, future ok)])
        self._handoffs: dict[str, tuple[list[int], list]] = {}
        self._held: list[RequestOutput] = []
        self._saves_in_flight: set[concurrent.futures.Future] = set()

    def key(self, block_hash: int) -> str:
        return f"{self.fingerprint_hex}:{block_hash:016x}"

    def close(self) -> None:
        """Close the store and stop the background loop."""
        asyncio.run_coroutine_threadsafe(self.store.close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request, kv_cache_manager: KVCacheManager) -> bool:
        """Note a hand-off request and start fetching the stored blocks past the request's local
        prefix-cache hits. Returns True when a fetch started: the scheduler then holds the
        request until `finished_loads` reports it."""
        hashes, num_local = kv_cache_manager.lookup_prefix(request)
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and params.get("model_fingerprint") not in (
                None, self.fingerprint_hex):
            # %.40r: the value comes from the client's body, which may hold megabytes
            logger.warning("request %s was prefilled by a worker with model fingerprint %.40r, "
                           "this one has %s (another model, dtype or block size): its blocks "
                           "cannot be used, the prompt is recomputed", request.request_id,
                           params.get("model_fingerprint"), self.fingerprint_hex)
        if params.get("do_remote_decode"):
            prompt_hashes = request.block_hashes[:request.num_prompt_tokens // self.block_size]
            self._handoffs[request.request_id] = (list(prompt_hashes), [])
        wanted = hashes[num_local:]
        if not wanted:
            return False
        if self._store_down():
            self.stats.add(misses=len(wanted))
            return False
        future = self._submit(self._fetch(wanted))
        self._loads[request.request_id] = (num_local, wanted, future)
        self._fresh_loads.append(future)
        return True

    def discard(self, request_ids) -> None:
        """Forget aborted requests: pending fetches, staged blocks, hand-off state."""
        for request_id in request_ids:
            load = self._loads.pop(request_id, None)
            if load is not None:
                load[2].cancel()
            self._handoffs.pop(request_id, None)
        self.worker.drop_staged_kv_blocks(request_ids)

    def end_step(self, scheduler: Scheduler, outputs: list[RequestOutput], *,
                 idle: bool) -> list[RequestOutput]:
        """The KV store's work of one step, after its results: send the blocks the step
        copied out to the store, let fetched requests rejoin the queue (their blocks staged
        on the worker), look up again what preemption evicted, and return the outputs to
        deliver now (a hand-off's answer waits for its saves). `idle`: nothing ran this step;
        then wait a little for the store instead of spinning."""
        self._send_saves(self.worker.take_kv_reads())
        scheduler.save_kv_blocks = self.config.role != "decode" and not (
            self._store_down() or self._save_backlog_bytes > MAX_SAVE_BACKLOG_BYTES)
        if idle:
            self.wait(IDLE_WAIT_S)
        scheduler.remote_kv_ready(self.finished_loads())
        for request in scheduler.take_preempted():
            if self.add_request(request, scheduler.kv_cache_manager):
                scheduler.wait_for_remote_kv(request.request_id)
        return self.hold_finished(outputs)

    def finished_loads(self, wait_s: float = FETCH_GRACE_S) -> dict[str, tuple[int, int]]:
        """Requests whose fetch ended since the last call: id -> (first block index, number of
        blocks staged on the worker, where they wait for a step's `kv_loads`). Waits up to
        `wait_s` for the fetches started since the last call, once each: a fast store (memory,
        a local Redis) does not cost a new request a whole step, and a slow fetch does not
        hold back every step of the running requests while it lasts."""
        fresh, self._fresh_loads = self._fresh_loads, []
        if fresh and wait_s > 0:
            concurrent.futures.wait(fresh, wait_s)
        ready = {}
        for request_id, (first_block, wanted, future) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[request_id]
            try:
                blocks = future.result()
            except Exception:  # a bug, not the store (whose failures _fetch absorbs)
                logger.exception("KV store fetch failed; recomputing")
                blocks = np.empty((0, self.header.num_bytes), dtype=np.uint8)
            if len(blocks):
                self.worker.stage_kv_blocks(request_id, wanted, blocks)
            ready[request_id] = (first_block, len(blocks))
        return ready

    def _send_saves(self, reads: list[tuple[list[KVBlocks], KVBlockRead]]) -> None:
        """Send blocks the worker copied out of the cache to the store, in the background
        (dropped while the store is down or the backlog is full: a hand-off then reports
        fewer stored tokens, and the decode side recomputes)."""
        for saves, read in reads:
            if self._store_down() or self._save_backlog_bytes > MAX_SAVE_BACKLOG_BYTES:
                return
            offset = 0
            for save in saves:
                rows = (offset, offset + len(save.block_ids))
                offset = rows[1]
                self._add_backlog(len(save.block_ids) * self.header.num_bytes)
                future = self._submit(self._put(save.block_hashes, read, rows))
                self._saves_in_flight.add(future)
                future.add_done_callback(self._saves_in_flight.discard)
                if save.request_id in self._handoffs:
                    self._handoffs[save.request_id][1].append((save.block_hashes, future))

    def hold_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs to deliver now. A hand-off request's last output is held until its block
        saves have finished, then released with its `kv_transfer_params`."""
        ready = []
        for out in outputs:
            (self._held if out.finished and out.request_id in self._handoffs else ready).append(out)
        for out in list(self._held):
            prompt_hashes, saves = self._handoffs.get(out.request_id, ([], []))  # {}: aborted
            if all(future.done() for _, future in saves):
                self._held.remove(out)
                self._handoffs.pop(out.request_id, None)
                out.kv_transfer_params = self._handoff_params(prompt_hashes, saves)
                ready.append(out)
        return ready

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every save sent so far has finished (or `timeout_s` passed)."""
        concurrent.futures.wait(list(self._saves_in_flight), timeout_s)

    def has_held_outputs(self) -> bool:
        return bool(self._held)

    def wait(self, timeout_s: float) -> None:
        """Block the step loop until a fetch or save ends (or `timeout_s`), when store traffic
        is all that is left to wait for."""
        if self._loads or self._held:
            self._wake.wait(timeout_s)
        self._wake.clear()

    def get_stats(self) -> KVStoreStats:
        return self.stats.snapshot()

    def _handoff_params(self, prompt_hashes: list[int], saves: list) -> dict:
        stored = {h for hashes, future in saves
                  if not future.cancelled() and future.exception() is None and future.result()
                  for h in hashes}
        num_stored_blocks = 0
        while num_stored_blocks < len(prompt_hashes) and prompt_hashes[num_stored_blocks] in stored:
            num_stored_blocks += 1
        return {"do_remote_prefill": True, "num_stored_tokens": num_stored_blocks * self.block_size,
                "block_size": self.block_size, "model_fingerprint": self.fingerprint_hex}

    # ---- background side -----------------------------------------------------------------
    def _submit(self, coroutine) -> concurrent.futures.Future:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        future.add_done_callback(lambda _: self._wake.set())
        return future

    def _add_backlog(self, num_bytes: int) -> None:
        with self.stats.lock:
            self._save_backlog_bytes += num_bytes

    def _store_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _store_failed(self, what: str, error: BaseException) -> None:
        self.stats.add(errors=1)
        self._down_until = time.monotonic() + STORE_DOWN_BACKOFF_S
        logger.warning("KV store %s failed (%r); recomputing instead for %.0f s", what, error,
                       STORE_DOWN_BACKOFF_S)

    async def _fetch(self, hashes: list[int]) -> np.ndarray:
        """The longest prefix of `hashes` held (valid) in the store, as the payloads' bytes
        [num_found, header.num_bytes] uint8; never raises."""
        started = time.monotonic()
        found: list[memoryview] = []
        corrupt = 0
        try:
            for batch_start in range(0, len(hashes), FETCH_BATCH_BLOCKS):
                batch = hashes[batch_start:batch_start + FETCH_BATCH_BLOCKS]
                values = await asyncio.wait_for(self.store.get_many([self.key(h) for h in batch]),
                                                self.config.timeout_s * 4)
                payloads, corrupt = self._decode_prefix(batch, values)
                found.extend(payloads)
                if len(payloads) < len(batch):
                    break
        except (KVStoreError, asyncio.TimeoutError, OSError) as error:
            self._store_failed("load", error)
        except Exception:  # never let a store quirk fail the request: recompute instead
            logger.exception("KV store load failed")
            self.stats.add(errors=1)
        blocks = np.empty((len(found), self.header.num_bytes), dtype=np.uint8)
        for row, payload in enumerate(found):
            blocks[row] = np.frombuffer(payload, dtype=np.uint8)  # a plain memoryview: 7x slower
        self.stats.add(hits=len(found), misses=len(hashes) - len(found), corrupt=corrupt,
                       bytes_loaded=blocks.nbytes)
        self.stats.observe("load", time.monotonic() - started)
        return blocks

    def _decode_prefix(self, hashes: list[int], values: list[bytes | None]
                       ) -> tuple[list[memoryview], int]:
        """Payloads of the leading values that decode under their key and fit this cache;
        (payloads, 1 if the first bad value was corrupt, of another key or layout else 0)."""
        payloads = []
        for block_hash, value in zip(hashes, values):
            if value is None:
                return payloads, 0
            try:
                header, payload = decode_block(value, key=self.key(block_hash))
            except CodecError as error:
                logger.warning("KV store block is corrupt (%s); recomputing it", error)
                return payloads, 1
            if header != self.header:
                logger.warning("KV store block has layout %s, this cache %s; recomputing it",
                               header, self.header)
                return payloads, 1
            payloads.append(payload)
        return payloads, 0

    async def _put(self, hashes: list[int], read: KVBlockRead, rows: tuple[int, int]) -> bool:
        """Encode and store rows [start, end) of a worker's block read; True when all were
        stored. A read still in flight (a device-to-host copy) is waited for on a worker
        thread, so that this loop's other fetches and saves go on meanwhile."""
        started = time.monotonic()
        num_bytes = len(hashes) * self.header.num_bytes
        try:
            payloads = await asyncio.to_thread(read.payloads) if read.pending else read.payloads()
            raw = payloads[rows[0]:rows[1]]
            items = {self.key(h): encode_block(self.header, raw[i], key=self.key(h))
                     for i, h in enumerate(hashes)}
            await asyncio.wait_for(self.store.put_many(items), self.config.timeout_s * 4)
        except (KVStoreError, asyncio.TimeoutError, OSError) as error:
            self._store_failed("save", error)
            return False
        except Exception:  # a save that fails only costs a later recompute
            logger.exception("KV store save failed")
            self.stats.add(errors=1)
            return False
        finally:
            self._add_backlog(-num_bytes)
        self.stats.add(bytes_saved=num_bytes, blocks_saved=len(hashes))
        self.stats.observe("save", time.monotonic() - started)
        return True


class NoKVTransfer:
    """Stands in for `KVTransfer` when no store is configured: every method does nothing."""

    def add_request(self, request: Request, kv_cache_manager: KVCacheManager) -> bool:
        return False

    def discard(self, request_ids) -> None:
        pass

    def end_step(self, scheduler: Scheduler, outputs: list[RequestOutput], *,
                 idle: bool) -> list[RequestOutput]:
        scheduler.take_preempted()  # nothing to look up again
        return outputs

    def has_held_outputs(self) -> bool:
        return False

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def get_stats(self) -> KVStoreStats | None:
        return None

    def close(self) -> None:
        pass


# ---- worker side ---------------------------------------------------------------------------
class KVBlockRead:
    """Blocks being copied out of the KV cache (`ModelRunner.start_read_kv_blocks`).

    blocks: [n, num_layers, *block_shape] on CPU in the cache dtype (pinned on CUDA).
    ready: on CUDA, an event recorded after the copy (the blocks hold their values once it has
        completed); None when they already do.
    """

    def __init__(self, blocks: torch.Tensor, ready: torch.cuda.Event | None):
        self.blocks = blocks
        self.ready = ready

    @property
    def pending(self) -> bool:
        """True when `payloads()` may wait for the device."""
        return self.ready is not None

    def payloads(self) -> np.ndarray:
        """[n, block_bytes] uint8: the blocks' bytes, once the copy has completed (waits)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.blocks.reshape(self.blocks.shape[0], -1).view(torch.uint8).numpy()


class KVBlockCopier:
    """Worker side of the KV store bridge: the block copies into and out of the runner's KV
    tensors (see the module doc). Called on the worker's thread, by its executor.

    Args:
        runner: owner of the KV tensors (`kv_caches`, `kv_block_dim`, `write_kv_blocks`,
            `start_read_kv_blocks`).
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        sample = runner.kv_caches[0]
        block_shape = list(sample.shape)
        del block_shape[runner.kv_block_dim]
        self.header = BlockHeader(
            layout=f"{type(runner.kv_cache_spec).__name__}:block_axis={runner.kv_block_dim}",
            dtype=str(sample.dtype).removeprefix("torch."),
            shape=(len(runner.kv_caches), *block_shape))
        self._staged: dict[str, tuple[list[int], torch.Tensor]] = {}  # id -> (hashes, blocks)
        self._reads: list[tuple[list[KVBlocks], KVBlockRead]] = []

    # the `KVWorker` methods, for KVTransfer (an executor forwards them)
    def kv_block_header(self) -> BlockHeader:
        return self.header

    def stage_kv_blocks(self, request_id: str, block_hashes: list[int],
                        payloads: np.ndarray) -> None:
        """Hold fetched blocks ([n, block_bytes] uint8, `block_hashes[i]` for row i) until a
        step's `kv_loads` names where they go. Pinned on CUDA: the copy to the device then
        does not wait for the step in flight."""
        sample = self.runner.kv_caches[0]
        blocks = torch.from_numpy(payloads).view(sample.dtype).view(
            len(payloads), *self.header.shape)  # [n, num_layers, *block_shape]
        if sample.is_cuda:
            blocks = blocks.pin_memory()
        self._staged[request_id] = (block_hashes, blocks)

    def drop_staged_kv_blocks(self, request_ids) -> None:
        for request_id in request_ids:
            self._staged.pop(request_id, None)

    def take_kv_reads(self) -> list[tuple[list[KVBlocks], KVBlockRead]]:
        reads, self._reads = self._reads, []
        return reads

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    # the step's copies, called by the executor around the forward pass
    def load(self, loads: list[KVBlocks]) -> None:
        """Copy staged blocks into the blocks the scheduler allocated for them (right before
        the forward pass); staged blocks left unused are dropped."""
        for load in loads:
            staged = self._staged.pop(load.request_id, None)
            if staged is None or not load.block_ids:
                continue
            wanted, blocks = staged
            offset = wanted.index(load.block_hashes[0])
            self.runner.write_kv_blocks(load.block_ids,
                                        blocks[offset:offset + len(load.block_ids)])

    def save(self, saves: list[KVBlocks]) -> None:
        """Start copying full blocks out of the cache (after the forward pass that wrote
        them, before any later step can reuse them); `take_kv_reads` hands them over."""
        if saves:
            data, ready = self.runner.start_read_kv_blocks(
                [i for save in saves for i in save.block_ids])
            self._reads.append((saves, KVBlockRead(data, ready)))
