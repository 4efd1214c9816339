"""Engine `TokenLogprobs` -> OpenAI's two logprobs shapes.

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`, the top list as the engine ranked it (`top_logprobs` entries).
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`;
  each top dict holds the `logprobs` most likely tokens plus the sampled one, and text_offset is
  the character offset of each token in the choice's text, carried across stream chunks.

A token's text is `decode([id])`; its `bytes` are exact even when the token is part of a UTF-8
character (byte-level BPE and `<0xNN>` byte-fallback tokens), where the text shows U+FFFD.
Logprobs of -inf (a token the filters removed) are sent as -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

import math
import re
from typing import Any

from deepinfer.engine.outputs import TokenLogprobs
from deepinfer.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

_FLOOR = -9999.0
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-unicode table, inverted: unicode char -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_decoder()


def clean_logprob(value: float) -> float:
    if math.isnan(value):
        return _FLOOR
    return max(float(value), _FLOOR)


class TokenDecoder:
    """Token id -> (text, UTF-8 bytes), cached; one per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._decode(token_id)
        return hit

    def _decode(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        raw = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(raw, str):
            fallback = _BYTE_FALLBACK.match(raw)
            if fallback:
                return text, [int(fallback.group(1), 16)]
            if raw and all(ch in _BYTE_LEVEL for ch in raw):
                return text, [_BYTE_LEVEL[ch] for ch in raw]
        return text, list(text.encode("utf-8"))


def chat_logprobs(decode: TokenDecoder, entries: list[TokenLogprobs]) -> ChatLogprobs:
    content = []
    for entry in entries:
        text, raw = decode(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            top_text, top_raw = decode(token_id)
            top.append(TopLogprob(token=top_text, logprob=clean_logprob(logprob), bytes=top_raw))
        content.append(ChatTokenLogprob(token=text, logprob=clean_logprob(entry.logprob),
                                        bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


class CompletionLogprobsBuilder:
    """Builds completions logprobs for one choice, chunk by chunk, keeping the text offset."""

    def __init__(self, decode: TokenDecoder, start_offset: int = 0) -> None:
        self._decode = decode
        self.offset = start_offset

    def add(self, entries: list[TokenLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in entries:
            text, _ = self._decode(entry.token_id)
            top = {self._decode(t)[0]: clean_logprob(lp) for t, lp in entry.top}
            top.setdefault(text, clean_logprob(entry.logprob))
            out.tokens.append(text)
            out.token_logprobs.append(clean_logprob(entry.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def merge_completion_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    merged = CompletionLogprobs()
    for part in parts:
        merged.tokens += part.tokens
        merged.token_logprobs += part.token_logprobs
        merged.top_logprobs += part.top_logprobs
        merged.text_offset += part.text_offset
    return merged
