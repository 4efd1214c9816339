"""The two grammar backends (XGrammar, LLGuidance) and "auto" between them, on the SmolLM2
tokenizer without a model: which backend "auto" picks, what neither enforces (a 400 naming the
keyword and path), values that hold decoded (backslashes, quotes, control characters), bounded
JSON numbers, rollback, and JSONSchemaBench compile rates per split with every finished random
walk validating (jsonschema with format checking). Walks pick allowed tokens at random, so they
test the grammar, not a model; tests/engine/test_structured.py generates with a model."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from deepinfer.engine.structured import GrammarError
from deepinfer.engine.structured.manager import grammar_manager
from deepinfer.engine.structured.number_bounds import (EXPONENT_DIGITS, FRACTION_DIGITS,
                                                       INTEGER_DIGITS)
from structured_schemas import (BENCH_DIR, BENCH_SPLITS, HAND_WRITTEN, ISSUE_KINDS,
                                random_walk)

BACKENDS = ("xgrammar", "guidance")
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)")


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's checkers plus date-time (its own needs an optional package)."""
    checker = jsonschema.FormatChecker()

    @checker.checks("date-time")
    def _date_time(value) -> bool:
        return not isinstance(value, str) or bool(_RFC3339.fullmatch(value))

    return checker


def validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=format_checker())


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def manager(tokenizer):
    return grammar_manager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def closing(tokenizer) -> set[int]:
    """Tokens that close strings and containers (walks that prefer them end sooner)."""
    return {i for i in range(len(tokenizer)) if any(c in tokenizer.decode([i]) for c in '"}],')}


@pytest.fixture(scope="module")
def digits(tokenizer) -> set[int]:
    return {i for i in range(len(tokenizer)) if re.fullmatch(r" ?[0-9]+", tokenizer.decode([i]))}


def json_args(schema, backend="auto") -> dict:
    return {"schema_type": "json", "schema": schema, "backend": backend}


def walk_texts(manager, tokenizer, so_args, preferred, seeds, max_tokens=200, **kwargs):
    """(finished texts, unfinished texts) of seeded random walks."""
    finished, unfinished = [], []
    for seed in range(seeds):
        tokens, done = random_walk(manager, so_args, [tokenizer.eos_token_id],
                                   random.Random(seed), max_tokens, preferred, **kwargs)
        (finished if done else unfinished).append(tokenizer.decode(tokens))
    return finished, unfinished


# ---- which backend --------------------------------------------------------------------------

@pytest.mark.parametrize("name, backend", [
    ("nested_objects", "xgrammar"), ("defs_and_ref", "xgrammar"),
    ("all_of_two", "guidance"), ("multiple_of", "guidance"),
    ("pattern_properties_min", "guidance"), ("windows_path", "guidance"),
    ("quote_pattern", "guidance"), ("newline_pattern", "guidance"),
    ("escaped_const_enum", "xgrammar"), ("formats", "xgrammar"),
])
def test_auto_uses_xgrammar_where_it_enforces_every_keyword_else_guidance(manager, name,
                                                                          backend):
    schema = {**HAND_WRITTEN, **ISSUE_KINDS}[name]
    assert manager.compile(json_args(schema)).backend == backend
    assert manager.compile(json_args(schema, "guidance")).backend == "guidance"


TINY_RANGE = {"type": "object", "properties": {"v": {"type": "number", "minimum": 1e-17,
                                                     "maximum": 2e-17}}, "required": ["v"]}


def test_a_range_finer_than_xgrammar_keeps_goes_to_guidance_and_holds(manager, tokenizer,
                                                                       digits):
    """XGrammar's grammar for [1e-17, 2e-17] is the empty string (`{"v": }` came back as
    "stop"): auto sends such bounds to LLGuidance, whose outputs hold them."""
    with pytest.raises(GrammarError, match="'minimum': 1e-17 at #/properties/v"):
        manager.compile(json_args(TINY_RANGE, "xgrammar"))
    assert manager.compile(json_args(TINY_RANGE)).backend == "guidance"
    finished, _ = walk_texts(manager, tokenizer, json_args(TINY_RANGE), digits, seeds=3)
    assert finished and all(1e-17 <= json.loads(text)["v"] <= 2e-17 for text in finished)


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
     r"keyword 'not' at #/properties/a .*LLGuidance cannot enforce it either.*not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     r"'uniqueItems' at # .*LLGuidance cannot enforce it either"),
    ({"type": "object", "properties": {"k": {"if": {"type": "string"}, "then": {
        "minLength": 2}}}}, r"keyword 'if' at #/properties/k .*either.*if"),
    ({"type": "integer", "minimum": 1e25}, r"'minimum': 1e\+25 at # is past 2\*\*63"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},   # LLGuidance: "" + stop
     r"the \$ref at # leads only back to itself"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/b"}},
      "$defs": {"b": {"$ref": "#/$defs/c"}, "c": {"$ref": "#/$defs/b"}}},
     r"the \$ref at #/properties/x leads only back to itself"),
    ({"type": "integer", "minimum": 12345678901234567890},   # LLGuidance gave int64's max
     r"'minimum': 12345678901234567890 at # is past"),
])
def test_a_schema_neither_backend_enforces_names_the_keyword_and_path(manager, schema,
                                                                       message):
    with pytest.raises(GrammarError, match=message):
        manager.compile(json_args(schema))


