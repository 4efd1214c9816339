"""`build_app(engine)`: the FastAPI app serving one engine through the OpenAI API.

Routes: GET (or HEAD) /health (200 while the step loop lives, else 503; 503
`{"status": "draining"}` after SIGTERM while in-flight requests finish; the Kubernetes startup
and readiness probes in deploy/ call it), GET (or HEAD) /liveness (200 while the step loop
lives, draining included: the liveness probe), GET (or HEAD) /metrics (Prometheus text),
GET (or HEAD) /v1/models and /v1/models/{model}, POST /v1/chat/completions, POST /v1/completions.
With `api_key`, every /v1 route needs `Authorization: Bearer <key>` (401 otherwise); /health
and /metrics stay open for probes and scrapers. The app does not own the engine: whoever made
it shuts it down (see `server.cli`).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer.engine.config import MultiModalConfig
from deepinfer.server.errors import APIError, install_error_handlers, with_restart_advice
from deepinfer.server.http_limits import APIKeyMiddleware, BodyLimitMiddleware, HTTPLimits
from deepinfer.server.logprobs import TokenDecoder
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.prompts import max_token_chars
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from deepinfer.server.serving_chat import ChatServing
from deepinfer.server.serving_completion import CompletionServing


CACHE_ISOLATION_MODES = ("none", "user", "api-key")


def cache_salt(body: Any, authorization: str, mode: str) -> str | None:
    """The request's effective `cache_salt`: its own, plus with `mode` "user" its `user` field
    or with "api-key" a digest of its bearer token, so requests of different users / keys share
    no cached block (prefix cache and KV store; see README "Prompt privacy and the cache")."""
    if body.cache_salt == "":
        return ""   # refused by validation with its own message
    parts = [f"salt:{body.cache_salt}"] if body.cache_salt else []
    if mode == "user":
        parts.append(f"user:{body.user or ''}")
    elif mode == "api-key":
        token = authorization.partition(" ")[2].strip().encode()
        parts.append(f"key:{hashlib.sha256(token).hexdigest()}")
    return "\n".join(parts) or None




class InFlightMiddleware:
    """Counts the POST requests being answered in `state.in_flight` (their answer included, to
    a stream's last byte): a draining server (server.cli) exits when it reaches zero."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self._state = state
        state.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        self._state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._state.in_flight -= 1


class HTTPMetricsMiddleware:
    """Counts every HTTP answer in `deepinfer:http_requests_total` by route template and status.

    The route label is the matched route's path template (`/v1/models/{model_id:path}`), or
    `unmatched` when no route was reached (a 404 on an unknown path, or a 401 from the API-key
    check, which runs before routing), so clients cannot grow the label set.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # an exception before the answer started is a 500 to the client

        async def send_and_record(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self._metrics.http_response(route, status[0])


class APIServerHeaderMiddleware:
    """With several API server processes, every answer says which one served it
    (`x-deepinfer-api-server: INDEX`): how an operator (and the e2e test) sees the load
    spread over them."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app = app
        self._header = (b"x-deepinfer-api-server", str(index).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self._header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def build_app(engine: Any, *, api_key: str | tuple[str, ...] | None = None,
              cache_isolation: str = "none", limits: HTTPLimits = HTTPLimits(),
              media: MultiModalConfig = MultiModalConfig(),
              api_server_index: int | None = None,
              metrics_dir: str | None = None) -> FastAPI:
    """The app for `engine` (an `AsyncLLM` or anything with its public surface).

    api_key: one key or several (each client its own); None = no authentication.
    cache_isolation: "none" (all requests share cached prefixes), "user" (salted by the
        request's `user` field) or "api-key" (salted by the bearer token); see `cache_salt`.
    limits: how slowly and how much a client may send (server.http_limits).
    media: image part limits and remote fetching (server.media), for vision-language models.
    api_server_index: this process's index among several API servers (server.api_servers):
        sent in the `x-deepinfer-api-server` header; None (one API server): no header.
    metrics_dir: the API servers' shared prometheus multiprocess directory (server.metrics).
    """
    if cache_isolation not in CACHE_ISOLATION_MODES:
        raise ValueError(f"cache_isolation={cache_isolation!r} is not one of "
                         f"{CACHE_ISOLATION_MODES}.")
    api_keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    metrics = ServerMetrics(engine.get_stats, engine.model_name, engine.max_model_len,
                            multiprocess_dir=metrics_dir)
    decode = TokenDecoder(engine.tokenizer)
    max_token_chars(engine.tokenizer)   # now, not on the first request
    chat = ChatServing(engine, metrics, decode, media)
    completion = CompletionServing(engine, metrics, decode)
    created = int(time.time())

    app = FastAPI(title="deepinfer", summary="OpenAI-compatible LLM server")
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.draining = False   # set by server.cli on SIGTERM: /health answers "draining"
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limits=limits)
    app.add_middleware(InFlightMiddleware, state=app.state)   # whole requests only
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)  # outermost: sees 401s too
    if api_server_index is not None:
        app.add_middleware(APIServerHeaderMiddleware, index=api_server_index)

    def model_card() -> ModelCard:
        return ModelCard(id=engine.model_name, root=engine.model_name, created=created,
                         max_model_len=engine.max_model_len)

    def check_engine() -> None:
        try:
            engine.check_health()
        except Exception as exc:
            raise APIError(f"The inference engine is not running: {with_restart_advice(exc)}",
                           status_code=503, type="server_error", code="engine_dead") from exc

    @app.get("/liveness")
    @app.head("/liveness", include_in_schema=False)
    async def liveness() -> Response:
        """200 while the step loop lives, draining or not (the liveness probe: a draining
        worker must not be restarted mid-drain)."""
        check_engine()
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health() -> Response:
        check_engine()
        if app.state.draining:   # still serving what it has; a router sends nothing new
            return JSONResponse({"status": "draining", "in_flight": app.state.in_flight},
                                status_code=503)
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    @app.head("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.head("/v1/models", include_in_schema=False)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")
    @app.head("/v1/models/{model_id:path}", include_in_schema=False)
    async def get_model(model_id: str) -> ModelCard:
        if model_id != engine.model_name:
            raise APIError(f"The model `{model_id}` does not exist; this server serves "
                           f"`{engine.model_name}`.", status_code=404, param="model",
                           code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        body.cache_salt = cache_salt(body, raw.headers.get("authorization", ""),
                                     cache_isolation)
        return await chat.create(body, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        body.cache_salt = cache_salt(body, raw.headers.get("authorization", ""),
                                     cache_isolation)
        return await completion.create(body, raw)

    return app
