"""Bounded JSON numbers: at most `INTEGER_DIGITS` digits before the point, `FRACTION_DIGITS`
after it and `EXPONENT_DIGITS` in the exponent, for every JSON constraint and both backends.

A JSON schema says `"type": "number"` and no more; both grammar backends then allow a number of
any length, and a model that starts `1000000` at low temperature can write zeros until
`max_tokens` (unparseable JSON). As whitespace is never free, digits are not free either: a
`DigitBoundMatcher` wraps a backend's matcher and, outside JSON strings, forbids the tokens
that would make a run of digits longer than its bound. The bounds are far above what a schema
means by a number (an int64 has 19 digits, a float64 17 significant digits, a largest exponent
of 308), so they only end runaways; a schema whose own bounds need more digits (`"minimum":
1e25`, or anything at or past 2**63) is refused by `check_bounds_fit`, and where the grammar allows nothing but more digits
(a `multipleOf` not yet met) the grammar wins.

Tokens are read as bytes (digits, quotes and backslashes are ASCII, so byte-level tokens spell
them whole). Per tokenizer, `DigitTables` precomputes one allowed-token bitmask per number of
digits still allowed, so the per-token cost is one AND of a bitmask row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.engine.structured.backend import GrammarError, GrammarMatcher

INTEGER_DIGITS, FRACTION_DIGITS, EXPONENT_DIGITS = 20, 17, 3
MAX_BOUND = 2 ** 63   # a schema's minimum / maximum at or past it is refused (check_bounds_fit)
_BOUND = {"integer": INTEGER_DIGITS, "fraction": FRACTION_DIGITS, "exponent": EXPONENT_DIGITS}
_DIGITS = frozenset(b"0123456789")


@dataclass(frozen=True)
class _Scan:
    """Where the output stands, as far as digit runs care (outside strings only)."""

    in_string: bool = False
    escape: bool = False
    run: int = 0              # digits in the run that ends the output so far
    kind: str = "integer"     # which part of a number that run (or the next one) is
    prev: int = 0             # last byte outside strings
    prev2: int = 0            # the byte before it


def _next_kind(prev: int, prev2: int) -> str:
    """The part of a number that a digit run starting after bytes (prev2, prev) is."""
    if prev == ord("."):
        return "fraction"
    if prev in b"eE" or (prev in b"+-" and prev2 in b"eE"):
        return "exponent"
    return "integer"


def scan(state: _Scan, data: bytes) -> tuple[_Scan, bool]:
    """(the state after `data`, whether every digit run outside strings stayed in bounds)."""
    in_string, escape, run, kind = state.in_string, state.escape, state.run, state.kind
    prev, prev2, ok = state.prev, state.prev2, True
    for byte in data:
        if in_string:
            if escape:
                escape = False
            elif byte == 0x5C:                 # backslash
                escape = True
            elif byte == 0x22:                 # closing quote
                in_string, prev, prev2 = False, byte, prev
            continue
        if byte in _DIGITS:
            if run == 0:
                kind = _next_kind(prev, prev2)
            run += 1
            ok = ok and run <= _BOUND[kind]
        else:
            run = 0
            in_string = byte == 0x22
        prev, prev2 = byte, prev
    return _Scan(in_string, escape, run, kind, prev, prev2), ok


class DigitTables:
    """Per tokenizer: `mask(state)` -> the [ceil(V / 32)] int32 bitmask of the tokens that keep
    every digit run in bounds from `state` (None: no restriction).

    Args:
        token_bytes: each token id's bytes (special tokens: their text; no digits matter).
        vocab_size: columns of the logits (ids past `token_bytes` are never allowed anyway).
    """

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int):
        self.token_bytes = list(token_bytes)
        self.vocab_size = vocab_size
        num = len(self.token_bytes)
        lead = np.zeros(num, np.int64)
        rest_ok = np.ones(num, bool)      # runs after the leading one stay in bounds
        string_ok = np.ones(num, bool)    # from inside a string, runs after it stay in bounds
        for token_id, data in enumerate(self.token_bytes):
            digits = len(data) - len(data.lstrip(b"0123456789"))
            lead[token_id] = digits
            if digits < len(data):
                # the leading run's own bound is the caller's; scan the rest from the byte
                # that ends it
                rest = data[digits:]
                after = _Scan(prev=ord("0") if digits else 0)
                rest_ok[token_id] = scan(after, rest)[1]
            string_ok[token_id] = scan(_Scan(in_string=True), data)[1]
        max_bound = max(_BOUND.values())
        self._outside = [self._pack(rest_ok & (lead <= k)) for k in range(max_bound + 1)]
        self._string = self._pack(string_ok)

    def _pack(self, allowed: np.ndarray) -> torch.Tensor:
        bits = np.zeros(((self.vocab_size + 31) // 32) * 32, bool)
        bits[:len(allowed)] = allowed[:self.vocab_size]
        return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())

    def mask(self, state: _Scan) -> torch.Tensor | None:
        if state.escape:
            return None                   # the next byte is escaped: no run can start or end
        if state.in_string:
            return self._string
        kind = state.kind if state.run else _next_kind(state.prev, state.prev2)
        return self._outside[max(0, _BOUND[kind] - state.run)]


class DigitBoundMatcher:
    """A `GrammarMatcher` whose JSON output keeps every digit run within its bound (see the
    module doc); the wrapped matcher decides everything else."""

    def __init__(self, inner: GrammarMatcher, tables: DigitTables):
        self._inner = inner
        self._tables = tables
        self._states = [_Scan()]          # one per accepted token, for rollback

    def accept_token(self, token_id: int) -> bool:
        if not self._inner.accept_token(token_id):
            return False
        data = (self._tables.token_bytes[token_id]
                if token_id < len(self._tables.token_bytes) else b"")
        self._states.append(scan(self._states[-1], data)[0])
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner.fill_bitmask(bitmask, row)
        allowed = self._tables.mask(self._states[-1])
        if allowed is not None:
            bounded = bitmask[row] & allowed
            if bounded.any():     # else the grammar itself needs more digits (`multipleOf`)
                bitmask[row] = bounded

    def rollback(self, num_tokens: int) -> None:
        self._inner.rollback(num_tokens)
        del self._states[len(self._states) - num_tokens:]

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()


def check_bounds_fit(schema: Any, path: str = "#") -> None:
    """Refuse a schema whose `minimum` / `maximum` (or the exclusive ones) is at or past
    MAX_BOUND (2**63, under INTEGER_DIGITS' 10**20): past it LLGuidance clamps to int64 and
    XGrammar rounds through float64, so outputs could break the bound."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_bounds_fit(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                abs(value) >= MAX_BOUND):
            raise GrammarError(f"'{key}': {json.dumps(value)} at {path} is past 2**63, beyond "
                               "what the grammar backends enforce exactly (LLGuidance bounds "
                               "numbers as int64, XGrammar through float64); use a smaller "
                               "bound")
    for key, value in schema.items():
        if key not in ("enum", "const", "default", "examples") and isinstance(value,
                                                                              (dict, list)):
            check_bounds_fit(value, f"{path}/{key}")
