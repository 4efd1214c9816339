"""The proxy: pick a replica, forward the client's request, relay the answer byte for byte.

Rules (STYLE.md #9; the worker endpoints used are listed in README.md):
- The request body goes to the worker unchanged (parsed only to compute the policy's features),
  and the worker's answer comes back unchanged: status, content type, JSON or SSE bytes. A
  worker's 4xx is the client's 4xx. SSE is relayed as it comes; a JSON answer (complete when
  its header arrives: workers answer non-streamed requests at the end) in one piece.
- Retry only before the first byte: when connecting or sending fails, or the connection drops
  before the answer's status line, the request moves to another replica (`max_attempts` in
  all). Once a worker has begun answering it is never re-sent, so nothing is generated twice; a
  worker lost mid-answer ends the stream with an error event (SSE) or answers 502 (JSON).
- A client that disconnects closes the worker's connection, so the worker aborts the request and
  frees its KV blocks (while waiting for the answer's header and while relaying it).
- Edge cap: more than `max_concurrent_requests` client requests in flight -> 429 at once.
- Disaggregated mode (DESIGN.md "Prefill / decode disaggregation"): the request first goes to a
  prefill worker with `kv_transfer_params: {"do_remote_decode": true}`, `max_tokens: 1`,
  `stream: false`; its answer's `kv_transfer_params` then go with the client's original request
  to a decode worker, whose answer the client gets. If the prefill step fails in any way, the
  decode worker gets the plain request and recomputes the prompt: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from deepinfer.router.config import RouterConfig
from deepinfer.router.errors import error_response, sse_error_event
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.policies import RequestFeatures, make_policy, request_features
from deepinfer.router.registry import Registry, Replica

logger = logging.getLogger("deepinfer.router")

SHUTTING_DOWN = ("The router is shutting down and stopped relaying this request (its "
                 "--graceful-shutdown-s ran out); retry it, another router will take it.")
SSE_DONE = b"data: [DONE]\n\n"
# failures that happen before any byte of the answer: safe to send the request elsewhere
RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                    httpx.ReadError, httpx.WriteError)
UNREACHABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# request headers not forwarded (hop-by-hop, or recomputed by httpx)
_DROP_REQUEST = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                 "te", "trailer", "upgrade", "proxy-authorization"}
# answer headers not relayed (hop-by-hop, or recomputed by the router's own server)
_DROP_RESPONSE = {"content-length", "connection", "keep-alive", "transfer-encoding", "date",
                  "server", "trailer", "upgrade"}
# fields of the client's body the prefill step replaces or drops
_PREFILL_DROP = ("stream_options", "max_completion_tokens", "min_tokens", "best_of")

# how often a request waiting for its worker's answer checks that the health checks did not
# eject the worker meanwhile (a stopped worker would hold it for --request-timeout-s)
EJECTION_POLL_S = 0.25
# deeper client JSON is forwarded unparsed (no policy features, no prefill step)
MAX_JSON_DEPTH = 128

T = TypeVar("T")


class ReplicaEjected(Exception):
    """The replica was ejected while the request waited for its answer to begin."""


class NoReplicaError(Exception):
    """No replica could take the request; `reason` is no_replica or unreachable."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def relayed_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}


