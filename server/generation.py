"""Running one API request as n engine requests and merging their output streams.

An API request with `n` choices (and, for completions, several prompts) becomes one engine
request per choice, id `{request_id}-{choice_index}`. Each runs in its own pump task that records
its metrics and puts its outputs on one queue; `merged_outputs` yields `(choice_index, output)`
as they come. Closing the merged stream (client disconnect, error, early exit) cancels the pump
tasks, and a cancelled `AsyncLLM.generate` aborts its engine request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from deepinfer.engine.outputs import RequestOutput, TokenLogprobs
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.server.errors import APIError, as_api_error, from_engine_error
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import PromptTokensDetails, Usage
from deepinfer.server.sse import DONE, HEADERS, MEDIA_TYPE, sse_error

logger = logging.getLogger("deepinfer.server")
T = TypeVar("T")
_END = object()


@dataclass
class SubRequest:
    """One engine request: choice `index` of the API request."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: dict | None = None  # prefill/decode disaggregation (see the engine)
    mm_inputs: list | None = None           # the prompt's images (engine.multimodal)


@dataclass
class ChoiceState:
    """What one choice has produced so far (the non-stream body and usage read it)."""

    index: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict | None = None  # what a prefill stored, on the last output

    def update(self, out: RequestOutput) -> None:
        self.num_prompt_tokens = len(out.prompt_token_ids)
        self.num_cached_tokens = max(out.num_cached_tokens, 0)
        self.num_output_tokens = out.num_output_tokens
        if out.new_text:
            self.text_parts.append(out.new_text)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.kv_transfer_params = out.kv_transfer_params

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage(choices: list[ChoiceState], n: int) -> Usage:
    """Token counts: each prompt once (choices i*n .. i*n+n-1 share prompt i), every output."""
    firsts = [c for c in choices if c.index % n == 0]
    prompt = sum(c.num_prompt_tokens for c in firsts)
    completion = sum(c.num_output_tokens for c in choices)
    cached = min(sum(c.num_cached_tokens for c in firsts), prompt)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """Turn the engine's request errors (queue full, too long, bad values) into API errors."""
    try:
        yield
    except APIError:
        raise
    except Exception as exc:
        err = from_engine_error(exc)
        if err is None:
            raise
        raise err from exc


