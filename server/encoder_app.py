"""The HTTP app of an encoder worker (`deepinfer serve MODEL --role encoder`).

POST /v1/encode takes a chat-completions body (only `messages` is read), fetches and
preprocesses its image parts exactly as a prefill worker would (server.media, the model's HF
processor) and makes sure the KV store holds each image's embedding. The router calls it before
the prefill step; its answer is informational (the prefill worker finds the embeddings by
content hash). GET /health, /metrics (`deepinfer:mm_encoder_*`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer.engine.config import MultiModalConfig
from deepinfer.server.errors import APIError, install_error_handlers
from deepinfer.server.http_limits import APIKeyMiddleware, BodyLimitMiddleware, HTTPLimits
from deepinfer.server.media import load_images, process_images
from deepinfer.server.protocol import ChatMessage


class _Collector:
    def __init__(self, worker: Any, state: Any) -> None:
        self.worker = worker
        self.state = state

    def collect(self):
        stats = self.worker.get_stats()
        labels = [self.worker.model_name]
        for name in ("images_encoded", "cache_hits", "encode_seconds", "store_hits",
                     "store_misses", "store_corrupt", "store_saves"):
            family = CounterMetricFamily(f"deepinfer:mm_encoder_{name}", name.replace("_", " "),
                                         labels=["model_name"])
            family.add_metric(labels, getattr(stats, name))
            yield family
        gauge = GaugeMetricFamily("deepinfer:mm_encoder_cache_bytes", "encoder cache bytes",
                                  labels=["model_name"])
        gauge.add_metric(labels, stats.cache_bytes)
        yield gauge
        # encode calls queued behind the one running: what the pool's HPA scales on
        waiting = GaugeMetricFamily("deepinfer:num_requests_waiting",
                                    "encode calls waiting for the encoder", labels=["model_name"])
        waiting.add_metric(labels, max(self.state.in_flight - 1, 0))
        yield waiting


def build_encoder_app(worker: Any, media: MultiModalConfig = MultiModalConfig(), *,
                      api_key: str | tuple[str, ...] | None = None,
                      limits: HTTPLimits = HTTPLimits()) -> FastAPI:
    """The app for an `engine.mm_worker.EncoderWorker`; `api_key` and `limits` as in
    `server.app.build_app` (the router forwards the client's Authorization header)."""
    app = FastAPI(title="deepinfer encoder")
    app.state.engine = worker        # server.cli reads model_name / abort_all from it
    app.state.draining = False
    app.state.in_flight = 0
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limits=limits)
    api_keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    registry = CollectorRegistry()
    registry.register(_Collector(worker, app.state))

    @app.get("/health")
    @app.get("/liveness")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/encode")
    async def encode(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            messages = [ChatMessage(**m) for m in body["messages"]]
        except Exception:
            raise APIError("the body must be a chat-completions request with 'messages'.",
                           param="messages", code="invalid_value") from None
        app.state.in_flight += 1
        try:
            loaded = await load_images(messages, media)
            processed = await asyncio.to_thread(process_images, worker.mm_processor, loaded)
            images = await asyncio.to_thread(worker.encode_and_store, processed)
        finally:
            app.state.in_flight -= 1
        return JSONResponse({"model": worker.model_name, "images": images})

    return app