def test_backend_choice_is_checked(manager):
    with pytest.raises(GrammarError, match="backend 'outlines' is not one of auto, xgrammar, "
                                           "guidance"):
        manager.compile(json_args({}, "outlines"))
    with pytest.raises(ValueError, match="structured_outputs_backend='x' is not supported"):
        from deepinfer.engine.config import ModelConfig
        ModelConfig(structured_outputs_backend="x")


# ---- outputs hold for the decoded value ------------------------------------------------------

@pytest.mark.parametrize("name", ["windows_path", "quote_pattern", "newline_pattern",
                                  "escaped_const_enum"])
def test_patterns_const_and_enum_hold_for_the_decoded_value(manager, tokenizer, closing, name):
    """Issue 34: `^[A-Z]:\\\\[a-z]+$` came back as "P:\\n" (a newline, no backslash) under
    XGrammar; under auto (LLGuidance for such patterns) every finished value validates."""
    schema = ISSUE_KINDS[name]
    finished, _ = walk_texts(manager, tokenizer, json_args(schema), closing, seeds=8,
                             prefer_p=0.8)
    assert len(finished) >= 6
    for text in finished:
        validate(text, schema)
    if name == "windows_path":
        assert all("\\" in json.loads(t)["path"] for t in finished)


@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_kinds_validate_under_each_backend_that_takes_them(manager, tokenizer, closing,
                                                                 backend):
    taken = 0
    for name, schema in {**HAND_WRITTEN, **ISSUE_KINDS}.items():
        try:
            manager.compile(json_args(schema, backend))
        except GrammarError:
            assert backend == "xgrammar", name        # LLGuidance takes all 20 kinds
            continue
        taken += 1
        finished, _ = walk_texts(manager, tokenizer, json_args(schema, backend), closing,
                                 seeds=3, max_tokens=300, prefer_p=0.8)
        for text in finished:
            validate(text, schema)
    assert taken == 20 if backend == "guidance" else taken >= 14


# ---- numbers that end ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("so_args", [
    {"schema_type": "json", "schema": {"type": "number"}},
    {"schema_type": "json", "schema": ISSUE_KINDS["unbounded_numbers"]},
    {"schema_type": "json", "schema": {}},
    {"schema_type": "json_object"},
])
def test_json_numbers_have_bounded_digits(manager, tokenizer, digits, backend, so_args):
    """Issue 27.2: a walk that always prefers digits (as a model writing `1000000...` does)
    still ends: integer part <= 20 digits, fraction <= 17, exponent <= 3, outside strings."""
    so_args = {**so_args, "backend": backend}
    finished, unfinished = walk_texts(manager, tokenizer, so_args, digits, seeds=6,
                                      max_tokens=120, prefer_p=0.97, end_p=0.02)
    typed = so_args.get("schema", {}).get("type") is not None
    if typed:
        assert not unfinished and len(finished) == 6     # strings aside, numbers must end
    longest = 0
    for text in finished + unfinished:
        outside = re.sub(r'"(\\.|[^"\\])*("|$)', '""', text)
        for integer, fraction, exponent in re.findall(
                r"(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?", outside):
            assert len(integer) <= INTEGER_DIGITS and len(fraction) <= FRACTION_DIGITS
            assert len(exponent) <= EXPONENT_DIGITS, text
            longest = max(longest, len(integer))
    for text in finished:
        json.loads(text)
    assert longest == INTEGER_DIGITS or not typed        # the walks ran into the bound


def test_digits_inside_strings_are_free(manager, tokenizer, digits):
    schema = {"type": "object", "properties": {"id": {"type": "string", "minLength": 30,
                                                      "maxLength": 40}}, "required": ["id"]}
    finished, _ = walk_texts(manager, tokenizer, json_args(schema, "guidance"), digits,
                             seeds=2, prefer_p=1.0)
    assert finished and all(len(json.loads(t)["id"]) >= 30 for t in finished)


