"""Slow and oversized clients at the HTTP edge, for the worker and the router alike.

uvicorn bounds neither the time to send a request's header nor its body, so a few hundred
sockets sending a byte every few seconds hold connections and (in the router, which counted a
request before reading its body) every `--max-concurrent-requests` slot. Two guards:

- `guarded_protocol(limits)`: uvicorn's h11 protocol with a header deadline (a request's header
  must arrive within `header_timeout_s` of its first byte, or of the connection's opening; else
  408 and close), a cap on open connections per client address (beyond it: 429 and close), and
  OpenAI-shaped JSON for the 400 uvicorn sends on a malformed header, and a JSON 400 for a
  header larger than `max_header_bytes` (counted here: h11's own bound only applies to a
  header still incomplete, so one that arrived whole in a single read passed at any size).
- `BodyLimitMiddleware`: reads a POST body to its end before the app runs, within
  `body_timeout_s` (else 408) and `max_body_bytes` (else 413), then hands the app the whole
  body. So a handler, and the in-flight counts it keeps, only ever sees complete requests.

A leaf module (uvicorn, h11, starlette only): the router imports it without the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

# idle connections (before their first request) are closed after this long as well
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_BYTES = 32 << 20
DEFAULT_MAX_HEADER_BYTES = 64 << 10
LINGER_S = 2.0   # after refusing a request, how long its remaining input is read and dropped


@dataclass(frozen=True)
class HTTPLimits:
    """header_timeout_s: a request's header must be complete this long after its first byte.
    body_timeout_s: a POST body must be complete this long after its header.
    max_body_bytes / max_header_bytes: larger is refused (413 / 400).
    max_connections_per_client: open connections per client IP address; 0 = no cap (behind a
        load balancer every client may share its address)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_connections_per_client: int = 0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "max_body_bytes",
                     "max_header_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.max_connections_per_client < 0:
            raise ValueError(f"max_connections_per_client={self.max_connections_per_client} "
                             "must be >= 0 (0 = no cap)")


def error_json(message: str, *, type: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code}}).encode()


def raw_response(status: int, reason: str, body: bytes, extra: str = "") -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for use outside h11's state."""
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n").encode() + body


def guarded_protocol(limits: HTTPLimits) -> type[H11Protocol]:
    """uvicorn's `http=` protocol class enforcing `limits` (see the module doc)."""

    open_per_client: Counter[str] = Counter()

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _counted: str | None = None
        _discarding = False
        _header_bytes = 0     # bytes received since the header being awaited began
        _header_tail = b""    # their last 3, for a terminator split across reads

        def connection_made(self, transport: Any) -> None:   # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            cap = limits.max_connections_per_client
            if host is not None and cap and open_per_client[host] >= cap:
                self._refuse(429, "Too Many Requests", error_json(
                    f"Too many open connections from {host} (the cap is {cap}); reuse a "
                    "connection or close idle ones.", type="rate_limit_error",
                    code="too_many_connections"), "retry-after: 1\r\n")
                return
            if host is not None:
                open_per_client[host] += 1
                self._counted = host
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if self._counted is not None:
                open_per_client[self._counted] -= 1
                if open_per_client[self._counted] <= 0:
                    del open_per_client[self._counted]
                self._counted = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._discarding:
                return   # refused: what the client still sends is dropped
            if self._header_timer is None and self._awaiting_header():
                self._arm_header_timer()   # the next request on a kept-alive connection
            if self._awaiting_header() and self._header_size(data) > limits.max_header_bytes:
                self._refuse(400, "Bad Request", error_json(
                    f"The request's headers exceed {limits.max_header_bytes} bytes; send "
                    "smaller headers.", type="invalid_request_error",
                    code="invalid_http_request"))
                return
            super().data_received(data)
            if not self._awaiting_header():
                self._cancel_header_timer()
                self._header_bytes, self._header_tail = 0, b""

        def _header_size(self, data: bytes) -> int:
            """The size of the awaited header so far, `data` included: up to its end
            (CRLF CRLF) where that is in sight, else every byte received since it began."""
            seen = self._header_tail + data
            end = seen.find(b"\r\n\r\n")
            size = (self._header_bytes - len(self._header_tail) + end + 4 if end >= 0
                    else self._header_bytes + len(data))
            self._header_bytes += len(data)
            self._header_tail = seen[-3:]
            return size

        def send_400_response(self, msg: str) -> None:
            self._refuse(400, "Bad Request", error_json(
                f"{msg} The request line or a header is malformed, or the headers exceed "
                f"{limits.max_header_bytes} bytes; send a smaller, valid HTTP/1.1 request.",
                type="invalid_request_error", code="invalid_http_request"))

        def _awaiting_header(self) -> bool:
            import h11

            return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s,
                                                      self._header_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if not self._awaiting_header():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return   # still answering the previous request (pipelining)
            self._refuse(408, "Request Timeout", error_json(
                f"The request header did not arrive within {limits.header_timeout_s:g} s; "
                "send the whole request at once.", type="invalid_request_error",
                code="request_timeout"))

        def _refuse(self, status: int, reason: str, body: bytes, extra: str = "") -> None:
            """Answer and close. A lingering close: the answer is followed by a FIN and what
            the client still sends is read and dropped for up to LINGER_S, since closing
            with unread input would reset the connection and lose the answer."""
            if self.transport.is_closing() or self._discarding:
                return
            self._cancel_header_timer()
            self._discarding = True
            self.transport.write(raw_response(status, reason, body, extra))
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

    return GuardedH11Protocol


