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
