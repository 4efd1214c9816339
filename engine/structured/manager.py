"""`StructuredOutputManager`: compile cache + one grammar matcher per request.

Who calls what:
- `compile(so_args)` — any thread. `AsyncLLM.generate` runs it in a worker thread before the
  request is queued, so an invalid constraint is refused before queueing and a slow schema
  never stalls the step loop; `EngineCore.make_request` runs it too (then a cache hit).
- `new_matcher(...)` — the model runner (step loop), when a request (re)enters the batch: the
  matcher is rebuilt from the output tokens so far, so preemption by recompute, prefix-cache
  hits and n > 1 (one engine request per choice) need nothing else.
- `fill_bitmask(matchers)` — the model runner, once per step for the rows that sample.

Ending: a matcher allows the request's stop tokens (EOS ids and `stop_token_ids`) only where the
grammar's sentence is complete; sampling one ends the request with finish_reason "stop" through
the scheduler's usual token stop rule, and the matcher is then terminated. (So `so_args` refuses
`ignore_eos` and `min_tokens`, which would fight the grammar over where the output ends.)

Two backends (`BACKENDS`): XGrammar and LLGuidance. `so_args["backend"]` (else the manager's
default, `--structured-outputs-backend`) picks one; "auto" compiles a JSON schema with XGrammar
when every keyword of it is enforceable there (`check_enforceable`), else with LLGuidance, and
regexes, EBNF grammars and `json_object` with XGrammar. Structural tags (tool_choice "auto":
free text, then a call under its tool's schema) are XGrammar's whatever the choice. A schema neither backend can enforce is
refused with both reasons (XGrammar's names the keyword and its path). Before either, every JSON
schema passes `check_valid` (its metaschema; `const` / `enum` values that fit the rest of it),
so both backends refuse an invalid or contradictory schema with the same message.

JSON outputs (`json`, `json_object`) are matched through `DigitBoundMatcher`, whatever the
backend: numbers have bounded digits (number_bounds.py), as whitespace is never free.

The cache is an LRU of `max_cached_grammars` entries keyed by (backend asked for,
`grammar_key(so_args)`); entries are futures, so concurrent requests for one new schema compile
it once. Failures are cached too (a bad schema sent again is refused at once).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.structured.backend import (BACKENDS, GrammarBackend, GrammarError,
                                                 GrammarKey, GrammarMatcher, backend_choice,
                                                 grammar_key)
from deepinfer.engine.structured.enforceable import (check_enforceable, check_ref_cycles,
                                                     exclusive_one_of)
from deepinfer.engine.structured.validity import check_valid


@dataclass(frozen=True)
class Compiled:
    """A compiled constraint and the backend ("xgrammar" | "guidance") that compiled it."""

    backend: str
    grammar: Any
    json_output: bool     # the output is JSON: its numbers' digits are bounded


class StructuredOutputManager:
    """Args:
        backend_factories: backend name ("xgrammar", "guidance") -> builds it on first use
            (XGrammar's tokenizer info takes ~0.1 s, LLGuidance's ~0.8 s; servers that never
            see a constraint never pay it, nor import either library).
        default_backend: "auto", "xgrammar" or "guidance", for requests that name none.
        digit_tables_factory: builds the `DigitTables` of the tokenizer (first JSON output).
        max_cached_grammars: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, backend_factories: dict[str, Callable[[], GrammarBackend]],
                 default_backend: str = "auto",
                 digit_tables_factory: Callable[[], Any] | None = None,
                 max_cached_grammars: int = 128):
        if default_backend not in BACKENDS:
            raise ValueError(f"structured-outputs backend {default_backend!r} is not one of "
                             f"{BACKENDS}; pick one of them.")
        self._factories = backend_factories
        self.default_backend = default_backend
        self._digit_tables_factory = digit_tables_factory
        self._digit_tables: Any = None
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str], Future] = OrderedDict()
        self.max_cached_grammars = max_cached_grammars

    def get_backend(self, name: str) -> GrammarBackend:
        """The backend called `name`, built on first use (thread-safe)."""
        with self._lock:
            if name not in self._backends:
                self._backends[name] = self._factories[name]()
            return self._backends[name]

    @property
    def backend(self) -> GrammarBackend:
        """A backend for what all share (vocab_size, the bitmask layout): the first built."""
        with self._lock:
            built = next(iter(self._backends.values()), None)
        return built if built is not None else self.get_backend(next(iter(self._factories)))

    def compile(self, so_args: dict[str, Any]) -> Compiled:
        """The compiled grammar of a constraint, from the cache or compiled now (thread-safe).

        Raises:
            GrammarError (a ValueError): the constraint is invalid; the message says why.
        """
        key = grammar_key(so_args)
        choice = backend_choice(so_args, self.default_backend)
        with self._lock:
            future = self._cache.get((choice, *key))
            owner = future is None
            if owner:
                future = self._cache[(choice, *key)] = Future()
                while len(self._cache) > self.max_cached_grammars:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end((choice, *key))
        if owner:
            try:
                future.set_result(self._compile(choice, key))
            except GrammarError as exc:
                future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - a backend bug must not hang other waiters
                future.set_exception(GrammarError(f"the constraint could not be compiled: {exc}"))
        return future.result()

    def _compile(self, choice: str, key: GrammarKey) -> Compiled:
        json_output = key[0] in ("json", "json_object")
        if key[0] == "json":
            from deepinfer.engine.structured.number_bounds import check_bounds_fit
            schema = json.loads(key[1])
            check_valid(schema)
            schema = exclusive_one_of(schema)
            check_bounds_fit(schema)
            check_ref_cycles(schema)
            key = ("json", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))
        if key[0] == "structural_tag":    # tool-call grammars: XGrammar's structural tags
            return Compiled("xgrammar", self.get_backend("xgrammar").compile(key), False)
        if choice != "auto":
            return Compiled(choice, self.get_backend(choice).compile(key), json_output)
        if key[0] != "json" or "guidance" not in self._factories:
            return Compiled("xgrammar", self.get_backend("xgrammar").compile(key), json_output)
        try:
            check_enforceable(json.loads(key[1]))
            return Compiled("xgrammar", self.get_backend("xgrammar").compile(key), True)
        except GrammarError as xgrammar_reason:
            try:
                return Compiled("guidance", self.get_backend("guidance").compile(key), True)
            except GrammarError as guidance_reason:
                raise GrammarError(f"{xgrammar_reason} (XGrammar); LLGuidance cannot enforce "
                                   f"it either: {guidance_reason}") from None

    def new_matcher(self, so_args: dict[str, Any], output_token_ids: Sequence[int],
                    stop_token_ids: Collection[int]) -> GrammarMatcher:
        """A matcher for one request that has already produced `output_token_ids`.

        Raises:
            GrammarError: the constraint is invalid, or the tokens do not follow it.
        """
        compiled = self.compile(so_args)
        matcher = self.get_backend(compiled.backend).matcher(compiled.grammar,
                                                             sorted(stop_token_ids))
        if compiled.json_output and self._digit_tables_factory is not None:
            from deepinfer.engine.structured.number_bounds import DigitBoundMatcher
            matcher = DigitBoundMatcher(matcher, self._get_digit_tables())
        for position, token_id in enumerate(output_token_ids):
            if not matcher.accept_token(token_id):
                raise GrammarError(f"output token {token_id} at position {position} does not "
                                   "follow the grammar.")
        return matcher

    def _get_digit_tables(self) -> Any:
        with self._lock:
            if self._digit_tables is None:
                self._digit_tables = self._digit_tables_factory()
            return self._digit_tables

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher | None]) -> tuple[Any, list[int]]:
        """The bitmask of one step's sampling rows.

        Args:
            matchers: per logits row, its request's matcher, or None for a free row.
        Returns:
            ([B, ceil(V / 32)] int32 CPU tensor, rows under a grammar); free rows allow all.
            Both backends write this layout.
        """
        bitmask = self.backend.allocate_bitmask(len(matchers))
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        for row in rows:
            matchers[row].fill_bitmask(bitmask, row)
        return bitmask, rows


def grammar_manager(tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int],
                    default_backend: str = "auto") -> StructuredOutputManager:
    """The engine's manager: XGrammar and LLGuidance over the served model's tokenizer (each
    imported and built lazily), `default_backend` for requests that name none."""

    def xgrammar() -> GrammarBackend:
        from deepinfer.engine.structured.xgrammar_backend import XGrammarBackend
        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)

    def guidance() -> GrammarBackend:
        from deepinfer.engine.structured.guidance_backend import GuidanceBackend
        return GuidanceBackend(tokenizer, vocab_size, eos_token_ids)

    def digit_tables() -> Any:
        from deepinfer.engine.structured.number_bounds import DigitTables
        from deepinfer.engine.structured.xgrammar_backend import token_bytes
        return DigitTables(token_bytes(tokenizer, vocab_size), vocab_size)

    return StructuredOutputManager({"xgrammar": xgrammar, "guidance": guidance},
                                   default_backend, digit_tables)
