"""Server-sent events framing for OpenAI streams: `data: {json}\\n\\n`, ending `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from deepinfer.server.errors import APIError

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# Keep proxies (nginx) from buffering the stream and clients from caching it.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    return b"data: " + payload.model_dump_json(exclude=exclude).encode() + b"\n\n"


def sse_error(err: APIError) -> bytes:
    """An error inside a stream that already answered 200: OpenAI's error body as one event."""
    body: dict[str, Any] = err.body()
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"
