"""`build_app(engine)`: the FastAPI app serving one engine through the OpenAI API.

Routes: GET (or HEAD) /health (200 while the step loop lives, else 503; the Kubernetes startup,
readiness and liveness probes in deploy/ call it), GET (or HEAD) /metrics (Prometheus text),
GET (or HEAD) /v1/models and /v1/models/{model}, POST /v1/chat/completions, POST /v1/completions.
With `api_key`, every /v1 route needs `Authorization: Bearer <key>` (401 otherwise); /health
and /metrics stay open for probes and scrapers. The app does not own the engine: whoever made
it shuts it down (see `server.cli`).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer.server.errors import APIError, install_error_handlers
from deepinfer.server.logprobs import TokenDecoder
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from deepinfer.server.serving_chat import ChatServing
from deepinfer.server.serving_completion import CompletionServing


class APIKeyMiddleware:
    """Refuses /v1 requests without `Authorization: Bearer <api_key>` (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                    token.strip().encode(), self._key):
                given = "a wrong API key" if token else "no API key"
                err = APIError(f"The request has {given}; send the server's key as "
                               "'Authorization: Bearer <key>' (its --api-key or "
                               "DEEPINFER_API_KEY).", status_code=401, code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def build_app(engine: Any, *, api_key: str | None = None) -> FastAPI:
    """The app for `engine` (an `AsyncLLM` or anything with its public surface)."""
    metrics = ServerMetrics(engine.get_stats, engine.model_name, engine.max_model_len)
    decode = TokenDecoder(engine.tokenizer)
    chat = ChatServing(engine, metrics, decode)
    completion = CompletionServing(engine, metrics, decode)
    created = int(time.time())

    app = FastAPI(title="deepinfer", summary="OpenAI-compatible LLM server")
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)  # outermost: sees 401s too

    def model_card() -> ModelCard:
        return ModelCard(id=engine.model_name, root=engine.model_name, created=created,
                         max_model_len=engine.max_model_len)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            engine.check_health()
        except Exception as exc:
            raise APIError(f"The inference engine is not running: {exc}. Restart the server.",
                           status_code=503, type="server_error", code="engine_dead") from exc
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def get_model(model_id: str) -> ModelCard:
        if model_id != engine.model_name:
            raise APIError(f"The model `{model_id}` does not exist; this server serves "
                           f"`{engine.model_name}`.", status_code=404, param="model",
                           code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await completion.create(body, raw)

    return app
