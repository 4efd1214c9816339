"""`SamplingParams`: how one request samples and when it stops. DeepInfer-compatible names.

Pure module: no torch import. Validation raises `ValueError` with the value, the consequence and
the fix, so the server can return it as a 400 as is; a field out of range raises its subclass
`SamplingParamsError`, whose `param` names the field.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

_SO_SCHEMA_TYPES = ("json", "regex", "ebnf", "json_object", "structural_tag")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
_INT_FIELDS = ("top_k", "max_tokens", "min_tokens", "logprobs", "n", "seed")
_OPTIONAL_FIELDS = ("max_tokens", "logprobs", "seed")
# Counts and ids the engine packs into int32/int64 tensors (top_k, token ids, lengths): anything
# larger than this is refused here, before it reaches a step (top_k = 2**63 overflowed the
# sampler's int64 tensor and killed the step loop for every request).
MAX_INT32 = 2**31 - 1
# stop strings a request may carry, and characters each: every new character of the output is
# checked against each of them in the engine's step loop (a request with 10,000 stop strings of
# 1,000 characters slowed every request on its server ~25x); OpenAI takes 4 strings
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
SEED_RANGE = (-(2**63), 2**64 - 1)   # a signed or an unsigned 64-bit seed


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_integer(value) or isinstance(value, float)


class SamplingParamsError(ValueError):
    """A SamplingParams field out of range; `param` names it (the OpenAI request field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_p, top_k, min_p: nucleus, top-k (-1 or 0 = off) and min-p (0 = off) filters.
    repetition_penalty: >1 discourages tokens already in prompt or output (CTRL, Keskar 2019).
    presence_penalty, frequency_penalty: OpenAI's additive penalties over output tokens.
    max_tokens: new tokens to generate at most (None = up to the context window).
    min_tokens: EOS, stop_token_ids and stop strings are suppressed until this many tokens
        exist (a stop string only counts in text generated after that, as in vLLM).
    stop: strings that end generation; never included in the output text.
    stop_token_ids: token ids that end generation (in addition to EOS unless ignore_eos).
    ignore_eos: keep generating past EOS.
    seed: per-request seed (alias `seq_seed`, DeepInfer's name). The same seed and prompt give the
        same tokens whatever else is batched with the request. None = a random 64-bit seed.
    logprobs: return this many top logprobs per output token (None = no logprobs; 0 = only the
        sampled token's).
    prompt_logprobs: unsupported for now (must be None).
    n: choices per prompt; each runs as its own request (`fan_out`).
    skip_special_tokens: drop special tokens when detokenizing.
    so_args: structured output, `{"schema_type": "json"|"regex"|"ebnf"|"json_object",
        "schema": ..., "backend": "auto"|"xgrammar"|"guidance" (optional)}` (enforced by
        engine/structured).
    cache_salt: requests with different salts share no prefix-cache or KV-store block (vLLM's
        `cache_salt`): one user's cached prompt cannot be probed by another. None = shared.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    seq_seed: int | None = None  # DeepInfer's name for `seed`; kept equal to it
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    so_args: dict[str, Any] | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.seq_seed is not None:
            if self.seed is not None and self.seed != self.seq_seed:
                raise ValueError(f"seed={self.seed} and seq_seed={self.seq_seed} disagree; "
                                 "give only one of them.")
            self.seed = self.seq_seed
        self.seq_seed = self.seed
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _check_types(self) -> None:
        """Raises SamplingParamsError naming the first field of the wrong type (a float
        max_tokens or a string temperature is refused, not rounded or compared)."""
        for name in _FLOAT_FIELDS:
            if not _is_number(getattr(self, name)):
                raise SamplingParamsError(f"{name}={getattr(self, name)!r} must be a number.",
                                          name)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not (_is_integer(value) or (value is None and name in _OPTIONAL_FIELDS)):
                raise SamplingParamsError(f"{name}={value!r} must be an integer"
                                          f"{' or None' if name in _OPTIONAL_FIELDS else ''}.",
                                          name)
        if not (self.stop is None or isinstance(self.stop, (str, list, tuple))):
            raise SamplingParamsError(f"stop={self.stop!r} must be a string or a list of "
                                      "strings.", "stop")
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple))):
            raise SamplingParamsError(f"stop_token_ids={self.stop_token_ids!r} must be a list "
                                      "of token ids.", "stop_token_ids")
        if not (self.cache_salt is None or (isinstance(self.cache_salt, str)
                                            and self.cache_salt)):
            raise SamplingParamsError(f"cache_salt={self.cache_salt!r} must be a non-empty "
                                      "string or None.", "cache_salt")
        if not (self.so_args is None or isinstance(self.so_args, dict)):
            raise SamplingParamsError(
                f"so_args={self.so_args!r} must be a dict like {{'schema_type': 'regex', "
                "'schema': '...'}.", "so_args")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def resolved_seed(self) -> int:
        """The seed to sample with: the given one, or a fresh random 64-bit value."""
        return self.seed if self.seed is not None else secrets.randbits(64)

    def _validate(self) -> None:
        """Raises SamplingParamsError (a ValueError) naming the first bad field."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise SamplingParamsError(f"{name}={value} is not a finite number; send a "
                                          "finite value.", name)
        for name, low, high in (("top_k", -1, MAX_INT32), ("max_tokens", 1, MAX_INT32),
                                ("min_tokens", 0, MAX_INT32), ("n", 1, MAX_INT32),
                                ("seed", *SEED_RANGE)):
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise SamplingParamsError(f"{name}={value} is outside [{low}, {high}], the "
                                          "range the engine can represent; send a value in "
                                          "it.", name)
        checks = [
            ("temperature", 0.0 <= self.temperature,
             f"temperature={self.temperature} must be a finite number >= 0."),
            ("top_p", 0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must be in (0, 1]."),
            ("top_k", self.top_k == -1 or self.top_k >= 0,
             f"top_k={self.top_k} must be -1 (off) or >= 0."),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"min_p={self.min_p} must be in [0, 1]."),
            ("repetition_penalty", 0.0 < self.repetition_penalty,
             f"repetition_penalty={self.repetition_penalty} must be a finite number > 0."),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty={self.presence_penalty} must be in [-2, 2]."),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]."),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}."),
            ("stop", all(isinstance(s, str) and s for s in self.stop),
             "stop strings must be non-empty strings."),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS,
             f"{len(self.stop)} stop strings given; at most {MAX_STOP_STRINGS} are allowed."),
            ("stop", all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
             f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long; one has "
             f"{max(map(len, self.stop), default=0)}."),
            ("stop_token_ids", all(_is_integer(t) and 0 <= t <= MAX_INT32
                                   for t in self.stop_token_ids),
             f"stop_token_ids must be integers in [0, {MAX_INT32}] (token ids)."),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs={self.logprobs} must be between 0 and 20."),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(message, param)
        if self.so_args is not None:
            kind = self.so_args.get("schema_type")
            if kind not in _SO_SCHEMA_TYPES:
                raise ValueError(f"so_args schema_type={kind!r} is not one of {_SO_SCHEMA_TYPES}.")
            unknown = sorted(set(self.so_args) - {"schema_type", "schema", "backend"})
            if unknown:
                raise SamplingParamsError(f"so_args has unknown keys {unknown}; it takes "
                                          "schema_type, schema and backend.", "so_args")
            # a stop string would cut the output before its grammar is complete
            if self.stop:
                raise ValueError(f"stop={self.stop!r} cannot be combined with so_args: a "
                                 "constrained output ends when its grammar is complete; drop "
                                 "stop (stop_token_ids are fine).")
            # the grammar decides where the output ends: it allows EOS only there
            if self.ignore_eos:
                raise ValueError("ignore_eos=True cannot be combined with so_args: a constrained "
                                 "output ends when its grammar is complete; drop ignore_eos.")
            if self.min_tokens:
                raise ValueError(f"min_tokens={self.min_tokens} cannot be combined with so_args: "
                                 "a constrained output ends when its grammar is complete; drop "
                                 "min_tokens.")

    def clone(self, **changes: Any) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(changes)
        return SamplingParams(**values)

    def fan_out(self, n: int | None = None) -> list["SamplingParams"]:
        """Params for each of n choices (default: self.n), each with n=1: with a seed, choice i
        samples with seed + i (wrapped below 2^64; vLLM's rule), so choices differ and each is
        reproducible; without one each draws its own random seed."""
        n = self.n if n is None else n
        if self.seed is None:
            return [self.clone(n=1) for _ in range(n)]
        seeds = [self.seed + i - ((1 << 64) if self.seed + i >= (1 << 64) else 0)
                 for i in range(n)]
        return [self.clone(n=1, seed=seed, seq_seed=seed) for seed in seeds]
