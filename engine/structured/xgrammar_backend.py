"""The XGrammar adapter: `GrammarBackend` over `xgrammar.GrammarCompiler` / `GrammarMatcher`.

XGrammar (Dong et al. 2024, arXiv 2411.15100) compiles a JSON schema, regex or EBNF grammar into
a pushdown automaton with a per-state token-mask cache; a matcher then yields the allowed next
tokens as a bitmask in microseconds. Compilation releases the GIL, so compiling in a worker
thread does not stall the step loop.

JSON is generated compactly: `any_whitespace=False` fixes the separators to `", "` and `": "`
(the ones `json.dumps` writes), so a model cannot run away into endless whitespace.
`strict_mode=True` for schemas: properties and items not in the schema are not generated (the
output still validates; OpenAI's strict structured outputs behave this way).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

import torch
import xgrammar as xgr

from deepinfer.engine.structured.backend import GrammarError, GrammarKey
from deepinfer.engine.structured.enforceable import LOOKAROUND, check_enforceable

# "[13:57:30] /project/cpp/regex_converter.cc:94: Check failed: (x) is false: message"
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean_error(exc: Exception) -> str:
    """XGrammar's C++ error text without its timestamp / source-file prefix."""
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()


def _declare_required(schema: Any) -> Any:
    """The schema with every `required` name that `properties` lacks declared as `{}` (any
    value), recursively. Strict mode generates declared properties only, so without this a
    schema such as `{"properties": {"a": ...}, "required": ["b"]}` could never be satisfied."""
    if isinstance(schema, list):
        return [_declare_required(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: value if key in ("enum", "const", "default", "examples")
              else _declare_required(value) for key, value in schema.items()}
    required = schema.get("required")
    properties = schema.get("properties", {})
    if (isinstance(required, list) and isinstance(properties, dict)
            and schema.get("additionalProperties") is not False):
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        if missing:
            schema["properties"] = {**properties, **{name: {} for name in missing}}
    return schema


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Each token id's bytes as the model spells them (XGrammar's decoded vocabulary)."""
    return list(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
                .decoded_vocab)


class XGrammarMatcher:
    """`GrammarMatcher` over `xgrammar.GrammarMatcher` (see backend.py for the contract)."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]):
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend:
    """Args:
        tokenizer: the Hugging Face tokenizer of the served model.
        vocab_size: columns of the model's logits (may exceed the tokenizer's vocabulary: the
            extra ids are never allowed).
        stop_token_ids: the tokens that end an output (EOS ids); a grammar allows them only
            where its sentence is complete.
        max_threads: threads XGrammar uses to build one grammar's mask cache.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int],
                 max_threads: int = 2):
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        # our own LRU (manager.py) caches compiled grammars; XGrammar's would hold a second copy
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        """Compile, and refuse a constraint no token can start (a character class that
        matches nothing, say): generating under it could only emit tokens it forbids."""
        compiled = self._compile(key)
        bitmask = self.allocate_bitmask(1)
        self.matcher(compiled, self.stop_token_ids).fill_bitmask(bitmask, 0)
        if not bitmask.any():
            raise GrammarError("the constraint matches no string this model's tokens can "
                               "spell (no token can start it); fix the regex, schema or grammar")
        return compiled

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        schema_type, schema = key
        try:
            if schema_type == "json":
                schema = json.loads(schema)
                if isinstance(schema, bool):    # `true` allows any JSON value, `false` none
                    if not schema:
                        raise GrammarError("the JSON schema `false` allows no value; send a "
                                           "schema object")
                    schema = {}
                check_enforceable(schema)
                return self._compiler.compile_json_schema(
                    _declare_required(schema), any_whitespace=False, strict_mode=True)
            if schema_type == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}',
                                                          any_whitespace=False,
                                                          strict_mode=False)
            if schema_type == "regex":
                if LOOKAROUND.search(schema):
                    raise GrammarError("the regex uses a lookahead or lookbehind, which cannot "
                                       "be enforced while generating; rewrite it without one")
                return self._compiler.compile_regex(schema)
            if schema_type == "ebnf":
                return self._compiler.compile_grammar(schema)
            if schema_type == "structural_tag":
                return self._compiler.compile_structural_tag(schema)
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as exc:
            what = {"json": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar",
                    "structural_tag": "structural tag"}[schema_type]
            raise GrammarError(f"invalid or unsupported {what}: {_clean_error(exc)}") from None
        raise GrammarError(f"unknown schema_type {schema_type!r}")

    def matcher(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]
                ) -> XGrammarMatcher:
        return XGrammarMatcher(compiled, stop_token_ids)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set disallowed tokens of the given rows to -inf, in place.

    Args:
        logits: [B, V] float32, on any device.
        bitmask: [B, ceil(V / 32)] int32 (CPU); bit `t % 32` of word `t // 32` of row r set =
            token t allowed in row r. Rows not in `rows` are left alone.
        rows: logits rows under a grammar.
    """
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=rows)
