"""A client that goes away aborts its engine requests, streaming or not (raw ASGI calls, since
TestClient buffers whole responses and never disconnects)."""

import asyncio
import json
import time

import httpx

from deepinfer.server.app import build_app
from server_doubles import ScriptedEngine


async def call_then_disconnect(app, path: str, payload: dict, *, after_body_chunks: int = 0,
                               after_s: float | None = None) -> list[dict]:
    """POST `payload`, then report http.disconnect after some body chunks or some seconds."""
    sent: list[dict] = []
    gone = asyncio.Event()
    body = json.dumps(payload).encode()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if after_s is None and len(chunks) >= after_body_chunks:
            gone.set()

    async def disconnect_later():
        await asyncio.sleep(after_s)
        gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    timer = asyncio.create_task(disconnect_later()) if after_s is not None else None
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    if timer:
        timer.cancel()
    await asyncio.sleep(0.05)  # let cancelled pump tasks run their cleanup
    return sent


def test_stream_disconnect_aborts_every_choice():
    engine = ScriptedEngine(reply="x" * 40, step_delay_s=0.02)
    app = build_app(engine)
    sent = asyncio.run(call_then_disconnect(app, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2},
        after_body_chunks=4))
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in body
    assert len(engine.aborted) == 2 and engine.running == set()


def test_stream_disconnect_before_the_first_token_aborts_the_request():
    """A streaming client that leaves while its request waits in the queue (or prefills) frees
    its place at once, not when the first token would have come."""
    engine = ScriptedEngine(reply="z" * 10, first_token_delay_s=30)
    app = build_app(engine)
    start = time.monotonic()
    sent = asyncio.run(call_then_disconnect(app, "/v1/completions",
                                            {"prompt": "a", "stream": True}, after_s=0.15))
    assert time.monotonic() - start < 5
    assert sent[0]["status"] == 499
    assert len(engine.aborted) == 1 and engine.running == set()
    assert 'finished_reason="abort"' in asyncio.run(_get_metrics(app))


def test_non_stream_disconnect_aborts_the_request():
    engine = ScriptedEngine(reply="y" * 40, step_delay_s=0.02)
    app = build_app(engine)
    sent = asyncio.run(call_then_disconnect(app, "/v1/completions", {"prompt": "a"},
                                            after_s=0.15))
    assert sent[0]["status"] == 499
    assert len(engine.aborted) == 1 and engine.running == set()
    metrics = asyncio.run(_get_metrics(app))
    assert 'finished_reason="abort"' in metrics


async def _get_metrics(app) -> str:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return (await client.get("/metrics")).text
