"""`AsyncLLM`: the online engine — a background step-loop thread plus per-request queues.

This is the in-process engine (the CPU default); with `FrontendConfig.engine_process` the
engine core runs in its own process instead and `AsyncLLM(config)` returns the same API from
engine/core_client.py.

Handlers never touch scheduler state: they post `add` / `abort` commands on a thread-safe queue;
the loop thread (the single owner) applies them between steps and delivers each `RequestOutput`
to its request's asyncio queue on the caller's event loop. Torch releases the GIL inside ops, so
HTTP handling runs while a step computes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.engine_core import EngineCore, resolve_device_dtype
from deepinfer.engine.errors import (EngineDeadError, EngineShuttingDownError, QueueFullError,
                                     RequestFailedError)
from deepinfer.engine.outputs import RequestOutput, SchedulerStats
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


def freeze_startup_heap() -> int:
    """Collect garbage, then move every object alive now into the garbage collector's
    permanent generation (`gc.freeze`), so later collections do not scan the model, tokenizer
    and libraries loaded at startup.

    A full collection of a SmolLM2 server's ~300,000 startup objects took ~140 ms on a 2-core
    CPU machine (a generation-1 one ~1.4 ms): a pause of every request in flight, whenever the
    collector decides. vLLM's engine process and SGLang's scheduler freeze their startup heap
    the same way. Call it once per serving process, when startup is done; objects frozen and
    later dropped are still freed by reference counting, only cycles among them are kept.

    Returns:
        the number of frozen objects.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class AsyncLLM:
    """Args:
        config: the engine configuration (model, cache, scheduler, frontend).
        model_factory: a picklable callable that builds the model (benchmarks: random
            weights); None loads `config.model.model`.
    Building it loads the model (blocking) and starts the step loop. When
    `config.frontend.engine_process` resolves to True (default: on CUDA), it returns an
    `MPAsyncLLM` instead (engine/core_client.py): the same API, the engine core in its own
    process.
    """

    def __new__(cls, config: EngineConfig, model_factory: Callable | None = None):
        if cls is AsyncLLM and config.frontend.resolve_engine_process(
                resolve_device_dtype(config.model)[0].type == "cuda"):
            from deepinfer.engine.core_client import MPAsyncLLM

            return MPAsyncLLM(config, model_factory)
        return super().__new__(cls)

    def __init__(self, config: EngineConfig, model_factory: Callable | None = None):
        self.engine_core = EngineCore(config, model_factory() if model_factory else None)
        self.tokenizer = self.engine_core.tokenizer
        self.mm_processor = self.engine_core.mm_processor   # None for a text-only model
        self.model_name = self.engine_core.model_name
        self.max_model_len = self.engine_core.max_model_len
        # requests running or waiting at most (a request of more choices can never fit)
        self.max_in_flight = (config.scheduler.max_num_seqs
                              + config.scheduler.max_waiting_requests)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats = SchedulerStats()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        # its own threads: slow schemas never hold the default pool (prompt tokenization)
        self._grammar_pool = ThreadPoolExecutor(max_workers=2,
                                                thread_name_prefix="deepinfer-grammar")
        self._thread = threading.Thread(target=self._run_loop, name="deepinfer-step-loop",
                                        daemon=True)
        self._thread.start()

    # ---- caller side ---------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None, *,
                       kv_transfer_params: dict | None = None,
                       mm_inputs: list | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas) until it finishes. `kv_transfer_params`: see
        `EngineCore.make_request` (the last output then carries the prefill's answer).
        `mm_inputs`: the prompt's images as plain data (`engine.multimodal.ImageInput`).

        Raises (before the first output):
            QueueFullError: too many requests in flight (HTTP 429).
            PromptTooLongError, ValueError: the prompt does not fit or is invalid (HTTP 400).
            GrammarError (a ValueError): `so_args` cannot be compiled (HTTP 400).
            EngineDeadError: the step loop has died.
        Raises (any time): RequestFailedError: a step failed on this request alone (the
            engine goes on); EngineDeadError: the step loop died meanwhile.
        Closing the iterator early (client gone) aborts the request and frees its blocks.
        """
        self.check_health()
        if sampling_params.so_args is not None:
            await self.compile_grammar(sampling_params.so_args)
        request = self.engine_core.make_request(prompt_token_ids, sampling_params,
                                                request_id or uuid.uuid4().hex,
                                                kv_transfer_params=kv_transfer_params,
                                                mm_inputs=mm_inputs)
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if len(self._streams) >= self.max_in_flight:
                raise QueueFullError(
                    f"{len(self._streams)} requests are in flight (max_num_seqs + "
                    f"max_waiting_requests = {self.max_in_flight}); retry later.")
            if request.request_id in self._streams:
                raise ValueError(f"request id {request.request_id!r} is already in use.")
            self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", request))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:
                self._commands.put(("abort", request.request_id))

    async def compile_grammar(self, so_args: dict) -> None:
        """Compile a structured-output constraint in a grammar worker thread (then cached),
        off the step loop and the event loop.

        Raises:
            GrammarError (a ValueError): the schema, regex or grammar is invalid; the message
                says what is wrong.
        """
        await asyncio.get_running_loop().run_in_executor(
            self._grammar_pool, self.engine_core.structured_output.compile, so_args)

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight: each one's stream raises `EngineShuttingDownError`
        (reason) and its KV blocks are freed. Returns how many were aborted. Thread-safe."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, EngineShuttingDownError(reason))
            self._commands.put(("abort", request_id))
        return len(request_ids)

    def get_stats(self) -> SchedulerStats:
        return self._stats

    def check_health(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine step loop stopped: {self._error!r}; "
                                  "restart the server.")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout_s)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.engine_core.close()

    # ---- loop side -----------------------------------------------------------------------
    def _apply(self, command: str, payload) -> None:
        core = self.engine_core
        if command == "add":
            request: Request = payload
            try:
                core.add_request(request)
            except QueueFullError as error:
                self._deliver(request.request_id, error)
        elif command == "abort":
            core.abort_requests([payload])

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else \
                self._commands.get_nowait()
            while True:
                self._apply(*command)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _run_loop(self) -> None:
        core = self.engine_core
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not core.has_unfinished_requests())
                for output in core.step():
                    if output.finish_reason == "error":   # a step failed on it alone
                        self._deliver(output.request_id, RequestFailedError(output.error))
                    else:
                        self._deliver(output.request_id, output)
                self._stats = core.get_stats()
        except BaseException as error:  # noqa: BLE001 - reported to every waiting request
            logger.exception("engine step loop died")
            self._error = error
            dead = EngineDeadError(f"the engine step loop stopped: {error!r}")
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, dead)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
