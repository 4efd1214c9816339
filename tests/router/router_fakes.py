"""Fake workers for the router's tests: tiny FastAPI apps served by uvicorn in a thread.

A `FakeWorker` answers /health, /v1/models, /v1/chat/completions and /v1/completions the way a
deepinfer worker does (JSON, or SSE ending `data: [DONE]`), records every body it receives, and
can be told to misbehave (`mode`): "ok", "slow" (a long stream of `slow_events` events, 20 ms
apart, or a long wait before a JSON answer), "break" (answer 200, send one piece, then drop the
connection).
It also plays a prefill worker: a body with `kv_transfer_params.do_remote_decode` gets the
`kv_transfer_params` a prefill worker returns.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.processes import free_port

STORED = {"do_remote_prefill": True, "num_stored_tokens": 32, "block_size": 16,
          "model_fingerprint": "fake-fp"}


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


class ServerThread:
    """uvicorn serving `app` on `host` (a loopback address: 127.0.0.1, 127.0.0.2, ... are all
    this machine on Linux) in a daemon thread."""

    def __init__(self, app, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        if not wait_for(lambda: self.server.started or not self.thread.is_alive(), 20):
            raise RuntimeError("server thread did not start")
        if not self.server.started:
            raise RuntimeError("server thread exited during start-up")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


class FakeWorker:
    def __init__(self, name: str, models: tuple[str, ...] = ("fake-model",), *,
                 host: str = "127.0.0.1", port: int | None = None) -> None:
        self.name = name
        self.models = models
        self.mode = "ok"
        self.slow_events = 500
        self.healthy = True
        self.bodies: list[dict] = []
        self.raw_bodies: list[bytes] = []
        self.aborted = 0
        self.completed = 0
        self.app = self._build()
        self.thread = ServerThread(self.app, port, host)
        self.url = self.thread.url

    def start(self) -> "FakeWorker":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.thread.stop()

    def reset(self) -> None:
        self.mode, self.healthy, self.slow_events = "ok", True, 500
        self.bodies.clear()
        self.raw_bodies.clear()
        self.aborted = self.completed = 0

    async def _events(self, body: dict):
        count = self.slow_events if self.mode == "slow" else 3
        try:
            for i in range(count):
                event = {"worker": self.name, "i": i, "model": body.get("model")}
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
                if self.mode == "break":
                    raise ConnectionAbortedError("the fake worker dies mid-stream")
                await asyncio.sleep(0.02 if self.mode == "slow" else 0)
            yield b"data: [DONE]\n\n"
            self.completed += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted += 1
            raise

    async def _json(self, request: Request, body: dict) -> Response:
        if self.mode == "slow":  # a long generation: notice the client leaving, as vLLM does
            for _ in range(500):
                if await request.is_disconnected():
                    self.aborted += 1
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
        if self.mode == "break":
            async def partial():
                yield b'{"worker": "' + self.name.encode() + b'", "partial'
                raise ConnectionAbortedError("the fake worker dies mid-answer")
            return StreamingResponse(partial(), media_type="application/json")
        params = body.get("kv_transfer_params") or {}
        answer = {"worker": self.name, "echo": body}
        if params.get("do_remote_decode"):
            answer["kv_transfer_params"] = STORED
            answer["usage"] = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}
        self.completed += 1
        return JSONResponse(answer)

    def _build(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Response:
            raw = await request.body()
            self.raw_bodies.append(raw)
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):   # as a real worker: a 400, not a crash
                return JSONResponse({"error": {"message": "bad JSON", "type":
                                               "invalid_request_error", "param": None,
                                               "code": "invalid_json"}}, status_code=400)
            self.bodies.append(body)
            if body.get("user") == "bad":
                return JSONResponse({"error": {"message": "bad temperature", "type":
                                               "invalid_request_error", "param": "temperature",
                                               "code": "invalid_value"}}, status_code=400)
            if body.get("stream"):
                return StreamingResponse(self._events(body), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await self._json(request, body)

        app.post("/v1/chat/completions")(generate)
        app.post("/v1/completions")(generate)

        @app.get("/health")
        async def health() -> Response:
            return Response(b'{"status":"ok"}' if self.healthy else b"{}",
                            status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            if self.mode == "auth" and request.headers.get("authorization") != "Bearer key":
                return JSONResponse({"error": {"message": "no API key", "type":
                                               "invalid_request_error", "param": None,
                                               "code": "invalid_api_key"}}, status_code=401)
            return JSONResponse({"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": self.name} for m in self.models]})

        return app


class HangUpServer:
    """Accepts connections, reads the request, closes without answering."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.posts = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if conn.recv(65536).startswith(b"POST"):
                self.posts += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
