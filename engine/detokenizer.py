"""`IncrementalDetokenizer`: token ids in, only the new text out, never a broken character.

The prefix/read-offset technique of vLLM's `detokenize_incrementally` and TGI's `decode_token`:
decode a short window of tokens that starts a little before the new ones, and emit what the
window's text has beyond the text of its first part. Starting the window at an earlier token keeps
context-dependent decoding right (SentencePiece drops the leading space of a window's first
token; byte-level BPE needs the earlier bytes of a multi-byte character). The window moves
forward whenever its text ends on a complete character, so each step decodes O(1) tokens.

Broken UTF-8: byte-level tokenizers (GPT-2 style, SmolLM2, Llama 3, DeepSeek) and byte-fallback
SentencePiece split one character over several tokens; decoding a prefix of them gives U+FFFD.
Trailing U+FFFD characters are held back until a later token completes the character (or, at
`flush()`, until the request ends: then the text is whatever the full decode says). Only trailing
ones are held: a U+FFFD followed by more text is final (later bytes cannot change it).

Text semantics: the window starts with the last prompt tokens, so the output is the continuation
of the prompt's text (a SentencePiece first output token keeps its leading space, as in vLLM and
TGI). For byte-level tokenizers and a prompt that ends on a whole character this is exactly
`tokenizer.decode(output_ids, skip_special_tokens=...)`. `clean_up_tokenization_spaces` is off:
that clean-up rewrites text already streamed (" ." -> "."), so no streamer can honour it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5       # prompt tokens the first window starts with (vLLM's value)
_MAX_WINDOW_TOKENS = 64   # a longer window is moved on even if its text ends on U+FFFD
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool | None = ...) -> str: ...


def _stable_length(text: str) -> int:
    """Length of `text` without its trailing U+FFFD run (a character still being completed)."""
    return len(text.rstrip(_REPLACEMENT))


def _backend_decode(tokenizer):
    """The `tokenizers.Tokenizer.decode` behind a Hugging Face fast tokenizer, or None.

    With `clean_up_tokenization_spaces=False` the HF wrapper returns exactly what its backend's
    decode returns; calling the backend directly skips ~20 us of argument conversion per call
    (two calls per request per step: a sizeable share of a large batch's host time).
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if type(backend).__module__.split(".")[0] == "tokenizers" and hasattr(backend, "decode"):
        return backend.decode
    return None


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, step by step.

    Args:
        tokenizer: decodes a list of ids (see `Tokenizer`).
        prompt_token_ids: the prompt; only its last few tokens are kept, as decoding context.
        skip_special_tokens: drop special tokens from the text (as `tokenizer.decode` does).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._fast_decode = _backend_decode(tokenizer)
        # The window is self._tokens: [0, _read_offset) is text already accounted for (emitted,
        # or prompt), [_read_offset, end) is new. _emitted_chars counts the window text's
        # characters already accounted for.
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)
        self._emitted_chars = _stable_length(self._prefix_text)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (may be "", e.g. mid-character)."""
        self._tokens.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The request ended: return any held-back text, U+FFFD included if never completed."""
        return self._emit(final=True)

    def _decode(self, token_ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _emit(self, final: bool) -> str:
        if len(self._tokens) == self._read_offset and not final:
            return ""
        text = self._decode(self._tokens)
        too_long = len(self._tokens) > _MAX_WINDOW_TOKENS
        stable = len(text) if final or too_long else _stable_length(text)
        delta = text[self._emitted_chars:stable]
        self._emitted_chars = max(self._emitted_chars, stable)
        complete = stable == len(text)
        if complete and (len(text) > len(self._prefix_text) or too_long):
            # Everything is out and ends on a whole character: the next window starts at the
            # old read offset, a character boundary, and its first part is what we just read.
            del self._tokens[:self._read_offset]
            self._read_offset = len(self._tokens)
            self._prefix_text = self._decode(self._tokens)
            self._emitted_chars = len(self._prefix_text)
        return delta
