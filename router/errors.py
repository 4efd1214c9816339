"""OpenAI-shaped error answers of the router itself: `{"error": {message, type, param, code}}`.

(`server.errors` has the same shape but imports the engine, which the router must not.)
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse


def error_body(message: str, *, type: str, code: str | None) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def error_response(message: str, *, status_code: int, type: str = "server_error",
                   code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type=type, code=code), status_code=status_code,
                        headers=headers)


def sse_error_event(message: str, *, code: str) -> bytes:
    """An error inside an SSE stream that already answered 200 (as the workers send them)."""
    body = error_body(message, type="server_error", code=code)
    return b"data: " + json.dumps(body).encode() + b"\n\n"
