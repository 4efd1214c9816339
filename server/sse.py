"""Server-sent events framing for OpenAI streams: `data: {json}\\n\\n`, ending `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

import orjson
from pydantic import BaseModel

from deepinfer.server.errors import APIError

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# Keep proxies (nginx) from buffering the stream and clients from caching it.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    return b"data: " + payload.model_dump_json(exclude=exclude).encode() + b"\n\n"


def sse_json(body: dict[str, Any]) -> bytes:
    """One event from a plain dict, with orjson: the per-token hot path (a pydantic model
    built and dumped per chunk cost several times more; `ChunkHead` builds such dicts)."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


class ChunkHead:
    """The fields every chunk of one stream repeats, in the order the pydantic response models
    dump them (id, created, model, system_fingerprint, object), so a fast chunk's JSON is the
    same text as the model's (`usage` null when the client asked for a final usage chunk, left
    out otherwise, as the models' `exclude` does)."""

    def __init__(self, request_id: str, created: int, model: str, obj: str,
                 include_usage: bool) -> None:
        self.head = {"id": request_id, "created": created, "model": model,
                     "system_fingerprint": None, "object": obj}
        self.include_usage = include_usage

    def event(self, choice: dict[str, Any]) -> bytes:
        body = {**self.head, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse_json(body)


def sse_error(err: APIError) -> bytes:
    """An error inside a stream that already answered 200: OpenAI's error body as one event."""
    body: dict[str, Any] = err.body()
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"
