"""Schemas, regexes and grammars for the structured-output tests and benchmark.

`HAND_WRITTEN` covers the JSON-schema features the issue names; `bench_sample()` takes a
deterministic sample of JSONSchemaBench (Geng et al. 2025, arXiv 2501.10868) from
`tests/data/jsonschemabench/` (a copy of the team's shared data, so a bare clone has it).
`is_exact(schema)` says whether XGrammar represents a schema exactly: it approximates `not`, `allOf`, `oneOf`, `if`/`then`, `dependencies` (it warns and
falls back to a looser grammar), so outputs under those may not validate and are left out of
the must-validate tests (the benchmark still counts them).
"""

from __future__ import annotations

import json
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "data" / "jsonschemabench"  # vendored copy
BENCH_SPLITS = ("Glaiveai2K", "Github_trivial", "Github_easy", "Kubernetes")

HAND_WRITTEN: dict[str, dict] = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "id": {"type": "integer"},
                "address": {"type": "object", "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}},
                "required": ["id", "address"]},
            "active": {"type": "boolean"}},
        "required": ["user", "active"]},
    "non_ascii_enum": {
        "type": "object",
        "properties": {"ville": {"enum": ["Zürich", "São Paulo", "東京", "Ελλάδα"]},
                       "humeur": {"type": "string", "enum": ["😀", "naïve", "façade"]}},
        "required": ["ville", "humeur"]},
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                             "maximum": 9},
                                "minItems": 2, "maxItems": 4}},
        "required": ["tags"]},
    "integer_bounds": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                       "score": {"type": "integer", "exclusiveMinimum": -5,
                                 "exclusiveMaximum": 5}},
        "required": ["age", "score"]},
    "string_pattern": {
        "type": "object",
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3,5}$"},
                       "date": {"type": "string", "format": "date"}},
        "required": ["sku", "date"]},
    "defs_and_ref": {
        "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"},
                       "path": {"type": "array", "items": {"$ref": "#/$defs/point"},
                                "maxItems": 3}},
        "required": ["start", "path"]},
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"},
                                           {"type": "string", "enum": ["n/a"]}]}},
        "required": ["value"]},
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                   "qty": {"type": "number"}},
                  "required": ["name", "qty"]}},
}

# the kinds issue 34 names beyond HAND_WRITTEN (with it, 20): several need LLGuidance under
# "auto" (allOf of two, multipleOf, patternProperties with minProperties, quoted / backslashed
# patterns and constants, which XGrammar would match against the escaped text)
ISSUE_KINDS: dict[str, dict] = {
    "all_of_two": {"allOf": [
        {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}},
         "required": ["id"]},
        {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 8}},
         "required": ["tag"]}]},
    "multiple_of": {"type": "object", "properties": {
        "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 500},
        "ratio": {"type": "number", "multipleOf": 0.25}}, "required": ["step", "ratio"]},
    "pattern_properties_min": {"type": "object", "patternProperties": {
        "^x_[a-z]{1,6}$": {"type": "integer"}}, "additionalProperties": False,
        "minProperties": 1, "maxProperties": 3},
    "formats": {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"},
        "who": {"type": "string", "format": "email"},
        "day": {"type": "string", "format": "date"}}, "required": ["when", "who", "day"]},
    "recursive_ref": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["value"]}}, "$ref": "#/$defs/node"},
    "windows_path": {"type": "object", "properties": {
        "path": {"type": "string", "pattern": "^[A-Z]:\\\\[a-z]+$"}}, "required": ["path"]},
    "quote_pattern": {"type": "object", "properties": {
        "said": {"type": "string", "pattern": '^"[a-z]{1,5}"$'}}, "required": ["said"]},
    "newline_pattern": {"type": "object", "properties": {
        "two_lines": {"type": "string", "pattern": "^[a-z]{1,4}\\n[a-z]{1,4}$"}},
        "required": ["two_lines"]},
    "escaped_const_enum": {"type": "object", "properties": {
        "c": {"const": "tab\there \"q\" back\\slash \u00e9\u0001"},
        "e": {"enum": ["C:\\dir", "line\nbreak", "\u2028"]}}, "required": ["c", "e"]},
    "unbounded_numbers": {"type": "object", "properties": {
        "confidence": {"type": "number"}, "count": {"type": "integer"}},
        "required": ["confidence", "count"]},
    "open_object": {"type": "object"},
    "any_value": {},
}

