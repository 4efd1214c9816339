"""Structured-output request fields -> the engine's `so_args`.

Accepted spellings, all mapped to `{"schema_type": "json"|"json_object"|"regex"|"ebnf",
"schema": ...}`:
- OpenAI `response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}` (`{"type": "text"}` = no constraint);
- vLLM `structured_outputs`: exactly one of `json` (schema), `json_object` (true), `regex`,
  `grammar` (EBNF), `choice` (list of strings); and optionally `backend`: "auto", "xgrammar"
  or "guidance", the grammar backend of this request's constraint, whichever field (or tool
  choice) it comes from (`structured_outputs: {"backend": ...}` alone picks only the backend);
- vLLM's older `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`.
A request may use one of them. A choice list becomes a regex that matches one choice exactly.
Whether the schema, regex or grammar compiles (and is not too long to compile quickly:
`engine.structured.backend.MAX_SCHEMA_CHARS`; a JSON schema is also valid against its
metaschema and satisfiable: `engine.structured.check_valid`, whichever backend) is checked by
the engine (`compile_grammar`) before the request is queued; `check_compiles` turns its error
into a 400 naming the parameter (`response_format.json_schema.schema`, `guided_json`, ...).
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer.server.errors import APIError, spelled
from deepinfer.server.protocol import SamplingFields

_REGEX_SPECIAL = set("\\.^$|?*+()[]{}/-")
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")   # OpenAI's rule for json_schema.name


def choice_regex(choices: Any, param: str) -> str:
    """A regex matching exactly one of `choices` (each escaped character by character)."""
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise APIError(f"{param} must be a non-empty list of non-empty strings, got "
                       f"{spelled(choices)}.", param=param, code="invalid_value")
    escaped = ["".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in choice)
               for choice in choices]
    return "(" + "|".join(escaped) + ")"


def _from_response_format(req: SamplingFields) -> dict[str, Any] | None:
    response_format = getattr(req, "response_format", None)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"schema_type": "json_object"}
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise APIError("response_format of type 'json_schema' needs json_schema.schema; send "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": "
                       "{...}}}.", param="response_format.json_schema",
                       code="missing_required_parameter")
    if spec.name is None:
        raise APIError("response_format.json_schema needs a name (OpenAI's and vLLM's rule): "
                       "add \"name\": \"my_schema\" (letters, digits, '_' and '-', up to 64).",
                       param="response_format.json_schema.name",
                       code="missing_required_parameter")
    if not _SCHEMA_NAME.fullmatch(spec.name):
        raise APIError(f"response_format.json_schema.name={spelled(spec.name)} may hold only "
                       "letters, digits, '_' and '-', 1 to 64 of them; rename it.",
                       param="response_format.json_schema.name", code="invalid_value")
    return {"schema_type": "json", "schema": spec.schema_}


_STRUCTURED_OUTPUT_KEYS = {"json": "json", "regex": "regex", "grammar": "ebnf",
                           "choice": "choice", "json_object": "json_object"}


_BACKENDS = ("auto", "xgrammar", "guidance")


def request_backend(req: SamplingFields) -> str | None:
    """`structured_outputs.backend`, checked; None when not given."""
    spec = req.structured_outputs
    backend = spec.get("backend") if isinstance(spec, dict) else None
    if backend is not None and backend not in _BACKENDS:
        raise APIError(f"structured_outputs.backend={spelled(backend)} is not one of "
                       f"{', '.join(_BACKENDS)}; pick one or leave it out (default: the "
                       "server's --structured-outputs-backend).",
                       param="structured_outputs.backend", code="invalid_value")
    return backend


def _from_structured_outputs(spec: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    given = [key for key in _STRUCTURED_OUTPUT_KEYS if spec.get(key) not in (None, False)]
    unknown = sorted(set(spec) - set(_STRUCTURED_OUTPUT_KEYS) - {"backend"})
    if unknown:
        raise APIError(f"structured_outputs has unsupported field(s) {spelled(unknown)}; use one "
                       f"of {spelled(sorted(_STRUCTURED_OUTPUT_KEYS))} (and optionally 'backend').",
                       param="structured_outputs", code="unsupported_parameter")
    if not given and "backend" in spec:
        return None
    if len(given) != 1:
        raise APIError(f"structured_outputs must set exactly one of "
                       f"{spelled(sorted(_STRUCTURED_OUTPUT_KEYS))}; got "
                       f"{spelled(given) if given else 'none'}.",
                       param="structured_outputs", code="invalid_value")
    param = f"structured_outputs.{given[0]}"
    return _so_args(_STRUCTURED_OUTPUT_KEYS[given[0]], spec[given[0]], param), param


def _so_args(kind: str, value: Any, param: str) -> dict[str, Any]:
    if kind == "json_object":
        return {"schema_type": "json_object"}
    if kind == "choice":
        return {"schema_type": "regex", "schema": choice_regex(value, param)}
    if kind == "json":
        if not isinstance(value, (dict, str)):
            raise APIError(f"{param} must be a JSON schema object, got {type(value).__name__}.",
                           param=param, code="invalid_value")
        return {"schema_type": "json", "schema": value}
    if not isinstance(value, str) or not value:
        raise APIError(f"{param} must be a non-empty string.", param=param, code="invalid_value")
    return {"schema_type": kind, "schema": value}


def so_args_from_request(req: SamplingFields) -> tuple[dict[str, Any] | None, str | None]:
    """The request's constraint as `so_args` and the parameter that holds it, e.g.
    "response_format.json_schema.schema" (None, None if none).

    Raises:
        APIError: 400 when fields conflict or have the wrong shape.
    """
    found: list[tuple[str, dict[str, Any], str]] = []   # (field, so_args, parameter)
    from_format = _from_response_format(req)
    if from_format is not None:
        found.append(("response_format", from_format, "response_format.json_schema.schema"
                      if from_format["schema_type"] == "json" else "response_format"))
    if req.structured_outputs is not None:
        from_spec = _from_structured_outputs(req.structured_outputs)
        if from_spec is not None:
            found.append(("structured_outputs", *from_spec))
    legacy = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "ebnf",
              "guided_choice": "choice"}
    for field, kind in legacy.items():
        value = getattr(req, field)
        if value is not None:
            found.append((field, _so_args(kind, value, field), field))
    if len(found) > 1:
        names = ", ".join(name for name, _, _ in found)
        raise APIError(f"Only one structured-output constraint may be given, got {names}; keep "
                       "one of them.", param=found[1][0], code="invalid_value")
    if not found:
        return None, None
    return with_backend(found[0][1], req), found[0][2]


def with_backend(so_args: dict[str, Any] | None, req: SamplingFields) -> dict[str, Any] | None:
    """`so_args` with the request's `structured_outputs.backend`, if it names one."""
    backend = request_backend(req)
    if so_args is None or backend is None:
        return so_args
    return {**so_args, "backend": backend}


def invalid_constraint(exc: ValueError, param: str) -> APIError:
    """The 400 for a schema, regex or grammar the engine refused (`exc` says why)."""
    reason = str(exc).rstrip(". ")   # the compiler's messages may end in a full stop
    advice = "" if "fix the" in reason.lower() else " Fix it and retry."   # said once
    return APIError(f"Invalid {param}: {reason}.{advice}", param=param, code="invalid_schema")


async def check_compiles(engine: Any, so_args: dict[str, Any], param: str) -> None:
    """Compile the constraint through the engine (cached for the request itself); a bad schema,
    regex or grammar is a 400 naming `param`, raised before anything is queued."""
    try:
        await engine.compile_grammar(so_args)
    except ValueError as exc:
        raise invalid_constraint(exc, param) from None