# ---- finishing, rollback ---------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_restores_the_bitmask_and_a_closed_value_allows_only_stop(manager, tokenizer,
                                                                           backend):
    so_args = json_args(HAND_WRITTEN["integer_bounds"], backend)
    tokens = tokenizer.encode('{"age": 42, "score": 3}', add_special_tokens=False)
    stop_ids = [tokenizer.eos_token_id, 7]            # 7: a request's extra stop token id
    matcher = manager.new_matcher(so_args, [], stop_ids)
    masks = []
    for token_id in tokens:
        masks.append(manager.fill_bitmask([matcher])[0].clone())
        assert matcher.accept_token(token_id)
    matcher.rollback(3)
    assert torch.equal(manager.fill_bitmask([matcher])[0], masks[-3])
    assert not matcher.accept_token(tokenizer.encode("x")[0])   # refused, state unchanged
    assert torch.equal(manager.fill_bitmask([matcher])[0], masks[-3])
    for token_id in tokens[-3:]:
        assert matcher.accept_token(token_id)
    bitmask = manager.fill_bitmask([matcher])[0]
    allowed = [t for t in range(bitmask.shape[1] * 32) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert allowed == sorted(stop_ids)                # closed: whitespace is never free
    assert not matcher.is_terminated()
    assert matcher.accept_token(7) and matcher.is_terminated()
    rebuilt = manager.new_matcher(so_args, tokens[:5], stop_ids)
    assert torch.equal(manager.fill_bitmask([rebuilt])[0], masks[5])


# ---- JSONSchemaBench -------------------------------------------------------------------------

def test_jsonschemabench_compile_rate_per_backend_and_outputs_validate(manager, tokenizer,
                                                                      closing):
    """Every 8th schema of each vendored split: the share each backend compiles (auto takes
    at least what either does, >= 97% over the splits), and every finished walk under auto
    validates (benchmarks/bench_structured.py runs every schema)."""
    rates, accepted, total = {}, 0, 0
    for split in BENCH_SPLITS:
        paths = sorted((BENCH_DIR / split).glob("*.json"))[::8]
        compiled = {backend: 0 for backend in ("xgrammar", "guidance", "auto")}
        for path in paths:
            schema = json.loads(path.read_text())
            for backend in compiled:
                try:
                    manager.compile(json_args(schema, backend))
                    compiled[backend] += 1
                except GrammarError:
                    continue
                if backend == "auto":
                    finished, _ = walk_texts(manager, tokenizer, json_args(schema), closing,
                                             seeds=1, max_tokens=160, prefer_p=0.8)
                    for text in finished:
                        validate(text, schema)
        rates[split] = {backend: count / len(paths) for backend, count in compiled.items()}
        assert compiled["auto"] >= max(compiled["xgrammar"], compiled["guidance"]), rates
        accepted, total = accepted + compiled["auto"], total + len(paths)
    assert accepted / total >= 0.97, rates


# ---- tool_choice "auto": a lazily triggered grammar -------------------------------------------

def test_auto_tool_calls_follow_their_tool_schema_once_started(manager, tokenizer, closing):
    """Issue 34.3: text is free until `<tool_call>`; the call then names one of the tools and
    its arguments validate against that tool's parameters (a `strict: false` tool's are any
    JSON object), so the Hermes parser always finds a call."""
    from deepinfer.server.protocol import ChatCompletionRequest
    from deepinfer.server.tool_parser import HermesStreamer
    from deepinfer.server.tools import tool_config, tool_so_args

    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                "days": {"type": "integer", "minimum": 1,
                                                         "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "note", "strict": False,
                                               "parameters": {"type": "object"}}}]
    config = tool_config(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                               tools=tools))
    so_args = tool_so_args(config)
    assert manager.compile(so_args).backend == "xgrammar"
    prefix = tokenizer.encode("Let me check. <tool_call>", add_special_tokens=False)
    free = manager.new_matcher(so_args, [], [tokenizer.eos_token_id])
    assert all(free.accept_token(t) for t in tokenizer.encode("any text", add_special_tokens=False))
    calls = 0
    for seed in range(6):
        tokens, done = random_walk(manager, so_args, [tokenizer.eos_token_id],
                                   random.Random(seed), 200, closing, prefer_p=0.8,
                                   end_p=0.0, prefix=prefix, until="</tool_call>",
                                   tokenizer=tokenizer)
        if not done:
            continue
        streamer = HermesStreamer(config.names).run(tokenizer.decode(prefix + tokens))
        assert len(streamer.calls) == 1, tokenizer.decode(prefix + tokens)
        call = streamer.calls[0]
        arguments = json.loads(call.arguments)
        if call.name == "get_weather":
            jsonschema.validate(arguments, weather)
        else:
            assert isinstance(arguments, dict)
        calls += 1
    assert calls >= 4


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
               {"type": "object", "properties": {"b": {"type": "integer"}}}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]},
    {"properties": {"c": {"type": "string"}},
     "allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
])
def test_all_of_objects_take_no_other_keys(manager, tokenizer, closing, schema):
    """Strict outputs through `allOf` too (LLGuidance): keys are those its object subschemas
    (and the holder) name; before, each subschema was left open and any key came out."""
    names = {name for sub in schema["allOf"] for name in sub["properties"]} | set(
        schema.get("properties", {}))
    finished, _ = walk_texts(manager, tokenizer, json_args(schema, "guidance"), closing,
                             seeds=12, max_tokens=120, prefer_p=0.3)
    assert len(finished) >= 6
    for text in finished:
        validate(text, schema)
        assert set(json.loads(text)) <= names, text