_INEXACT_KEYWORDS = {"not", "allOf", "oneOf", "if", "then", "else", "dependencies",
                     "dependentSchemas", "dependentRequired", "patternProperties",
                     "propertyNames", "contains", "uniqueItems", "minProperties",
                     "maxProperties", "multipleOf"}


def is_exact(schema) -> bool:
    """False when the schema uses a keyword XGrammar only approximates (see module doc)."""
    if isinstance(schema, dict):
        if _INEXACT_KEYWORDS & schema.keys():
            return False
        return all(is_exact(v) for k, v in schema.items() if k not in ("enum", "const",
                                                                        "default", "examples"))
    if isinstance(schema, list):
        return all(is_exact(v) for v in schema)
    return True


def bench_files(per_split: int) -> list[Path]:
    """`per_split` files of each split, evenly spaced in file-name order (deterministic)."""
    files = []
    for split in BENCH_SPLITS:
        names = sorted((BENCH_DIR / split).glob("*.json"))
        step = max(1, len(names) // per_split)
        files.extend(names[::step][:per_split])
    return files


def bench_sample(per_split: int) -> dict[str, dict]:
    """{"split/file": schema} for `bench_files(per_split)`."""
    return {f"{path.parent.name}/{path.stem}": json.loads(path.read_text())
            for path in bench_files(per_split)}


REGEXES = {
    "email": r"[a-z]{3,8}@[a-z]{2,6}\.(com|org|net)",
    "phone": r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}",
    "iso_date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "non_ascii": r"(café|naïve|日本){1,3}!",
}

# arithmetic over small integers; the test parses outputs with Python's ast
ARITHMETIC_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""


def allowed_ids(bitmask, vocab_size: int):
    """[1, ceil(V / 32)] int32 bitmask -> the allowed token ids (numpy array)."""
    import numpy as np
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def random_walk(manager, so_args: dict, stop_ids: list[int], rng, max_tokens: int,
                preferred: set[int] = frozenset(), prefer_p: float = 0.6, end_p: float = 0.5,
                timings: list | None = None, prefix: list[int] = (),
                until: str | None = None, tokenizer=None) -> tuple[list[int], bool]:
    """Tokens a matcher allows, picked at random (from `preferred` with probability `prefer_p`
    when any is allowed; a stop token with probability `end_p` once one is allowed), until a
    stop token or `max_tokens`. Returns (tokens without the stop token, whether it stopped).
    `timings` collects each mask fill's seconds. The walk starts after `prefix` (tokens the
    matcher accepts first) and, given `until` and `tokenizer`, counts as stopped once the text
    contains `until`."""
    import time
    matcher = manager.new_matcher(so_args, list(prefix), stop_ids)
    vocab = manager.backend.vocab_size
    tokens: list[int] = []
    for _ in range(max_tokens):
        start = time.perf_counter()
        bitmask, _ = manager.fill_bitmask([matcher])
        if timings is not None:
            timings.append(time.perf_counter() - start)
        allowed = [int(t) for t in allowed_ids(bitmask, vocab)]
        assert allowed, f"no token allowed after {tokens}"
        stops = [t for t in allowed if t in stop_ids]
        if stops and (rng.random() < end_p or len(stops) == len(allowed)):
            assert matcher.accept_token(stops[0]) and matcher.is_terminated()
            return tokens, True
        others = [t for t in allowed if t not in stop_ids]
        liked = [t for t in others if t in preferred]
        token = rng.choice(liked if liked and rng.random() < prefer_p else others)
        assert matcher.accept_token(token)
        tokens.append(token)
        if until is not None and until in tokenizer.decode(list(prefix) + tokens):
            return tokens, True
    return tokens, False
