"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

`APIError` is what handlers raise; `install_error_handlers` makes FastAPI answer it, request
validation failures (400, not FastAPI's 422 shape), HTTP errors (404/405) and unexpected
exceptions (500, logged) with the same body. `from_engine_error` maps the engine's errors to
their statuses: queue full -> 429, prompt too long / bad sampling values -> 400, dead -> 503.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.engine.errors import (EngineDeadError, EngineShuttingDownError, PromptTooLongError,
                                     QueueFullError, RequestFailedError)

logger = logging.getLogger("deepinfer.server")


class APIError(Exception):
    """An error to return to the client as an OpenAI error body."""

    def __init__(self, message: str, *, status_code: int = 400,
                 type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        # a lone UTF-16 surrogate echoed from the request could not be encoded as UTF-8 JSON
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def with_restart_advice(exc: BaseException) -> str:
    """`exc`'s message ending in "restart the server." once (engine errors often say it)."""
    reason = str(exc).rstrip(". ")
    if "restart the server" in reason.lower():
        return f"{reason}."
    return f"{reason}; restart the server."


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_engine_error(exc: Exception) -> APIError | None:
    """The API error for an exception `AsyncLLM.generate` raised, or None if it is a bug."""
    if isinstance(exc, QueueFullError):
        return APIError(f"The server is at capacity: {exc}",
                        status_code=429, type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": "1"})
    if isinstance(exc, EngineShuttingDownError):
        return APIError(f"The server is shutting down and stopped this request: {exc} Retry "
                        "it once a server is up to take it (behind a router, that is another "
                        "replica).", status_code=503,
                        type="server_error", code="server_shutting_down",
                        headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(f"The inference engine has stopped: {with_restart_advice(exc)}",
                        status_code=503, type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):   # the engine goes on; the message says why
        return APIError(f"The engine could not process this request: {exc}", status_code=500,
                        type="server_error", code="request_failed")
    if isinstance(exc, PromptTooLongError):   # (the server checks first; a backstop)
        return APIError(str(exc), code="context_length_exceeded")
    if isinstance(exc, ValueError):  # a SamplingParamsError names the field
        return APIError(str(exc), param=getattr(exc, "param", None), code="invalid_value")
    return None


def as_api_error(exc: Exception) -> APIError:
    """Any exception as an API error; one that is not a known request error is logged as a bug
    and answered as a 500."""
    if isinstance(exc, APIError):
        return exc
    mapped = from_engine_error(exc)
    if mapped is not None:
        return mapped
    logger.error("unexpected error while generating", exc_info=exc)
    return _internal_error(exc)


def _internal_error(exc: Exception) -> APIError:
    return APIError(f"Internal server error ({type(exc).__name__}); this is a bug in deepinfer. "
                    "The server log has the traceback; please report it.",
                    status_code=500, type="server_error", code="internal_error")


# ------------------------------------------------------------------ request validation errors

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "constrained-str", "constrained-int"}


def _is_type_tag(part: Any) -> bool:
    """Pydantic adds the union member it tried to `loc` (`str`, `list[int]`, `ContentPart`)."""
    if not isinstance(part, str):
        return False
    return (part in _TYPE_TAGS or part.startswith(("list[", "dict[", "function-"))
            or part[:1].isupper())


def param_path(loc: Sequence[str | int]) -> str | None:
    """The parameter a pydantic error's `loc` names, as OpenAI spells it and every `param` of
    this server is written: list indices in brackets, object keys after dots
    (`messages[0].content[1].text`, `logit_bias.50256`); None for the body itself."""
    path = ""
    for part in loc:
        if part == "body" or _is_type_tag(part):
            continue
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else part
    return path or None


def spelled(value: Any) -> str:
    """`value` as the client wrote it, in JSON (`null`, `true`, `"a"`, `{"k": 1}`), for error
    messages; `repr` for what JSON cannot hold (bytes)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def _short(value: Any) -> str:
    text = spelled(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_unicode(text: str, param: str) -> None:
    """Raises APIError (400) if `text` holds a lone UTF-16 surrogate (JSON can carry one; UTF-8
    cannot), naming `param`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(f"{param} holds a lone UTF-16 surrogate at character {exc.start}; send "
                       "valid Unicode text.", param=param, code="invalid_value") from None


# vLLM request extras a client may send that deepinfer does not serve (a 400 naming them)
VLLM_FIELDS_NOT_SERVED = frozenset({
    "add_generation_prompt", "continue_final_message", "include_stop_str_in_output",
    "stream_options.continuous_usage_stats"})


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 from pydantic's error list: the first offending parameter, all its failures."""
    first = errors[0]
    param = param_path(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "malformed JSON")
        return APIError(f"The request body is not valid JSON ({detail}); send a JSON object "
                        "with Content-Type: application/json.", code="invalid_json")
    if kind == "missing":
        if param is None:
            return APIError("The request has no body; send a JSON object with "
                            "Content-Type: application/json.", code="invalid_json")
        return APIError(f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    if kind == "extra_forbidden":
        if param in VLLM_FIELDS_NOT_SERVED:
            return APIError(f"'{param}' (a vLLM extension) is not supported by this server; "
                            "remove it.", param=param, code="unsupported_parameter")
        return APIError(f"Unrecognized request argument supplied: '{param}'; remove it "
                        "(see the OpenAI API reference for the accepted fields).",
                        param=param, code="unknown_parameter")
    if param is None and isinstance(first.get("input"), bytes):
        # the body arrived as bytes: sent without Content-Type: application/json
        return APIError(f"The request body was not read as JSON ({_short(first.get('input'))}); "
                        "send a JSON object with Content-Type: application/json.",
                        code="invalid_type")
    params = [param_path(e.get("loc", ())) or "" for e in errors]
    if param and any(_is_type_tag(part) for part in first.get("loc", ())):
        # a union: what each of its forms needed, inside it too ([104, true] as token ids)
        same = [e for e, p in zip(errors, params)
                if p == param or p.startswith((param + ".", param + "["))]
    else:
        same = [e for e, p in zip(errors, params) if p == (param or "")]
    reasons = "; or ".join(dict.fromkeys(e.get("msg", "invalid") for e in same))
    where = param or "the request body"
    return APIError(f"Invalid value for '{where}': {_short(first.get('input'))}. {reasons}.",
                    param=param, code="invalid_type")


# ---------------------------------------------------------------------------------- handlers

_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error"}


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(list(exc.errors())).response()


# FastAPI's 400 for a body its JSON decoder failed on other than as malformed JSON (bytes that
# are not UTF-8, nesting past the recursion limit, an integer past Python's 4,300-digit limit)
_FASTAPI_BODY_ERROR = "There was an error parsing the body"


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message, code = str(exc.detail), None
    if exc.status_code == 404:
        message = f"No route {request.method} {request.url.path}; see GET /v1/models."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    elif exc.status_code == 400 and message == _FASTAPI_BODY_ERROR:
        message, code = ("The request body could not be decoded as JSON (bytes that are not "
                         "UTF-8, nesting too deep, or an integer of more than 4,300 digits); "
                         "send a UTF-8 JSON object with Content-Type: application/json."
                         ), "invalid_json"
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":   # compressed bodies are not decompressed here
            message = (f"Content-Encoding {encoding!r} is not supported; send the JSON body "
                       "uncompressed.")
    err = APIError(message, status_code=exc.status_code, code=code,
                   type=_HTTP_TYPES.get(exc.status_code, "invalid_request_error"))
    return JSONResponse(err.body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return _internal_error(exc).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
