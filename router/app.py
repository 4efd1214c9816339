"""`build_app(config)`: the router's FastAPI app.

Routes: POST /v1/chat/completions and /v1/completions (proxied, SSE included), GET /v1/models
(the union by id of the healthy workers' lists), GET /v1/models/{model}, GET /health (200 while
at least one replica that answers requests is admitted, else 503: the Kubernetes readiness
probe), GET /liveness (200 while the router serves, whatever its workers do: the startup and
liveness probes, so a router is never restarted for its workers' sake), GET /metrics (the
router's own Prometheus metrics); every GET route answers HEAD too. With --api-key, /v1 and the
API docs need the router's key. Errors of the router itself have OpenAI's error shape.

The app owns its httpx client (one connection pool for all workers), the health-check task and,
with `discovery="dns"`, the discovery task: they start and stop with the app's lifespan; the
first resolution and the first round of checks run before the app serves, so replicas that are
already up take traffic at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from deepinfer.router.config import RouterConfig
from deepinfer.router.discovery import Resolver, Service, ServiceDiscovery, resolve_dns
from deepinfer.router.errors import error_response
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.proxy import Proxy
from deepinfer.router.registry import Registry, Replica
from deepinfer.server.http_limits import APIKeyMiddleware, BodyLimitMiddleware, HTTPLimits

MODELS_TIMEOUT_S = 10.0
# Idle connections to workers are dropped after this many seconds, well before a worker closes
# them (server.cli.KEEP_ALIVE_S): a request sent on a connection the worker is closing fails
# before its first byte and would count as a failure of a healthy replica.
WORKER_IDLE_EXPIRY_S = 30.0
# the router's own idle keep-alive towards clients and ingresses (as a worker's)
CLIENT_KEEP_ALIVE_S = 75


def _pools(config: RouterConfig) -> list[tuple[str, str]]:
    """(URL, role) of every --backend, --prefill and --decode given."""
    return ([(url.rstrip("/"), "both") for url in config.backends]
            + [(url.rstrip("/"), "prefill") for url in config.prefill]
            + [(url.rstrip("/"), "decode") for url in config.decode])


def build_registry(config: RouterConfig) -> Registry:
    """The registry: the static replicas, or none yet when discovery finds them."""
    replicas = ([] if config.discovery == "dns"
                else [Replica(url, role) for url, role in _pools(config)])
    return Registry(replicas, max_failures=config.max_failures)


def build_discovery(config: RouterConfig, registry: Registry, metrics: RouterMetrics,
                    resolve: Resolver) -> ServiceDiscovery | None:
    """DNS discovery of every pool the config names, or None in static mode."""
    if config.discovery != "dns":
        return None
    return ServiceDiscovery(registry, [Service.from_url(url, role) for url, role in
                                       _pools(config)],
                            resolve=resolve, timeout_s=config.health_timeout_s,
                            on_failure=lambda url: metrics.discovery_failures.labels(url).inc())


def build_client(config: RouterConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=config.connect_timeout_s, read=config.request_timeout_s,
                            write=config.request_timeout_s, pool=config.request_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256,
                          keepalive_expiry=WORKER_IDLE_EXPIRY_S)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


async def _models(client: httpx.AsyncClient, replica: Replica,
                  headers: dict[str, str]) -> tuple[list[dict[str, Any]], Response | None]:
    """The replica's model cards, and its answer when it refused the client (a 4xx such as a
    missing API key: the client's error, relayed as is when no replica lists models)."""
    try:
        response = await client.get(replica.url + "/v1/models", headers=headers,
                                    timeout=MODELS_TIMEOUT_S)
        if 400 <= response.status_code < 500:
            return [], Response(response.content, status_code=response.status_code,
                                media_type=response.headers.get("content-type"))
        data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return [], None
    return [card for card in data or [] if isinstance(card, dict) and "id" in card], None