def _prompt_cached_tokens(kv_transfer_params: dict | None) -> int | None:
    """In disaggregated mode the decode worker's cache hits include the prefill's hand-off;
    what the client's prompt really hit is what the prefill found cached, which the router
    passes as `kv_transfer_params.prompt_cached_tokens` (None when absent)."""
    value = (kv_transfer_params or {}).get("prompt_cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def _generate(engine: Any, request_id: str, sub: SubRequest) -> AsyncIterator[RequestOutput]:
    """The engine's stream of one sub-request (its images, if any, go along)."""
    images = {"mm_inputs": sub.mm_inputs} if sub.mm_inputs else {}
    return engine.generate(sub.prompt_token_ids, sub.params, f"{request_id}-{sub.index}",
                           kv_transfer_params=sub.kv_transfer_params, **images)


async def merged_outputs(engine: Any, metrics: ServerMetrics, request_id: str,
                         subs: list[SubRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield `(choice_index, output)` from all sub-requests until each has finished.

    An error in any sub-request is raised here (and the others are cancelled). Use inside
    `contextlib.aclosing` so an early exit cancels the pumps at once.
    """
    if len(subs) == 1:   # the common case: no pump task, no second queue hop per token
        async for item in _single_outputs(engine, metrics, request_id, subs[0]):
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(sub: SubRequest) -> None:
        tracker, failed = metrics.tracker(), False
        client_hit = _prompt_cached_tokens(sub.kv_transfer_params)
        try:
            stream = _generate(engine, request_id, sub)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    tracker.observe(out)
                    if client_hit is not None and out.num_cached_tokens > client_hit:
                        out = dataclasses.replace(out, num_cached_tokens=client_hit)
                    queue.put_nowait((sub.index, out))
        except Exception as exc:  # handed to the consumer, which maps or logs it
            failed = True
            queue.put_nowait((sub.index, exc))
        finally:   # cancelled (client gone, another choice failed): counted as an abort
            tracker.close(count_unstarted=not failed)
            queue.put_nowait((sub.index, _END))

    tasks = [asyncio.create_task(pump(sub)) for sub in subs]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _single_outputs(engine: Any, metrics: ServerMetrics, request_id: str,
                          sub: SubRequest) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`merged_outputs` of one sub-request, inline: the same metrics and errors as a pump."""
    tracker, failed = metrics.tracker(), False
    client_hit = _prompt_cached_tokens(sub.kv_transfer_params)
    try:
        stream = _generate(engine, request_id, sub)
        async with contextlib.aclosing(stream):
            async for out in stream:
                tracker.observe(out)
                if client_hit is not None and out.num_cached_tokens > client_hit:
                    out = dataclasses.replace(out, num_cached_tokens=client_hit)
                yield sub.index, out
    except Exception:
        failed = True
        raise
    finally:   # closed early (client gone): counted as an abort
        tracker.close(count_unstarted=not failed)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work` (a non-stream generation, or a stream's start), cancelling it if the client
    goes away first.

    Returns None when the client disconnected; cancelling `work` aborts its engine requests.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        logger.info("client disconnected; aborting its request")
        return None
    finally:
        watch_task.cancel()
        work_task.cancel()


async def collect(engine: Any, metrics: ServerMetrics, request_id: str,
                  subs: list[SubRequest]) -> list[ChoiceState]:
    """Run all sub-requests to the end; the choices in index order."""
    states = {sub.index: ChoiceState(sub.index) for sub in subs}
    with engine_errors():
        async with contextlib.aclosing(merged_outputs(engine, metrics, request_id,
                                                      subs)) as outputs:
            async for index, out in outputs:
                states[index].update(out)
    return [states[i] for i in sorted(states)]


async def start_stream(engine: Any, metrics: ServerMetrics, request_id: str,
                       subs: list[SubRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Start the sub-requests and wait for the first output, so that a refused request (queue
    full, prompt too long) is still an HTTP error status rather than an error event in a 200."""
    outputs = merged_outputs(engine, metrics, request_id, subs)
    try:
        with engine_errors():
            first = await anext(outputs)
    except BaseException:
        await outputs.aclose()
        raise
    return _prepend(first, outputs)


async def _prepend(first: tuple[int, RequestOutput],
                   outputs: AsyncIterator[tuple[int, RequestOutput]]
                   ) -> AsyncIterator[tuple[int, RequestOutput]]:
    async with contextlib.aclosing(outputs):
        yield first
        async for item in outputs:
            yield item


async def sse_body(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The stream's events, an error event if generation fails midway, then `data: [DONE]`.

    A client disconnect cancels this generator (no [DONE]); closing `events` aborts the engine
    requests.
    """
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except Exception as exc:
            yield sse_error(as_api_error(exc))
    yield DONE


async def respond(raw: Request, engine: Any, metrics: ServerMetrics, request_id: str,
                  subs: list[SubRequest], stream: bool,
                  events: Callable[[AsyncIterator[tuple[int, RequestOutput]]],
                                   AsyncIterator[bytes]],
                  body: Callable[[list[ChoiceState]], Any],
                  choices_param: str = "n") -> Response:
    """Run the sub-requests and answer: SSE built by `events`, or the JSON model `body` makes
    from the finished choices. 499 when the client left before the end (non-stream) or before
    the first output (stream: while queued or prefilling); its engine requests are aborted.
    A request of more choices than the engine ever holds at once is a 400 (a 429's retry could
    never succeed) naming `choices_param`, the field to shrink ("prompt" for a prompt list)."""
    if len(subs) > engine.max_in_flight:
        raise APIError(f"this request makes {len(subs)} choices (n times prompts), more than the "
                       f"{engine.max_in_flight} requests this server holds at once (max_num_seqs "
                       "+ max_waiting_requests); split it into smaller requests.",
                       param=choices_param, code="invalid_value")
    if stream:
        outputs = await unless_disconnected(raw, start_stream(engine, metrics, request_id,
                                                               subs))
        if outputs is None:
            return Response(status_code=499)
        return StreamingResponse(sse_body(events(outputs)), media_type=MEDIA_TYPE,
                                 headers=HEADERS)
    states = await unless_disconnected(raw, collect(engine, metrics, request_id, subs))
    if states is None:
        return Response(status_code=499)
    return Response(body(states).model_dump_json(), media_type="application/json")
