"""The engine core process: `EngineCore` + executor behind two ZeroMQ sockets.

Started by `MPAsyncLLM` (engine/core_client.py) with multiprocessing's spawn method. Its loop,
the single owner of the scheduler and block state as `AsyncLLM`'s step-loop thread is in one
process: take every waiting `EngineInput` (adds, aborts, grammar compiles; blocking only when no
request is unfinished), run one `EngineCore.step()`, send each API server one `EngineOutputs`
with the new tokens of that step of every request it sent (engine/core_wire.py; one API server
by default, several with `--api-server-count`, server/api_servers.py). Text never crosses: the core runs
with `detokenize=False` and the API server detokenizes. The design follows vLLM v1's
EngineCoreProc (busy loop, one output message per step, msgpack) and SGLang's scheduler /
detokenizer split; the code is our own.

Failure: an exception out of the loop (e.g. `EngineDeadError` after failed steps in a row) is
sent as `EngineOutputs.dead`, then the process exits 1; a process killed outright is noticed by
the API server's reader (process sentinel). SIGINT/SIGTERM are ignored here: the API servers
drain first and then each sends `shutdown` (the core stops once all have); when its parent
process dies, the core exits within a step, so an orphan never holds the device.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import zmq

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.core_wire import (INPUT_DECODER, OUTPUT_ENCODER, CoreEndpoints,
                                        EngineOutputs, EngineReady, WireOutput, error_to_wire)
from deepinfer.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500      # blocking wait for input when no request is unfinished
COMPILE_POLL_MS = 5     # ... while grammars compile in the pool
STATS_EVERY_S = 0.25    # stats ride on every output message; alone at most this often


def run_engine_core(config: EngineConfig, endpoints: CoreEndpoints,
                    model_factory: Callable | None = None) -> None:
    """The engine core process's entry point (a module-level function: spawn pickles it).

    Args:
        config: the engine configuration.
        endpoints: the ZeroMQ endpoints of its API servers (each binds its own PUSH input
            and PULL output; this process connects to all).
        model_factory: builds the model in this process (benchmarks: random weights); None
            loads it from `config.model.model`.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    outputs = []
    for client in range(endpoints.num_clients):
        inputs.connect(endpoints.input_address(client))
        output = context.socket(zmq.PUSH)
        output.setsockopt(zmq.LINGER, 2000)
        output.setsockopt(zmq.SNDHWM, 0)   # never block a step on a slow reader (no drops)
        output.connect(endpoints.output_address(client))
        outputs.append(output)
    try:
        from deepinfer.engine.engine_core import EngineCore

        core = EngineCore(config, model_factory() if model_factory else None,
                          detokenize=False)
        gc.collect()   # as async_llm.freeze_startup_heap (not imported: no import cycle)
        gc.freeze()
    except BaseException as error:  # noqa: BLE001 - reported to the API servers, which raise
        logger.exception("engine core failed to start")
        _broadcast(outputs, EngineOutputs(dead=f"{type(error).__name__}: {error}"))
        for output in outputs:
            output.close()
        context.term()
        raise SystemExit(1) from None
    _broadcast(outputs, EngineOutputs(ready=EngineReady(
        core.model_name, core.max_model_len, core.vocab_size), stats=core.get_stats()))
    try:
        _CoreLoop(core, inputs, outputs).run()
    except BaseException as error:  # noqa: BLE001 - the API servers fail every request
        logger.exception("engine core loop died")
        _broadcast(outputs, EngineOutputs(dead=repr(error)))
        raise SystemExit(1) from None
    finally:
        core.close()
        for output in outputs:
            output.close()
        inputs.close(linger=0)
        context.term()


def _broadcast(outputs: list[zmq.Socket], message: EngineOutputs) -> None:
    data = OUTPUT_ENCODER.encode(message)
    for output in outputs:
        output.send(data)