def _lifespan(registry: Registry, discovery: ServiceDiscovery | None,
              client: httpx.AsyncClient, config: RouterConfig):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if discovery is not None:
            await discovery.refresh()
        await registry.check_all(client, config.health_timeout_s)
        tasks = [asyncio.create_task(registry.run_health_checks(
            client, interval_s=config.health_interval_s, timeout_s=config.health_timeout_s))]
        if discovery is not None:
            tasks.append(asyncio.create_task(discovery.run(
                client, interval_s=config.discovery_interval_s,
                health_timeout_s=config.health_timeout_s)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks)
            await client.aclose()
    return lifespan


def build_app(config: RouterConfig, *, resolve: Resolver = resolve_dns,
              limits: HTTPLimits = HTTPLimits(), api_keys: tuple[str, ...] = ()) -> FastAPI:
    """The router app for `config`; `resolve` looks up the pools' addresses (DNS discovery;
    tests give a fake); `limits` bound how slowly and how much a client may send (the body is
    read whole before a request counts as in flight); `api_keys`: the router's own keys for
    /v1 and the API docs (checked before anything is forwarded; the client's Authorization
    header still goes to the workers)."""
    registry = build_registry(config)
    client = build_client(config)
    metrics = RouterMetrics(registry.known, lambda: proxy.in_flight)
    registry.on_eject = lambda replica: metrics.ejections.labels(replica.url).inc()
    registry.on_forget = lambda replica: metrics.forget_backend(replica.url)
    discovery = build_discovery(config, registry, metrics, resolve)
    proxy = Proxy(config, registry, metrics, client)

    app = FastAPI(title="deepinfer router",
                  lifespan=_lifespan(registry, discovery, client, config))
    app.state.registry, app.state.proxy, app.state.metrics = registry, proxy, metrics
    app.state.discovery = discovery
    app.add_middleware(BodyLimitMiddleware, limits=limits)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys, who="router")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (f"No route {request.method} {request.url.path}; see GET /v1/models."
                   if exc.status_code == 404 else str(exc.detail))
        return error_response(message, status_code=exc.status_code,
                              type="invalid_request_error")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health() -> Response:
        serving = [r for r in registry.serving() if r.healthy and not r.stopping]
        if not serving:
            return error_response("No replica that answers requests is healthy.",
                                  status_code=503, code="no_healthy_replica")
        return JSONResponse({"status": "ok", "healthy_replicas": len(serving)})

    @app.get("/liveness")
    @app.head("/liveness", include_in_schema=False)
    async def liveness() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    @app.head("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _add_model_routes(app, registry, client)
    return app


def _add_model_routes(app: FastAPI, registry: Registry, client: httpx.AsyncClient) -> None:
    async def model_cards(request: Request) -> tuple[list[dict[str, Any]], Response | None]:
        """The union by id of the healthy replicas' cards; else a replica's 4xx (the client's
        error) or a 503 when none answered."""
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        healthy = [r for r in registry.all if r.healthy]
        answers = await asyncio.gather(*(_models(client, r, headers) for r in healthy))
        union: dict[str, dict[str, Any]] = {}
        for cards, _ in answers:
            for card in cards:
                union.setdefault(card["id"], card)
        if union:
            return list(union.values()), None
        refusal = next((refused for _, refused in answers if refused is not None), None)
        return [], refusal or error_response("No healthy worker listed its models; retry "
                                             "shortly.", status_code=503,
                                             code="no_healthy_replica")

    @app.get("/v1/models")
    @app.head("/v1/models", include_in_schema=False)
    async def list_models(request: Request) -> Response:
        cards, failure = await model_cards(request)
        if failure is not None:
            return failure
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    @app.head("/v1/models/{model_id:path}", include_in_schema=False)
    async def get_model(model_id: str, request: Request) -> Response:
        cards, failure = await model_cards(request)
        if failure is not None:
            return failure
        for card in cards:
            if card["id"] == model_id:
                return JSONResponse(card)
        return error_response(f"The model `{model_id}` does not exist on any healthy worker.",
                              status_code=404, type="invalid_request_error",
                              code="model_not_found")
