"""POST /v1/chat/completions: validate, apply the chat template, fan out n choices, answer as
one JSON body or as SSE chunks (role first, content deltas, finish_reason, optional usage)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request, Response

from engine.outputs import RequestOutput
from server import generation as gen
from server.logprobs import TokenDecoder, chat_logprobs
from server.metrics import ServerMetrics
from server.prompts import chat_prompt_ids
from server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                             ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                             DeltaMessage)
from server.sse import sse_event
from server.validation import build_params, chat_kwargs, check_model, fan_out, fit_max_tokens


class ChatServing:
    def __init__(self, engine: Any, metrics: ServerMetrics, decode: TokenDecoder) -> None:
        self.engine = engine
        self.metrics = metrics
        self.decode = decode

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        check_model(req.model, self.engine.model_name)
        kwargs, asked_max_tokens = chat_kwargs(req)
        # tokenizing a long prompt takes a while: keep the event loop serving others
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.engine.tokenizer,
                                             req.messages, self.engine.max_model_len)
        max_tokens = fit_max_tokens(asked_max_tokens, len(prompt_ids), self.engine.max_model_len,
                                    prompt_param="messages")
        params = build_params(kwargs, max_tokens)
        n = req.n or 1
        subs = [gen.SubRequest(i, prompt_ids, p) for i, p in enumerate(fan_out(params, n))]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await gen.respond(
            raw, self.engine, self.metrics, request_id, subs, bool(req.stream),
            events=lambda outputs: self._events(req, request_id, n, outputs),
            body=lambda states: self._body(req, request_id, n, states))

    def _body(self, req: ChatCompletionRequest, request_id: str, n: int,
              states: list[gen.ChoiceState]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=s.index, message=AssistantMessage(content=s.text),
                              logprobs=chat_logprobs(self.decode, s.logprobs)
                              if req.logprobs else None,
                              finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                   for s in states]
        return ChatCompletionResponse(id=request_id, model=self.engine.model_name,
                                      choices=choices, usage=gen.usage(states, n))

    async def _events(self, req: ChatCompletionRequest, request_id: str, n: int,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]
                      ) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        exclude = None if include_usage else {"usage"}
        created = int(time.time())
        states = [gen.ChoiceState(i) for i in range(n)]

        def chunk(choices: list[ChatChunkChoice], **extra: Any) -> bytes:
            return sse_event(ChatCompletionChunk(id=request_id, created=created,
                                                 model=self.engine.model_name,
                                                 choices=choices, **extra), exclude=exclude)

        for i in range(n):
            role = DeltaMessage(role="assistant", content="")
            yield chunk([ChatChunkChoice(index=i, delta=role)])
        async with contextlib.aclosing(outputs):
            async for index, out in outputs:
                states[index].update(out)
                if not (out.new_text or out.new_logprobs or out.finished):
                    continue
                logprobs = (chat_logprobs(self.decode, out.new_logprobs or [])
                            if req.logprobs else None)
                delta = DeltaMessage(content=out.new_text or None)
                yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                             finish_reason=out.finish_reason
                                             if out.finished else None,
                                             stop_reason=out.stop_reason
                                             if out.finished else None)])
        if include_usage:
            yield chunk([], usage=gen.usage(states, n))
