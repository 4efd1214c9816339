"""The orjson fast path of stream chunks writes the same bytes as the pydantic models."""

from __future__ import annotations

import pytest

from deepinfer.server.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice,
                                       CompletionResponse, DeltaMessage)
from deepinfer.server.sse import ChunkHead, sse_event


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text,finish,stop", [("héllo \"x\"\n", None, None), ("", "stop", 7),
                                              ("end", "stop", "</s>"), ("", "length", None)])
def test_fast_chunks_equal_the_models_bytes(include_usage, text, finish, stop):
    exclude = set() if include_usage else {"usage"}
    fast = ChunkHead("cmpl-1", 1700000000, "m", "text_completion", include_usage)
    model = CompletionResponse(id="cmpl-1", created=1700000000, model="m", choices=[
        CompletionChoice(index=3, text=text, finish_reason=finish, stop_reason=stop)])
    assert fast.event({"index": 3, "text": text, "logprobs": None, "finish_reason": finish,
                       "stop_reason": stop}) == sse_event(
        model, exclude=exclude | {"kv_transfer_params"})
    fast = ChunkHead("chat-1", 1700000000, "m", "chat.completion.chunk", include_usage)
    delta = DeltaMessage(content=text) if text else DeltaMessage()
    model = ChatCompletionChunk(id="chat-1", created=1700000000, model="m", choices=[
        ChatChunkChoice(index=0, delta=delta, finish_reason=finish, stop_reason=stop)])
    assert fast.event({"index": 0, "delta": {"content": text} if text else {},
                       "logprobs": None, "finish_reason": finish,
                       "stop_reason": stop}) == sse_event(model, exclude=exclude or None)
