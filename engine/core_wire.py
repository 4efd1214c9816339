"""The messages between the API server process and the engine core process (msgspec msgpack).

API server -> engine core: one `EngineInput` per send (requests to add, ids to abort, grammars
to compile, shutdown), tagged with the sending API server's index. Engine core -> API server:
one `EngineOutputs` per step per API server that has anything of that step (its own requests'
outputs only; the stats go to every one) (every request's new token ids, finish reasons, logprobs, hand-off answers together),
plus the scheduler's stats, replies to compiles and per-request errors. Text is not sent: the
API server detokenizes (engine/core_client.py), off the engine's critical path. The first
message of the engine core carries an `EngineReady` (or a `dead` that says why it could not
start).

Encoding: msgspec structs as msgpack arrays (`array_like`: no field names on the wire); the
dataclasses `SamplingParams`, `TokenLogprobs`, `SchedulerStats` (with its `kv_store`,
`mm_encoder` and data-parallel `per_rank` parts) and `ImageInput` (a request's images: pixel
bytes, shape, content hash, placeholder span) are encoded by msgspec as they are. Errors
cross as (kind, message, param) and are rebuilt as the engine's own exception classes, so the
server maps them to the same HTTP statuses as in one process.

Pure module: no torch import.
"""

from __future__ import annotations

import msgspec

from deepinfer.engine.errors import PromptTooLongError, QueueFullError
from deepinfer.engine.multimodal import ImageInput
from deepinfer.engine.outputs import SchedulerStats, TokenLogprobs
from deepinfer.engine.sampling_params import SamplingParams, SamplingParamsError
from deepinfer.engine.structured.backend import GrammarError


class AddRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: dict | None = None
    # the prompt's images, placed (pixel bytes, shape, hash, span): plain data, no pickle
    mm_inputs: list[ImageInput] | None = None


class EngineInput(msgspec.Struct, array_like=True, gc=False):
    adds: list[AddRequest] = []
    aborts: list[str] = []
    compiles: list[tuple[int, dict]] = []     # (ticket, so_args): reply in `compiled`
    shutdown: bool = False                    # this client is done (the core stops when all are)
    client_index: int = 0                     # the sending API server: its outputs go back there


class WireOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's tokens of one step (an `EngineCoreOutput` plus what the core adds)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None   # a hand-off's answer (last output only)
    error: str | None = None                 # finish_reason "error": what failed


class WireError(msgspec.Struct, array_like=True, gc=False):
    """A request refused by the engine core (`kind`: see `ERROR_KINDS`) or a compile that
    failed (request_id = "#compile-{ticket}")."""

    request_id: str
    kind: str
    message: str
    param: str | None = None


class EngineReady(msgspec.Struct, array_like=True, gc=False):
    model_name: str
    max_model_len: int
    vocab_size: int


class EngineOutputs(msgspec.Struct, array_like=True, gc=False):
    outputs: list[WireOutput] = []
    errors: list[WireError] = []
    compiled: list[int] = []                 # tickets whose grammar compiled
    stats: SchedulerStats | None = None
    dead: str | None = None                  # the engine core stopped: why
    ready: EngineReady | None = None         # the first message after a good start


# exception class -> wire kind; the first matching class wins (subclasses first)
ERROR_KINDS: list[tuple[type[BaseException], str]] = [
    (QueueFullError, "queue_full"), (PromptTooLongError, "prompt_too_long"),
    (SamplingParamsError, "sampling_params"), (GrammarError, "grammar"), (ValueError, "value")]


def error_to_wire(request_id: str, error: BaseException) -> WireError:
    kind = next((name for cls, name in ERROR_KINDS if isinstance(error, cls)), "value")
    return WireError(request_id, kind, str(error), getattr(error, "param", None))


def error_from_wire(error: WireError) -> Exception:
    """The engine's exception that `error` stands for (same class, message, param)."""
    if error.kind == "queue_full":
        return QueueFullError(error.message)
    if error.kind == "prompt_too_long":
        return PromptTooLongError(error.message)
    if error.kind == "sampling_params":
        return SamplingParamsError(error.message, error.param or "")
    if error.kind == "grammar":
        return GrammarError(error.message)
    return ValueError(error.message)


class CoreEndpoints(msgspec.Struct, frozen=True):
    """Where the engine core meets its `num_clients` API servers: client i binds
    `input_address(i)` (PUSH) and `output_address(i)` (PULL) under `ipc_dir`; the core
    connects to all of them (one PULL fair-queued over the inputs, one PUSH per output), so
    either side may start first. `core_pid`: the core process, for an API server that did not
    start it (its liveness check); 0 while unknown."""

    ipc_dir: str
    num_clients: int = 1
    core_pid: int = 0

    def input_address(self, client_index: int) -> str:
        return f"ipc://{self.ipc_dir}/input-{client_index}"

    def output_address(self, client_index: int) -> str:
        return f"ipc://{self.ipc_dir}/output-{client_index}"


INPUT_ENCODER = msgspec.msgpack.Encoder()
INPUT_DECODER = msgspec.msgpack.Decoder(EngineInput)
OUTPUT_ENCODER = msgspec.msgpack.Encoder()
OUTPUT_DECODER = msgspec.msgpack.Decoder(EngineOutputs)
