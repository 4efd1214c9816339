"""`MPAsyncLLM`: `AsyncLLM`'s public API with the engine core in its own process.

The engine core process (engine/core_proc.py) runs `EngineCore` + executor; this side, in the
API server process, owns the tokenizer, detokenization and stop strings (`OutputProcessor`) and
the per-request asyncio queues. Messages are msgspec msgpack over two ZeroMQ IPC sockets
(engine/core_wire.py): requests, aborts and grammar compiles go down; one message per engine
step comes up with every request's new tokens. A reader thread receives each step's message,
detokenizes it and hands each event loop its outputs in one `call_soon_threadsafe` (one wake-up
per step, not one per token per request); a stream whose consumer lags gets what has queued as
one output. A request a stop string ended here is aborted in the core (its extra tokens, if any,
are dropped).

Choice: `FrontendConfig.engine_process` (engine/config.py); `AsyncLLM(config)` returns an
`MPAsyncLLM` when it resolves to True. Failure: the core process dying (killed, or its loop
raising) fails every waiting request and every later call with `EngineDeadError` (HTTP 503);
no call hangs on a dead core.

Process lifetime: the core is a non-daemonic child (a daemonic process may not start children,
and with data parallelism the core spawns one worker per rank, engine/dp_executor.py). So it
never outlives this process: `shutdown()` (also run at interpreter exit, before
multiprocessing joins its children) stops it and joins it, killing it after a timeout; a core
whose API server process died outright notices within a step (engine/core_proc.py) and shuts
its workers down; a core killed outright is reaped by the reader's liveness check, and its
workers exit on their closed pipes.

Several API servers (`--api-server-count`, server/api_servers.py): the launcher starts the
core (`start_core_process`) and each API server process builds `MPAsyncLLM(config,
endpoints=..., client_index=i)`, which binds its own socket pair, tags what it sends with its
index and gets back only its requests' outputs; it does not own the core: `shutdown()` tells
the core this API server is done (the core stops when all have, and the launcher joins it),
and its liveness check is the core's pid (the launcher reaps a core that exits).

Images: the API server process holds the model's `mm_processor` (engine/mm_processor.py,
None for a text-only model) to expand prompts and preprocess images; a request's images
travel to the core as plain data (`ImageInput`: pixel bytes, shape, hash, span).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import zmq

from deepinfer.engine import loader
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.core_proc import run_engine_core
from deepinfer.engine.core_wire import (INPUT_ENCODER, OUTPUT_DECODER, AddRequest,
                                        CoreEndpoints, EngineInput, EngineOutputs,
                                        error_from_wire)
from deepinfer.engine.errors import (EngineDeadError, EngineShuttingDownError, QueueFullError,
                                     RequestFailedError)
from deepinfer.engine.mm_processor import adopt_chat_template, load_mm_processor
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.outputs import EngineCoreOutput, RequestOutput, SchedulerStats
from deepinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

READER_POLL_MS = 200       # how often the reader checks that the core process is alive
# a send to the core gives up after this long: a PUSH socket whose core died has no peer and
# would block for ever (with SNDHWM 0 a live core never blocks a send)
SEND_TIMEOUT_MS = 2000
DEFAULT_STARTUP_TIMEOUT_S = 3600.0


def _compile_id(ticket: int) -> str:
    return f"#compile-{ticket}"


class MPAsyncLLM:
    """Args:
        config: the engine configuration.
        model_factory: a picklable callable that builds the model inside the core process
            (benchmarks: random weights); None loads `config.model.model`.
        startup_timeout_s: how long to wait for the core to load the model.
    Building it starts the core process and waits until it has loaded the model.

    Raises:
        ValueError: the core could not start (no model, unsupported architecture, bad
            setting); the message carries the core's error.
    """

    def __init__(self, config: EngineConfig, model_factory: Callable | None = None, *,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 endpoints: CoreEndpoints | None = None, client_index: int = 0):
        config = core_config(config)
        model_dir = Path(config.model.model)
        self.config = config
        self.max_in_flight = (config.scheduler.max_num_seqs
                              + config.scheduler.max_waiting_requests)
        # own core (endpoints None): a private directory and one client; else API server
        # `client_index` of a core that server/api_servers.py started
        self._owns_core = endpoints is None
        if endpoints is None:
            endpoints = CoreEndpoints(tempfile.mkdtemp(prefix="deepinfer-core-"))
        self._endpoints, self.client_index = endpoints, client_index
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(endpoints.input_address(client_index))
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(endpoints.output_address(client_index))
        self._proc = (start_core_process(config, endpoints, model_factory) if self._owns_core
                      else None)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()       # _streams, _compiles, _processor
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._compiles: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tickets = itertools.count()
        self._error: EngineDeadError | None = None
        self._closed = False
        atexit.register(self.shutdown)   # runs before multiprocessing joins its children
        try:
            self.tokenizer = loader.load_tokenizer(model_dir)
            # a vision-language model's processor, here where prompts are built (None: text)
            self.mm_processor = load_mm_processor(model_dir, loader.load_hf_config(model_dir),
                                                  config.multimodal)
            adopt_chat_template(self.tokenizer, self.mm_processor)
            first = self._wait_ready(startup_timeout_s)
        except BaseException:
            self._closed = True
            atexit.unregister(self.shutdown)
            self._stop_process(5)   # a core that failed to start stops its rank workers
            self._close_sockets()
            raise
        ready = first.ready
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self._stats = first.stats or SchedulerStats()
        self._processor = OutputProcessor(self.tokenizer)
        self._reader = threading.Thread(target=self._read_loop, name="deepinfer-core-reader",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> EngineOutputs:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._output.poll(READER_POLL_MS):
                message = OUTPUT_DECODER.decode(self._output.recv())
                if message.ready is not None:
                    return message
                raise ValueError(f"the engine core could not start: {message.dead}")
            if not self._core_alive():
                raise ValueError("the engine core process exited while starting ("
                                 f"{self._core_exit()}); the log above says why.")
        raise ValueError(f"the engine core did not start within {timeout_s:g} s.")

    # ---- caller side (any event loop) -----------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None, *,
                       kv_transfer_params: dict | None = None,
                       mm_inputs: list | None = None) -> AsyncIterator[RequestOutput]:
        """As `AsyncLLM.generate`; a refusal by the core (queue full, prompt too long, bad
        values) is raised at the first output instead of at the call. `mm_inputs`: the
        prompt's images (`engine.multimodal.ImageInput`, placed), sent to the core as data."""
        self.check_health()
        if mm_inputs and self.mm_processor is None:
            raise ValueError(f"{self.model_name} is a text-only model and accepts no images; "
                             "send text only, or serve a vision-language model.")
        if sampling_params.so_args is not None:
            await self.compile_grammar(sampling_params.so_args)
        request_id = request_id or uuid.uuid4().hex
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if len(self._streams) >= self.max_in_flight:
                raise QueueFullError(
                    f"{len(self._streams)} requests are in flight (max_num_seqs + "
                    f"max_waiting_requests = {self.max_in_flight}); retry later.")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use.")
            self._processor.add_request(request_id, list(prompt_token_ids), sampling_params,
                                        time.monotonic())
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        try:
            self._send(EngineInput(adds=[AddRequest(request_id, list(prompt_token_ids),
                                                    sampling_params, kv_transfer_params,
                                                    list(mm_inputs) if mm_inputs else None)]))
        except EngineDeadError:
            with self._lock:
                self._streams.pop(request_id, None)
                self._processor.abort_request(request_id)
            raise
        finished, pending = False, None
        try:
            while not finished:
                item = pending if pending is not None else await stream.get()
                pending = None
                if isinstance(item, BaseException):
                    raise item
                # the consumer lags (several steps queued): one output of them all, as vLLM's
                # RequestOutputCollector, so a slow event loop writes fewer, larger chunks
                while not item.finished and not stream.empty():
                    later = stream.get_nowait()
                    if isinstance(later, BaseException):
                        pending = later
                        break
                    item = coalesce(item, later)
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                self._processor.abort_request(request_id)
            if not finished and self._error is None:
                self._send_quietly(EngineInput(aborts=[request_id]))

    async def compile_grammar(self, so_args: dict) -> None:
        """Compile a structured-output constraint in the core process's grammar threads
        (then cached there, so the request's own compile is a lookup).

        Raises:
            GrammarError (a ValueError): the constraint is invalid.
            EngineDeadError: the core is gone.
        """
        self.check_health()
        ticket = next(self._tickets)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._compiles[ticket] = (loop, future)
        try:
            self._send(EngineInput(compiles=[(ticket, so_args)]))
            await future
        finally:
            with self._lock:
                self._compiles.pop(ticket, None)

    async def abort(self, request_id: str) -> None:
        self._send_quietly(EngineInput(aborts=[request_id]))

    def abort_all(self, reason: str) -> int:
        """As `AsyncLLM.abort_all`. Thread-safe."""
        with self._lock:
            targets = list(self._streams.items())
        error = EngineShuttingDownError(reason)
        for _, (loop, stream) in targets:
            _call(loop, stream.put_nowait, error)
        if targets:
            self._send_quietly(EngineInput(aborts=[request_id for request_id, _ in targets]))
        return len(targets)

    def get_stats(self) -> SchedulerStats:
        return self._stats

    def check_health(self) -> None:
        if self._error is not None:
            raise self._error
        if not self._core_alive():
            raise EngineDeadError(f"the engine core process exited ({self._core_exit()})"
                                  "; restart the server.")

    def _core_alive(self) -> bool:
        if self._proc is not None:
            return self._proc.is_alive()
        try:   # a core this process did not start: its parent reaps it when it exits
            os.kill(self._endpoints.core_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def _core_exit(self) -> str:
        return (f"code {self._proc.exitcode}" if self._proc is not None
                else f"pid {self._endpoints.core_pid}")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (it stops its rank workers) and wait for it; kill it after
        `timeout_s`. Idempotent; also run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._stop_process(timeout_s)
        self._reader.join(timeout_s)
        self._close_sockets()

    def _stop_process(self, timeout_s: float) -> None:
        if self._proc is None:   # another's core: say this API server is done; it stops
            if self._core_alive():   # once every API server has
                self._send_quietly(EngineInput(shutdown=True))
            return
        if self._proc.is_alive():
            self._send_quietly(EngineInput(shutdown=True))
            self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _close_sockets(self) -> None:
        with self._send_lock:   # another's core: let our `shutdown` reach it
            self._input.close(linger=0 if self._owns_core else 2000)
        self._output.close(linger=0)
        self._context.term()
        if self._owns_core:
            shutil.rmtree(self._endpoints.ipc_dir, ignore_errors=True)

    def _send(self, message: EngineInput) -> None:
        """Send to the core.

        Raises:
            EngineDeadError: the core took nothing for SEND_TIMEOUT_MS (it is gone).
        """
        message.client_index = self.client_index
        data = INPUT_ENCODER.encode(message)
        with self._send_lock:
            if not self._input.closed:
                try:
                    self._input.send(data, copy=False)
                except zmq.Again:
                    raise EngineDeadError(f"the engine core stopped taking requests "
                                          f"({self._core_exit()}); restart the "
                                          "server.") from None

    def _send_quietly(self, message: EngineInput) -> None:
        """`_send` for what a gone core need not hear (aborts, goodbyes)."""
        try:
            self._send(message)
        except (EngineDeadError, zmq.ZMQError):
            pass

    # ---- reader thread --------------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while not self._closed:
                if not self._output.poll(READER_POLL_MS):
                    if not self._core_alive() and not self._closed:
                        self._die(f"the engine core process exited ({self._core_exit()}); "
                                  "restart the server.")
                        return
                    continue
                message = OUTPUT_DECODER.decode(self._output.recv(copy=False).buffer)
                self._handle(message)
                if message.dead is not None:
                    self._die(f"the engine core stopped: {message.dead}")
                    return
        except Exception as error:  # noqa: BLE001 - no request may hang on a dead reader
            if not self._closed:
                logger.exception("engine core reader died")
                self._die(f"the engine core reader failed: {error!r}")

    def _handle(self, message: EngineOutputs) -> None:
        """One step's message: detokenize, then hand each event loop its outputs at once."""
        if message.stats is not None:
            self._stats = message.stats
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            outputs, stopped = self._processor.process(
                [EngineCoreOutput(o.request_id, o.new_token_ids, o.new_logprobs,
                                  o.finish_reason, o.stop_reason, o.num_cached_tokens)
                 for o in message.outputs], time.monotonic())
            extras = {o.request_id: o for o in message.outputs
                      if o.kv_transfer_params is not None or o.error is not None}
            for out in outputs:
                wire = extras.get(out.request_id)
                if wire is not None:
                    out.kv_transfer_params, out.error = wire.kv_transfer_params, wire.error
                item = RequestFailedError(out.error) if out.finish_reason == "error" else out
                self._target(deliveries, out.request_id, item)
            for error in message.errors:
                if error.request_id.startswith("#compile-"):
                    self._resolve_compile(int(error.request_id[9:]), error_from_wire(error))
                else:
                    self._processor.abort_request(error.request_id)
                    self._target(deliveries, error.request_id, error_from_wire(error))
            for ticket in message.compiled:
                self._resolve_compile(ticket, None)
        if stopped:   # a stop string ended them here: the core still runs them
            self._send_quietly(EngineInput(aborts=stopped))
        for loop, items in deliveries.items():
            _call(loop, _put_all, items)

    def _target(self, deliveries: dict, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            deliveries.setdefault(target[0], []).append((target[1], item))

    def _resolve_compile(self, ticket: int, error: BaseException | None) -> None:
        target = self._compiles.get(ticket)
        if target is not None:
            _call(target[0], _settle, target[1], error)

    def _die(self, reason: str) -> None:
        logger.error("%s", reason)
        self._error = EngineDeadError(reason)
        with self._lock:
            streams = list(self._streams.values())
            compiles = list(self._compiles.values())
        for loop, stream in streams:
            _call(loop, stream.put_nowait, self._error)
        for loop, future in compiles:
            _call(loop, _settle, future, self._error)


def core_config(config: EngineConfig) -> EngineConfig:
    """`config` with the model resolved to a directory the core loads (a GGUF converted once,
    here) and its served name fixed, so that every API server reports the same name."""
    from deepinfer.engine.engine_core import served_model_name

    model_dir = loader.resolve_model_dir(config.model.model, config.model.cache_dir)
    return config.replace(model={"model": str(model_dir),
                                 "served_model_name": served_model_name(config.model)})


def start_core_process(config: EngineConfig, endpoints: CoreEndpoints,
                       model_factory: Callable | None = None) -> multiprocessing.Process:
    """Spawn the engine core (engine/core_proc.py) for the API servers of `endpoints`; it
    loads the model and then says `ready` to each. Non-daemonic: see the module docstring."""
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, name="deepinfer-engine-core", daemon=False,
        args=(config, endpoints, model_factory))
    process.start()
    return process


def coalesce(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the deltas joined, the rest the later's."""
    logprobs = None
    if earlier.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = (earlier.new_logprobs or []) + (later.new_logprobs or [])
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
                               new_text=earlier.new_text + later.new_text,
                               new_logprobs=logprobs)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """`loop.call_soon_threadsafe`, ignoring a loop that has closed (its requests are gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _put_all(items: list) -> None:
    for stream, item in items:
        stream.put_nowait(item)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
