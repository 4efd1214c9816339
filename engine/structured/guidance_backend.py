"""The LLGuidance adapter: `GrammarBackend` over `llguidance.LLMatcher`.

LLGuidance (Moskal et al., guidance-ai/llguidance) compiles JSON schemas, regexes and Lark
grammars into a lexer + Earley parser; its JSON-schema coverage of real-world schemas is the
widest JSONSchemaBench measured (Geng et al. 2025, arXiv 2501.10868). It enforces keywords
XGrammar cannot (`allOf`, `multipleOf`, `minProperties` with open keys, ...), and it applies
`pattern`, `const` and `enum` to the decoded string value, so a pattern with a literal
backslash or quote holds for the value (XGrammar applies it to the escaped JSON text).
Unimplemented keywords (`not`, `if`/`then`, `uniqueItems`, ...) are errors, never ignored.

JSON is generated as XGrammar's adapter generates it: separators `", "` and `": "`, no other
whitespace, objects with `properties` closed to other keys (strict outputs), required
properties that `properties` lacks declared. The "compiled grammar" is a pristine matcher;
each request gets a `deep_copy()` of it (microseconds), so compilation runs once per schema.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch as llg_torch
import torch

from deepinfer.engine.structured.backend import GrammarError, GrammarKey

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties",
              "propertyNames")
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required")


def strict_schema(schema: Any, in_all_of: bool = False) -> Any:
    """The schema as a strict output reads it: an object schema with `properties` and no
    word on other keys gets `additionalProperties: false`, and every `required` name is
    declared. Inside `allOf` each subschema names only some of the keys, so there the
    `allOf`'s holder takes the union of its object subschemas' properties and closes the
    object instead (`_close_all_of`)."""
    if isinstance(schema, list):
        return [strict_schema(item, in_all_of) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: value if key in _NOT_SCHEMAS else strict_schema(value, key == "allOf")
              for key, value in schema.items()}
    if not in_all_of:
        schema = _close_all_of(schema)
    properties, required = schema.get("properties"), schema.get("required")
    if not isinstance(properties, dict):
        return schema
    if isinstance(required, list) and schema.get("additionalProperties") is not False:
        missing = {name: {} for name in required
                   if isinstance(name, str) and name not in properties}
        schema["properties"] = properties = {**properties, **missing}
    minimum = schema.get("minProperties")
    if (not in_all_of and not any(key in schema for key in _OPEN_KEYS)
            and not (isinstance(minimum, int) and minimum > len(properties))):
        schema["additionalProperties"] = False
    return schema


def _close_all_of(schema: dict) -> dict:
    """A schema whose `allOf` holds only object subschemas with `properties` (no `$ref`, no
    word on other keys, here or there), with those properties declared on itself (each as
    `{}`: the subschemas constrain them) so that the strict rule closes it: the output takes
    no key none of them names. Any other schema is returned as it is."""
    all_of = schema.get("allOf")
    if not (isinstance(all_of, list) and all_of and all(
            isinstance(sub, dict) and isinstance(sub.get("properties"), dict)
            and "$ref" not in sub and not any(key in sub for key in _OPEN_KEYS)
            for sub in all_of)) or any(key in schema for key in _OPEN_KEYS):
        return schema
    own = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    named = {name: {} for sub in all_of for name in sub["properties"]}
    return {**schema, "properties": {**named, **own}}


class GuidanceMatcher:
    """`GrammarMatcher` over `llguidance.LLMatcher` (see backend.py for the contract).

    The tokenizer's EOS ids are LLGuidance's end tokens; other stop ids of the request are
    allowed wherever EOS is and accepted as EOS."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: list[int],
                 stop_token_ids: list[int]):
        self._matcher = matcher
        self._eos = eos_token_ids
        self._extra_stops = [t for t in stop_token_ids if t not in eos_token_ids]
        self._ended = False

    def accept_token(self, token_id: int) -> bool:
        if token_id in self._extra_stops:
            token_id = self._eos[0]
        if token_id in self._eos:
            # a complete value may have stopped the matcher already (nothing can follow);
            # it then takes EOS although validate_tokens says 0
            if self._ended or not self._matcher.is_accepting():
                return False
            self._ended = self._matcher.consume_token(token_id)
            return self._ended
        if self._matcher.validate_tokens([token_id]) != 1:
            return False                       # refused: the matcher stays as it was
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llg_torch.fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._extra_stops and any(bitmask[row, t // 32] >> (t % 32) & 1 for t in self._eos):
            for token_id in self._extra_stops:
                bitmask[row, token_id // 32] |= _bit(token_id % 32)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._ended = False                # a stop token is always the last one
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._ended


def _bit(position: int) -> int:
    """Bit `position` of an int32 word as a Python int (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)


class GuidanceBackend:
    """Args: as `XGrammarBackend` (tokenizer, vocab_size, stop_token_ids: the EOS ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]):
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=self.stop_token_ids or None)

    def grammar(self, key: GrammarKey) -> str:
        """LLGuidance's grammar text for a constraint (not yet checked)."""
        schema_type, schema = key
        if schema_type == "json":
            value = json.loads(schema)
            if value is False:
                raise GrammarError("the JSON schema `false` allows no value; send a schema "
                                   "object")
            value = {} if value is True else strict_schema(value)
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
        if schema_type == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=_JSON_OPTIONS)
        if schema_type == "regex":
            return llguidance.LLMatcher.grammar_from_regex(schema)
        if schema_type == "ebnf":
            try:
                return llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark(schema))
            except Exception as exc:  # noqa: BLE001 - its parser raises plain exceptions
                raise GrammarError(f"invalid EBNF grammar: {exc}") from None
        if schema_type == "structural_tag":
            raise GrammarError("structural tags (tool_choice 'auto' grammars) are compiled by "
                               "XGrammar; use the 'auto' or 'xgrammar' backend")
        raise GrammarError(f"unknown schema_type {schema_type!r}")

    def compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        """A pristine matcher for `key` (thread-safe: LLGuidance drops the GIL to compile).

        Raises:
            GrammarError: LLGuidance refuses the constraint (its message says which keyword).
        """
        grammar = self.grammar(key)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer)
        if is_error:
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                    "ebnf": "EBNF grammar"}.get(key[0], key[0])
            raise GrammarError(f"invalid or unsupported {what} (LLGuidance): "
                               f"{messages[0] if messages else 'no reason given'}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the constraint could not be compiled (LLGuidance): "
                               f"{matcher.get_error()}")
        bitmask = self.allocate_bitmask(1)
        llg_torch.fill_next_token_bitmask(matcher.deep_copy(), bitmask, 0)
        if not bitmask.any():
            raise GrammarError("the constraint matches no string this model's tokens can "
                               "spell (no token can start it); fix the regex, schema or grammar")
        return matcher

    def matcher(self, compiled: llguidance.LLMatcher, stop_token_ids: list[int]
                ) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy(), self.stop_token_ids, stop_token_ids)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
