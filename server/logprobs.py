"""Engine `TokenLogprobs` -> OpenAI's two logprobs shapes.

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`, the top list as the engine ranked it (`top_logprobs` entries).
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`;
  each top dict holds the `logprobs` most likely tokens plus the sampled one (with the sampled
  token's own logprob), and text_offset is the character offset of each token in the choice's
  text, carried across stream chunks (a token holding part of a character points at it).

A token's text is `decode([id])`; its `bytes` are exact even when the token is part of a UTF-8
character (byte-level BPE and `<0xNN>` byte-fallback tokens), where the text shows U+FFFD.
Completions name tokens by string alone, so such a token is spelled by its bytes,
`bytes:\\xf0\\x9f` (vLLM's convention), distinct per token; two different tokens that still
share a spelling in one top dict are told apart as `token_id:N` (vLLM's other spelling).
Chat logprobs leave out the token that stopped the request (EOS, a stop_token_id): the text
does not show it. Logprobs of -inf (a token the filters removed) are sent as -9999.0, since
JSON has no infinity.
"""

from __future__ import annotations

import codecs
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

    def spelling(self, token_id: int) -> str:
        """The token's name in completions logprobs: its text, or `bytes:\\xNN...` where the
        token holds part of a UTF-8 character (its text alone would be U+FFFD)."""
        text, raw = self(token_id)
        if "\ufffd" in text and bytes(raw) != text.encode("utf-8"):
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text


def shown_logprobs(entries: list[TokenLogprobs], finish_reason: str | None,
                   stop_reason: int | str | None) -> list[TokenLogprobs]:
    """`entries` (a choice's last ones) without the token that stopped it, EOS or a
    stop_token_id (`finish_reason == "stop"`, a non-string `stop_reason`): the engine leaves
    that token's text out of the output, so its logprob is not listed either."""
    if entries and finish_reason == "stop" and not isinstance(stop_reason, str):
        return entries[:-1]
    return entries


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
        # the characters a token's bytes complete (a partial character waits for the rest)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, entries: list[TokenLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in entries:
            names = self._names(entry)
            logprob = clean_logprob(entry.logprob)
            top = {names[t]: clean_logprob(lp) for t, lp in entry.top}
            top[names[entry.token_id]] = logprob   # the sampled token's own value
            out.tokens.append(names[entry.token_id])
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(self._utf8.decode(bytes(self._decode(entry.token_id)[1])))
        return out

    def _names(self, entry: TokenLogprobs) -> dict[int, str]:
        """Token id -> its key in this position's top dict, one key per id (the sampled
        token keeps its spelling; a later id whose spelling is taken gets `token_id:N`)."""
        names: dict[int, str] = {}
        for token_id in [entry.token_id, *(t for t, _ in entry.top)]:
            if token_id not in names:
                name = self._decode.spelling(token_id)
                names[token_id] = name if name not in names.values() else f"token_id:{token_id}"
        return names


def merge_completion_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    merged = CompletionLogprobs()
    for part in parts:
        merged.tokens += part.tokens
        merged.token_logprobs += part.token_logprobs
        merged.top_logprobs += part.top_logprobs
        merged.text_offset += part.text_offset
    return merged