def uvicorn_limits(limits: HTTPLimits) -> dict[str, Any]:
    """The `uvicorn.Config` keyword arguments for `limits`."""
    return {"http": guarded_protocol(limits),
            "h11_max_incomplete_event_size": limits.max_header_bytes}


class BodyLimitMiddleware:
    """Reads each request body whole, within `limits.body_timeout_s` and `max_body_bytes`,
    before the app sees the request (408 / 413 otherwise); the app then receives it in one
    message and, after it, the client's later messages (a disconnect)."""

    def __init__(self, app: ASGIApp, limits: HTTPLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            await self._answer(send, 413, self._too_large())
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            await self._answer(send, 408, error_json(
                f"The request body did not arrive within {self.limits.body_timeout_s:g} s; "
                "send it at once.", type="invalid_request_error", code="request_timeout"))
            return
        except _TooLarge:
            await self._answer(send, 413, self._too_large())
            return
        if body is None:
            return   # the client left while sending
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> bytes:
        return error_json(f"The request body exceeds {self.limits.max_body_bytes} bytes; send "
                          "a smaller request.", type="invalid_request_error",
                          code="request_too_large")

    @staticmethod
    async def _answer(send: Send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


# with an API key, the OpenAPI schema and its viewers need it as /v1 does
PROTECTED_PREFIXES = ("/v1", "/docs", "/redoc", "/openapi.json")


class APIKeyMiddleware:
    """Refuses requests to `PROTECTED_PREFIXES` without `Authorization: Bearer <key>` for one
    of `api_keys` (constant-time compare), with an OpenAI-shaped 401; `who` names the process
    in the message ("server" or "router")."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], who: str = "server") -> None:
        self.app = app
        self._keys = [key.encode() for key in api_keys]
        self._who = who

    def _allowed(self, token: bytes) -> bool:
        import secrets

        return any([secrets.compare_digest(token, key) for key in self._keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not self._allowed(token.strip().encode()):
                given = "a wrong API key" if token else "no API key"
                body = error_json(f"The request has {given}; send the {self._who}'s key as "
                                  "'Authorization: Bearer <key>' (its --api-key, "
                                  "--api-key-file or environment variable).",
                                  type="invalid_request_error", code="invalid_api_key")
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def add_limit_flags(parser: Any) -> None:
    """The `HTTPLimits` flags, on `deepinfer serve` and `deepinfer router` alike."""
    parser.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="a request's header must arrive within this many seconds of its "
                             "first byte, else 408 (default: %(default)s)")
    parser.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help="a request's body must arrive within this many seconds of its "
                             "header, else 408; only whole requests count against "
                             "concurrency limits (default: %(default)s)")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                        help="larger request bodies get 413 (default: %(default)s)")
    parser.add_argument("--max-connections-per-client", type=int, default=0,
                        help="open connections per client IP address; more get 429 at once "
                             "(default 0 = no cap: behind a load balancer clients share its "
                             "address)")


def limits_from_args(args: Any) -> HTTPLimits:
    """Raises ValueError naming a bad flag value."""
    return HTTPLimits(header_timeout_s=args.header_timeout_s,
                      body_timeout_s=args.body_timeout_s,
                      max_body_bytes=int(args.max_body_mb * 2**20),
                      max_connections_per_client=args.max_connections_per_client)