def _nesting_depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value` (iterative: no recursion to overflow)."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            depth = max(depth, level)
            stack.extend((child, level + 1)
                         for child in (item.values() if isinstance(item, dict) else item))
    return depth


def parse_body(body: bytes) -> Any:
    """The client's JSON body, or None when it does not parse or nests deeper than
    `MAX_JSON_DEPTH` (the router re-encodes and hashes bodies recursively; Python's json
    raises RecursionError around 1000 levels). A None body is forwarded as is."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return payload if _nesting_depth(payload) <= MAX_JSON_DEPTH else None


def body_problem(body: bytes, payload: Any) -> tuple[str, str] | None:
    """(message, code) when the router answers 400 itself, with the workers' codes:
    `invalid_json` for an empty or unparsable body or one nested deeper than `MAX_JSON_DEPTH`
    (forwarded unparsed, its `kv_transfer_params` would reach a decode worker unchecked),
    `invalid_type` for JSON that is not an object. None for a JSON object within the depth."""
    if isinstance(payload, dict):
        return None
    if payload is None:
        if not body.strip():
            return ("The request has no body; send a JSON object with Content-Type: "
                    "application/json.", "invalid_json")
        try:
            payload = json.loads(body)
        except RecursionError:
            return _too_deep()
        except ValueError as exc:
            return (f"The request body is not valid JSON ({_json_reason(exc)}); send a JSON "
                    "object with Content-Type: application/json.", "invalid_json")
        if isinstance(payload, dict):
            return _too_deep()
    kind = {type(None): "null", list: "array", str: "string", bool: "boolean"}.get(
        type(payload), "number")
    return (f"The request body is JSON {kind}; send a JSON object "
            '(e.g. {"model": ..., "messages": [...]}).', "invalid_type")


def _too_deep() -> tuple[str, str]:
    return (f"The request body nests lists and objects deeper than {MAX_JSON_DEPTH} levels; "
            "send a flatter JSON object.", "invalid_json")


def _json_reason(exc: ValueError) -> str:
    """The JSON error, without Python's advice (an integer past the 4,300-digit limit)."""
    text = str(exc)
    if "integer string conversion" in text:
        return "an integer has more than 4,300 digits"
    return text


class UpstreamResponse(StreamingResponse):
    """A worker's SSE stream relayed byte for byte. Whatever ends it (the last byte, the client
    leaving, the worker dying), the worker's connection is closed and `on_close` runs once."""

    def __init__(self, upstream: httpx.Response, on_close: Callable[[], None],
                 drain_over: asyncio.Event, stall_timeout_s: float) -> None:
        self._upstream = upstream
        self._on_close = on_close
        self._drain_over = drain_over
        self._stall_timeout_s = stall_timeout_s
        super().__init__(self._relay(), status_code=upstream.status_code,
                         headers=relayed_headers(upstream))

    async def _relay(self):
        chunks = self._upstream.aiter_raw()
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(chunks), self._stall_timeout_s)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:   # a hung worker: tell the client, do not wait
                    logger.warning("worker %s sent nothing for %g s; ending the stream",
                                   self._upstream.url, self._stall_timeout_s)
                    yield b"\n\n" + sse_error_event(
                        f"The worker sent nothing for {self._stall_timeout_s:g} s "
                        "(--stream-stall-timeout-s): the stream stalled and was ended, the "
                        "answer is incomplete. Retry the request.", code="stream_stalled")
                    yield SSE_DONE
                    return
                yield chunk
                if self._drain_over.is_set():  # the router is stopping: end the stream cleanly
                    yield sse_error_event(SHUTTING_DOWN, code="router_shutting_down")
                    yield SSE_DONE
                    return
        except httpx.HTTPError as exc:  # the worker is gone mid-answer: never re-send
            logger.warning("worker %s failed mid-stream: %r", self._upstream.url, exc)
            # a partial event line is ended first; then the error and [DONE], as a worker
            # ends a stream its engine failed (the error event marks the answer incomplete)
            yield b"\n\n" + sse_error_event(
                f"The worker failed while answering ({type(exc).__name__}); the answer is "
                "incomplete. Retry the request.", code="worker_failed")
            yield SSE_DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
            self._on_close()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RouterShuttingDown(Exception):
    """The router's drain time ran out before the worker's answer began."""


async def unless_disconnected(request: Request, work: Awaitable[T],
                              drain_over: asyncio.Event) -> tuple[bool, T | None]:
    """Run `work` until done, until the client disconnects, or until `drain_over` is set
    (then cancel it: httpx closes the worker connection, so the worker aborts).

    Returns:
        (finished, result); finished is False when the client left.
    Raises:
        RouterShuttingDown: `drain_over` was set first.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    stopping = asyncio.ensure_future(drain_over.wait())
    try:
        await asyncio.wait({task, watch, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        stopping.cancel()
        if not task.done():
            task.cancel()
    await asyncio.wait({task})  # let a cancelled send close its connection
    if task.cancelled():
        if drain_over.is_set():
            raise RouterShuttingDown
        return False, None
    return True, task.result()  # raises the work's exception


def _has_images(payload: Any) -> bool:
    """A chat request with an image content part (the encoder step's business)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in ("image_url", "input_image")
                       for p in m["content"])
               for m in payload["messages"])


class Proxy:
    """Forwards OpenAI requests to the registry's replicas under `config`'s policy."""

    def __init__(self, config: RouterConfig, registry: Registry, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.client = client
        self.policy = make_policy(config.policy, max_imbalance=config.max_imbalance)
        self.in_flight = 0
        self._seq = itertools.count()
        self._encoder_turn = itertools.count()
        # set when the router's drain after SIGTERM is over (router.cli): requests still
        # waiting for a worker answer 503, relayed streams end with an error event and [DONE]
        self.drain_over = asyncio.Event()

    async def handle(self, request: Request, path: str) -> Response:
        """Answer one client POST to `path` (/v1/chat/completions or /v1/completions)."""
        response = await self._handle(request, path)
        self.metrics.client_requests.labels(path, str(response.status_code)).inc()
        return response

    async def _handle(self, request: Request, path: str) -> Response:
        if self.in_flight >= self.config.max_concurrent_requests:
            self.metrics.rejected.labels("overloaded").inc()
            return error_response(
                f"The router is at capacity ({self.in_flight} requests in flight, "
                f"--max-concurrent-requests={self.config.max_concurrent_requests}); retry "
                "after a short wait.", status_code=429, type="rate_limit_error",
                code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.in_flight += 1
        try:
            response = await self._answer(request, path)
        except BaseException:
            self.in_flight -= 1
            raise
        if not isinstance(response, UpstreamResponse):
            self.in_flight -= 1  # an UpstreamResponse releases its slot when it closes
        return response

    async def _answer(self, request: Request, path: str) -> Response:
        body = await request.body()
        payload = parse_body(body)
        problem = body_problem(body, payload)
        if problem is not None:   # answered here, healthy workers or not
            message, code = problem
            return error_response(message, status_code=400, type="invalid_request_error",
                                  code=code)
        features = request_features(next(self._seq), path, payload)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        if self.config.encoders and _has_images(payload):
            await self._encode(payload, headers)   # bounded by --encoder-timeout-s
        # raw bytes are relayed: the worker may compress only as the client accepts
        headers.setdefault("accept-encoding", "identity")
        if self.config.disaggregated and payload is not None:
            work = self._disaggregated(path, payload, headers, features)
        else:
            role = "decode" if self.config.disaggregated else "both"
            work = self._open(role, path, body, headers, features)
        try:
            finished, opened = await unless_disconnected(request, work, self.drain_over)
        except RouterShuttingDown:
            return error_response(SHUTTING_DOWN, status_code=503, code="router_shutting_down",
                                  headers={"Retry-After": "1"})
        except NoReplicaError as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            return error_response(str(exc), status_code=503, code="no_healthy_replica",
                                  headers={"Retry-After": "1"})
        except httpx.TimeoutException as exc:
            return error_response(f"The worker did not answer within the router's timeouts "
                                  f"({type(exc).__name__}; --request-timeout-s="
                                  f"{self.config.request_timeout_s:g}).", status_code=504,
                                  code="worker_timeout")
        except httpx.HTTPError as exc:
            return error_response(f"The router could not talk to the worker ({exc!r}).",
                                  status_code=502, code="worker_failed")
        if not finished:
            return Response(status_code=499)  # the client left; nobody reads this
        return await self._relay(*opened)

    async def _relay(self, upstream: httpx.Response, replica: Replica,
                     sent_at: float) -> Response:
        """The client's answer from the worker's (header read, body not yet)."""
        def release_replica() -> None:
            self.metrics.duration.labels(replica.url).observe(time.perf_counter() - sent_at)
            self.registry.release(replica)

        if "text/event-stream" in upstream.headers.get("content-type", ""):
            def on_close() -> None:
                release_replica()
                self.in_flight -= 1
            return UpstreamResponse(upstream, on_close, self.drain_over,
                                    self.config.stream_stall_timeout_s)
        try:  # a JSON answer is complete once its header comes: relay it in one piece
            content = b"".join([chunk async for chunk in upstream.aiter_raw()])
        except httpx.HTTPError as exc:  # the worker is gone mid-answer: never re-send
            logger.warning("worker %s failed mid-answer: %r", replica.url, exc)
            return error_response(f"The worker failed while answering ({type(exc).__name__})"
                                  "; retry the request.", status_code=502, code="worker_failed")
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            release_replica()
        return Response(content, status_code=upstream.status_code,
                        headers=relayed_headers(upstream))

    async def _open(self, role: str, path: str, content: bytes, headers: dict[str, str],
                    features: RequestFeatures) -> tuple[httpx.Response, Replica, float]:
        """Send the request to a `role` replica chosen by the policy and return its answer with
        the header read (the body not yet). The replica's `outstanding` stays incremented until
        the caller closes the answer. Connection failures before the first byte, and the
        replica's ejection while the answer has not begun, move the request to another
        replica. Raises NoReplicaError when none could take it."""
        tried: list[Replica] = []
        while len(tried) < self.config.max_attempts:
            candidates = [r for r in self.registry.replicas(role) if r not in tried]
            replica = self.policy(features, candidates)
            if replica is None:
                break
            tried.append(replica)
            request = self.client.build_request("POST", replica.url + path, content=content,
                                                headers=headers)
            sent_at = time.perf_counter()
            replica.outstanding += 1
            try:
                upstream = await self._send_while_healthy(replica, request)
            except ReplicaEjected:   # (its failures were counted by whoever ejected it)
                self.metrics.retries.labels(replica.url).inc()
                self.registry.release(replica)
                logger.warning("%s was ejected before answering; trying another replica",
                               replica.url)
                continue
            except RETRYABLE_ERRORS as exc:
                self.registry.record_failure(replica, unreachable=isinstance(
                    exc, UNREACHABLE_ERRORS), reason=repr(exc))
                self.metrics.retries.labels(replica.url).inc()
                self.registry.release(replica)
                logger.warning("%s failed before answering (%r); trying another replica",
                               replica.url, exc)
                continue
            except BaseException:
                self.registry.release(replica)
                raise
            self.metrics.first_byte.labels(replica.url).observe(time.perf_counter() - sent_at)
            self.metrics.count_answer(replica.url, upstream.status_code)
            return upstream, replica, sent_at
        kind = "" if role == "both" else f"{role} "
        if tried:
            raise NoReplicaError(f"No {kind}worker could be reached (tried "
                                 f"{', '.join(r.url for r in tried)}); retry shortly.",
                                 reason="unreachable")
        raise NoReplicaError(f"No healthy {kind}worker is available right now (all ejected or "
                             "still starting); retry shortly.", reason="no_replica")

    async def _send_while_healthy(self, replica: Replica,
                                  request: httpx.Request) -> httpx.Response:
        """`client.send(request, stream=True)`, given up when the health checks eject
        `replica` before its answer begins (the connection is closed: the worker aborts).

        Raises:
            ReplicaEjected: the replica left the pool first.
        """
        sending = asyncio.ensure_future(self.client.send(request, stream=True))
        try:
            while not sending.done():
                await asyncio.wait({sending}, timeout=EJECTION_POLL_S)
                if not sending.done() and not replica.healthy:
                    sending.cancel()
                    await asyncio.wait({sending})
        except BaseException:   # the client left (this task was cancelled): close it all
            sending.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({sending})
                if not sending.cancelled() and sending.exception() is None:
                    await sending.result().aclose()
            raise
        if sending.cancelled():
            raise ReplicaEjected(replica.url)
        return sending.result()

    async def _encode(self, payload: dict[str, Any], headers: dict[str, str]) -> bool:
        """The encoder step: ask an encoder worker (round robin) to put the request's image
        embeddings into the shared store. Never raises: on any failure the prefill / both
        worker encodes the images itself (counted in deepinfer_router:encoder_steps)."""
        urls = self.config.encoders
        url = urls[next(self._encoder_turn) % len(urls)].rstrip("/")
        body = json.dumps({"messages": payload.get("messages")}).encode()
        try:
            response = await self.client.post(
                f"{url}/v1/encode", content=body, timeout=self.config.encoder_timeout_s,
                headers={k: v for k, v in headers.items()
                         if k.lower() in ("authorization", "content-type")})
            ok = response.status_code == 200
            if not ok:
                logger.warning("encoder %s answered %d; the next worker encodes",
                               url, response.status_code)
        except Exception as exc:   # down, slow, reset: the next worker encodes itself
            logger.warning("encoder %s failed (%r); the next worker encodes", url, exc)
            ok = False
        self.metrics.encoder_steps.labels("ok" if ok else "failed").inc()
        return ok

    async def _disaggregated(self, path: str, payload: dict[str, Any], headers: dict[str, str],
                             features: RequestFeatures) -> tuple[httpx.Response, Replica, float]:
        if not any(r.healthy for r in self.registry.replicas("decode")):
            # no decode worker to hand the prompt to: do not spend a prefill on a request
            # that can only end in 503
            raise NoReplicaError("No healthy decode worker is available right now (all "
                                 "ejected or still starting); retry shortly.",
                                 reason="no_replica")
        params = await self._prefill(path, payload, headers, features)
        body = {k: v for k, v in payload.items() if k != "kv_transfer_params"}
        if params is not None:
            body["kv_transfer_params"] = params
        return await self._open("decode", path, json.dumps(body).encode(), headers, features)

    async def _prefill(self, path: str, payload: dict[str, Any], headers: dict[str, str],
                       features: RequestFeatures) -> dict[str, Any] | None:
        """The prefill step: the `kv_transfer_params` a prefill worker returns for the prompt,
        or None if it failed in any way (then the decode worker recomputes; counted as a
        fallback unless the prefill worker found the request itself invalid: a 4xx, which
        the decode worker then answers the client in the same words)."""
        body = {k: v for k, v in payload.items() if k not in _PREFILL_DROP}
        body.update(kv_transfer_params={"do_remote_decode": True}, max_tokens=1, stream=False,
                    n=1)
        # (a prefill worker that hangs is given up once ejected: `_open`)
        opening = asyncio.ensure_future(self._open(
            "prefill", path, json.dumps(body).encode(), headers, features))
        try:
            await asyncio.wait({opening})
        except BaseException:  # the client left: close the prefill worker's connection too
            opening.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({opening})
                if not opening.cancelled() and opening.exception() is None:
                    upstream, replica, _ = opening.result()
                    await upstream.aclose()
                    self.registry.release(replica)
            raise
        try:
            upstream, replica, sent_at = opening.result()
        except (NoReplicaError, httpx.HTTPError) as exc:
            logger.warning("prefill step failed (%s); the decode worker recomputes", exc)
            return self._fallback()
        try:
            data = await upstream.aread()
        except httpx.HTTPError as exc:
            logger.warning("prefill worker %s failed mid-answer (%r)", replica.url, exc)
            return self._fallback()
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            self.metrics.duration.labels(replica.url).observe(time.perf_counter() - sent_at)
            self.registry.release(replica)
        if 400 <= upstream.status_code < 500:
            return None   # the client's own error: the decode worker gives the same 4xx
        if upstream.status_code != 200:
            logger.warning("prefill worker %s answered %d: %s", replica.url,
                           upstream.status_code, data[:200])
            return self._fallback()
        try:
            answer = json.loads(data)
            params = answer.get("kv_transfer_params")
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        except (ValueError, AttributeError, KeyError, TypeError):
            params, cached = None, None
        if not isinstance(params, dict):
            return self._fallback()
        if isinstance(cached, int):   # what the client's prompt hit, for the decode's usage
            params["prompt_cached_tokens"] = cached
        return params

    def _fallback(self) -> None:
        self.metrics.disagg_fallbacks.inc()
        return None
