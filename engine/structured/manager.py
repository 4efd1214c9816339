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

The cache is an LRU of `max_cached_grammars` entries keyed by `grammar_key(so_args)`; entries
are futures, so concurrent requests for one new schema compile it once. Failures are cached too
(a bad schema sent again is refused at once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any

from deepinfer.engine.structured.backend import GrammarBackend, GrammarError, GrammarMatcher, grammar_key


class StructuredOutputManager:
    """Args:
        backend_factory: builds the backend on first use (XGrammar's tokenizer info takes
            ~0.1 s; servers that never see a constraint never pay it, nor import xgrammar).
        max_cached_grammars: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, backend_factory: Callable[[], GrammarBackend],
                 max_cached_grammars: int = 128):
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.max_cached_grammars = max_cached_grammars

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def compile(self, so_args: dict[str, Any]) -> Any:
        """The compiled grammar of a constraint, from the cache or compiled now (thread-safe).

        Raises:
            GrammarError (a ValueError): the constraint is invalid; the message says why.
        """
        key = grammar_key(so_args)
        backend = self.backend
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if owner:
                future = self._cache[key] = Future()
                while len(self._cache) > self.max_cached_grammars:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                future.set_result(backend.compile(key))
            except GrammarError as exc:
                future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - a backend bug must not hang other waiters
                future.set_exception(GrammarError(f"the constraint could not be compiled: {exc}"))
        return future.result()

    def new_matcher(self, so_args: dict[str, Any], output_token_ids: Sequence[int],
                    stop_token_ids: Collection[int]) -> GrammarMatcher:
        """A matcher for one request that has already produced `output_token_ids`.

        Raises:
            GrammarError: the constraint is invalid, or the tokens do not follow it.
        """
        matcher = self.backend.matcher(self.compile(so_args), sorted(stop_token_ids))
        for position, token_id in enumerate(output_token_ids):
            if not matcher.accept_token(token_id):
                raise GrammarError(f"output token {token_id} at position {position} does not "
                                   "follow the grammar.")
        return matcher

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher | None]) -> tuple[Any, list[int]]:
        """The bitmask of one step's sampling rows.

        Args:
            matchers: per logits row, its request's matcher, or None for a free row.
        Returns:
            ([B, ceil(V / 32)] int32 CPU tensor, rows under a grammar); free rows allow all.
        """
        bitmask = self.backend.allocate_bitmask(len(matchers))
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        for row in rows:
            matchers[row].fill_bitmask(bitmask, row)
        return bitmask, rows


def xgrammar_manager(tokenizer: Any, vocab_size: int,
                     eos_token_ids: Collection[int]) -> StructuredOutputManager:
    """The default manager: XGrammar over the served model's tokenizer (imported lazily)."""

    def factory() -> GrammarBackend:
        from deepinfer.engine.structured.xgrammar_backend import XGrammarBackend
        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)

    return StructuredOutputManager(factory)