class _CoreLoop:
    """Outputs go back to the API server that added the request (`owner`); each API server
    gets at most one message per step, with its requests' outputs and the stats."""

    def __init__(self, core, inputs: zmq.Socket, outputs: list[zmq.Socket]) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.parent = os.getppid()
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deepinfer-grammar")
        self.compiling = 0
        self.compiled: queue.SimpleQueue = queue.SimpleQueue()   # (ticket, error or None)
        self.pending = [EngineOutputs() for _ in outputs]   # per API server
        self.owner: dict[str, int] = {}    # request id -> index of the API server that sent it
        self.done_clients: set[int] = set()  # API servers that sent `shutdown`
        self.stopping = False
        self.last_stats = 0.0

    def run(self) -> None:
        core = self.core
        while not self.stopping:
            busy = core.has_unfinished_requests()
            timeout = 0 if busy else COMPILE_POLL_MS if self.compiling else IDLE_POLL_MS
            if self.poller.poll(timeout):
                self._take_inputs()
            if os.getppid() != self.parent:    # a cheap syscall; an orphan frees the device
                logger.error("the API server process is gone; stopping the engine core")
                return
            self._take_compiled()
            if self.stopping:
                break
            owner, pending = self.owner, self.pending
            for output in core.step():
                client = (owner.pop(output.request_id, 0) if output.finished
                          else owner.get(output.request_id, 0))
                pending[client].outputs.append(_to_wire(output))
            self._send()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _take_inputs(self) -> None:
        core = self.core
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = INPUT_DECODER.decode(frame.buffer)
            client = message.client_index
            for add in message.adds:
                try:
                    core.add_request(core.make_request(
                        add.prompt_token_ids, add.params, add.request_id,
                        kv_transfer_params=add.kv_transfer_params, mm_inputs=add.mm_inputs))
                    self.owner[add.request_id] = client
                except Exception as error:  # noqa: BLE001 - refused alone: full, too long
                    self.pending[client].errors.append(error_to_wire(add.request_id, error))
            if message.aborts:
                core.abort_requests(message.aborts)
                for request_id in message.aborts:
                    self.owner.pop(request_id, None)
            for ticket, so_args in message.compiles:
                self.compiling += 1
                self.pool.submit(self._compile, client, ticket, so_args)
            if message.shutdown:
                self.done_clients.add(client)
                self.stopping = len(self.done_clients) == len(self.outputs)

    def _compile(self, client: int, ticket: int, so_args: dict) -> None:
        try:
            self.core.structured_output.compile(so_args)
            self.compiled.put((client, ticket, None))
        except Exception as error:  # noqa: BLE001 - the API server raises it
            self.compiled.put((client, ticket, error))

    def _take_compiled(self) -> None:
        while self.compiling:
            try:
                client, ticket, error = self.compiled.get_nowait()
            except queue.Empty:
                return
            self.compiling -= 1
            if error is None:
                self.pending[client].compiled.append(ticket)
            else:
                self.pending[client].errors.append(error_to_wire(f"#compile-{ticket}", error))

    def _send(self) -> None:
        """Each API server's message of this step (stats ride on each; alone at most every
        STATS_EVERY_S, to every API server)."""
        now = time.monotonic()
        stats_due = now - self.last_stats >= STATS_EVERY_S
        stats = None
        for client, pending in enumerate(self.pending):
            if not (pending.outputs or pending.errors or pending.compiled or stats_due):
                continue
            if stats is None:
                stats = self.core.get_stats()
                self.last_stats = now
            pending.stats = stats
            self.outputs[client].send(OUTPUT_ENCODER.encode(pending), copy=False)
            self.pending[client] = EngineOutputs()


def _to_wire(output: RequestOutput) -> WireOutput:
    return WireOutput(output.request_id, output.new_token_ids, output.new_logprobs,
                      output.finish_reason, output.stop_reason, output.num_cached_tokens,
                      output.kv_transfer_params, output.error)
