"""The grammar-backend protocol and the key a constraint is compiled and cached under.

A constraint is `SamplingParams.so_args = {"schema_type": ..., "schema": ...}`:

| schema_type   | schema                                   | output                         |
| ------------- | ---------------------------------------- | ------------------------------ |
| "json"        | a JSON schema (dict or JSON text)         | JSON that validates against it |
| "json_object" | ignored                                   | any JSON object                |
| "regex"       | a regular expression (str)                | a full match of it             |
| "ebnf"        | an EBNF grammar with a `root` rule (str)  | a sentence of the grammar      |
| "structural_tag" | an XGrammar structural tag (dict / JSON) | free text; after a trigger, its tag |

An optional `"backend"` key picks the grammar backend: "xgrammar", "guidance" (LLGuidance) or
"auto" (vLLM's spellings; see manager.py for what "auto" picks).

Pure module: no torch, no xgrammar. The shape of XGrammar's API (compile once, then one matcher
per sequence that accepts tokens, fills a bitmask and rolls back; STYLE.md #11) is the protocol.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

GrammarKey = tuple[str, str]  # (schema_type, canonical schema text)
BACKENDS = ("auto", "xgrammar", "guidance")
# characters of a constraint's canonical text at most: compiling grows with it (20,000 choices
# as one regex held two CPU cores for minutes; 400 choices, 63.5K characters, took 0.46 s with
# SmolLM2's tokenizer and 2 threads on a 2-core CPU machine)
MAX_SCHEMA_CHARS = 1 << 16
# JSON schemas compile in time with their size, not with choices multiplied out: Kubernetes
# schemas of JSONSchemaBench (~160K characters) took 0.15 s (LLGuidance) / 1.8 s (XGrammar)
MAX_JSON_SCHEMA_CHARS = 1 << 18


class GrammarError(ValueError):
    """The constraint cannot be compiled: a bad JSON schema, regex or grammar (HTTP 400)."""


def grammar_key(so_args: dict[str, Any]) -> GrammarKey:
    """`_canonical_key`, refused when its text is longer than MAX_SCHEMA_CHARS.

    Raises:
        GrammarError: as `_canonical_key`, or the constraint is too long to compile quickly.
    """
    key = _canonical_key(so_args)
    limit = MAX_JSON_SCHEMA_CHARS if key[0] == "json" else MAX_SCHEMA_CHARS
    if len(key[1]) > limit:
        raise GrammarError(f"the constraint's text is {len(key[1])} characters; the limit is "
                           f"{limit}. Shorten it (fewer choices, a smaller schema or "
                           "grammar)")
    return key


def backend_choice(so_args: dict[str, Any], default: str) -> str:
    """The backend a constraint asks for (`so_args["backend"]`), else `default`.

    Raises:
        GrammarError: not one of BACKENDS.
    """
    choice = so_args.get("backend") or default
    if choice not in BACKENDS:
        raise GrammarError(f"structured-outputs backend {choice!r} is not one of "
                           f"{', '.join(BACKENDS)}; send one of them or leave it out.")
    return choice


def _canonical_key(so_args: dict[str, Any]) -> GrammarKey:
    """The cache key of a constraint: (schema_type, canonical text of its schema).

    A JSON schema is re-serialized compactly (keys keep their order: it decides the order in
    which properties are generated), so equal schemas written differently share one entry.

    Raises:
        GrammarError: the schema has the wrong type or is not valid JSON.
    """
    schema_type = so_args.get("schema_type")
    schema = so_args.get("schema")
    if schema_type == "json_object":
        return schema_type, ""
    if schema_type == "json":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON ({exc}); send a JSON "
                                   "object.") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}"
                               "; send a JSON schema object such as {\"type\": \"object\"}.")
        return schema_type, json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if schema_type == "structural_tag":
        if not isinstance(schema, (dict, str)) or not schema:
            raise GrammarError("so_args schema for schema_type='structural_tag' must be a "
                               f"structural tag (a dict or its JSON text), got {schema!r}.")
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False,
                                                                 separators=(",", ":"))
        return schema_type, text
    if schema_type in ("regex", "ebnf"):
        if not isinstance(schema, str) or not schema:
            raise GrammarError(f"so_args schema for schema_type={schema_type!r} must be a "
                               f"non-empty string, got {schema!r}.")
        return schema_type, schema
    raise GrammarError(f"so_args schema_type={schema_type!r} is not one of 'json', "
                       "'json_object', 'regex', 'ebnf', 'structural_tag'.")


class GrammarMatcher(Protocol):
    """The state of one sequence under a compiled grammar (output tokens only, no prompt)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([B, ceil(V / 32)] int32, bit
        `t % 32` of word `t // 32` set = token t allowed)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""

    def is_terminated(self) -> bool:
        """True once a stop token was accepted: the output is complete."""


class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer and vocabulary size."""

    vocab_size: int  # columns of the logits the bitmask covers

    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar for `key`. Thread-safe; may take seconds.

        Raises:
            GrammarError: the schema, regex or grammar is invalid or unsupported.
        """

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> GrammarMatcher:
        """A fresh matcher at the start of the output; `stop_token_ids` end the output and are
        allowed only where the grammar's sentence is complete."""

    def allocate_bitmask(self, num_rows: int) -> Any:
        """[num_rows, ceil(vocab_size / 32)] int32 CPU tensor, every token allowed."""
