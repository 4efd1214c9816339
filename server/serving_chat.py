"""POST /v1/chat/completions: validate, apply the chat template, fan out n choices, answer as
one JSON body or as SSE chunks (role first, content / tool-call deltas, finish_reason, optional
usage). Structured outputs (server.structured) and tools (server.tools) become the engine's
`so_args`, compiled before anything is queued; each choice's text goes through its own tool-call
parser (server.tool_parser), the same one for streams and bodies."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request, Response

from deepinfer.engine.config import MultiModalConfig
from deepinfer.engine.outputs import RequestOutput
from deepinfer.server import generation as gen
from deepinfer.server.errors import APIError, spelled
from deepinfer.server.media import load_images, process_images
from deepinfer.server.logprobs import TokenDecoder, chat_logprobs, shown_logprobs
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.prompts import chat_prompt_ids
from deepinfer.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                             ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                             DeltaMessage)
from deepinfer.server.sse import ChunkHead, sse_event
from deepinfer.server.structured import check_compiles, so_args_from_request, with_backend
from deepinfer.server.tools import (ToolConfig, check_tool_constraint, tool_config,
                                    tool_so_args, tool_streamer)
from deepinfer.server.validation import (build_params, chat_kwargs, check_kv_transfer_params, check_model,
                               fit_max_tokens, max_tokens_field)


def _finish_reason(reason: str | None, tools: ToolConfig | None, num_calls: int) -> str | None:
    """OpenAI says "tool_calls" when the model chose to call ("auto", "required")."""
    if reason == "stop" and num_calls and tools is not None and tools.choice != "named":
        return "tool_calls"
    return reason


class ChatServing:
    def __init__(self, engine: Any, metrics: ServerMetrics, decode: TokenDecoder,
                 media: MultiModalConfig = MultiModalConfig()) -> None:
        self.engine = engine
        self.metrics = metrics
        self.decode = decode
        self.media = media   # image part limits (server.media)
        # a vision-language model's processor (engine.mm_processor), None for text-only
        self.mm_processor = getattr(engine, "mm_processor", None)

    async def _images(self, req: ChatCompletionRequest) -> list | None:
        """The request's images, fetched and preprocessed (`ProcessedImage`s), or None for a
        text-only model (whose prompt code then refuses image parts with a 400)."""
        if self.mm_processor is None:
            return None
        loaded = await load_images(req.messages, self.media)
        return await asyncio.to_thread(process_images, self.mm_processor, loaded)

    async def _constraint(self, req: ChatCompletionRequest,
                          tools: ToolConfig | None) -> dict[str, Any] | None:
        so_args, param = so_args_from_request(req)
        tool_args = with_backend(tool_so_args(tools), req)
        if tool_args is not None and tools.choice == "auto" and (
                so_args is not None or req.stop or req.min_tokens or req.ignore_eos):
            tool_args = None     # auto calls are then parsed from free text, as before
        if tool_args is not None and so_args is not None:
            raise APIError(f"tool_choice={spelled(req.tool_choice)} constrains the output to a "
                           f"tool call, so {param} cannot be used with it; drop one.",
                           param=param, code="invalid_value")
        await check_tool_constraint(self.engine, tools, tool_args)   # compiles tool_args
        if so_args is not None:
            await check_compiles(self.engine, so_args, param)
        return tool_args if tool_args is not None else so_args

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        check_model(req.model, self.engine.model_name)
        kwargs, asked_max_tokens = chat_kwargs(req)
        tools = tool_config(req)
        kwargs["so_args"] = await self._constraint(req, tools)
        images = await self._images(req)
        # tokenizing a long prompt takes a while: keep the event loop serving others
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.engine.tokenizer,
                                             req.messages, self.engine.max_model_len, tools,
                                             self.mm_processor, images)
        mm_inputs = None
        if images:
            try:
                mm_inputs = self.mm_processor.place(prompt_ids, images)
            except ValueError as exc:
                raise APIError(str(exc), param="messages", code="invalid_value") from None
        max_tokens = fit_max_tokens(
            asked_max_tokens, len(prompt_ids), self.engine.max_model_len, prompt_param="messages",
            max_tokens_param=max_tokens_field(req))
        params = build_params(kwargs, max_tokens)
        n = req.n or 1
        handoff = check_kv_transfer_params(req, n)
        subs = [gen.SubRequest(i, prompt_ids, p, handoff, mm_inputs)
                for i, p in enumerate(params.fan_out(n))]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await gen.respond(
            raw, self.engine, self.metrics, request_id, subs, bool(req.stream),
            events=lambda outputs: self._events(req, tools, request_id, n, outputs),
            body=lambda states: self._body(req, tools, request_id, n, states))

    def _message(self, text: str, tools: ToolConfig | None,
                 finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        streamer = tool_streamer(tools)
        if streamer is None:
            return AssistantMessage(content=text), finish_reason
        streamer.run(text)
        calls = [call.message_dict() for call in streamer.calls]
        return (AssistantMessage(content=streamer.content, tool_calls=calls or None),
                _finish_reason(finish_reason, tools, len(calls)))

    def _body(self, req: ChatCompletionRequest, tools: ToolConfig | None, request_id: str,
              n: int, states: list[gen.ChoiceState]) -> ChatCompletionResponse:
        choices = []
        for s in states:
            message, finish_reason = self._message(s.text, tools, s.finish_reason)
            choices.append(ChatChoice(
                index=s.index, message=message, finish_reason=finish_reason,
                logprobs=chat_logprobs(self.decode, shown_logprobs(
                    s.logprobs, s.finish_reason, s.stop_reason)) if req.logprobs else None,
                stop_reason=s.stop_reason))
        return ChatCompletionResponse(id=request_id, model=self.engine.model_name,
                                      choices=choices, usage=gen.usage(states, n),
                                      kv_transfer_params=states[0].kv_transfer_params)

    async def _events(self, req: ChatCompletionRequest, tools: ToolConfig | None,
                      request_id: str, n: int,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        exclude = None if include_usage else {"usage"}
        created = int(time.time())
        states = [gen.ChoiceState(i) for i in range(n)]
        streamers = [tool_streamer(tools) for _ in range(n)]

        def chunk(choices: list[ChatChunkChoice], **extra: Any) -> bytes:
            return sse_event(ChatCompletionChunk(id=request_id, created=created,
                                                 model=self.engine.model_name,
                                                 choices=choices, **extra), exclude=exclude)

        fast = ChunkHead(request_id, created, self.engine.model_name, "chat.completion.chunk",
                         include_usage)
        for i in range(n):
            role = DeltaMessage(role="assistant", content="")
            yield chunk([ChatChunkChoice(index=i, delta=role)])
        async with contextlib.aclosing(outputs):
            async for index, out in outputs:
                states[index].update(out)
                streamer = streamers[index]
                if streamer is None and not req.logprobs:   # the hot path: orjson, no models
                    if out.new_text or out.finished:
                        finished = out.finished
                        yield fast.event({
                            "index": index,
                            "delta": {"content": out.new_text} if out.new_text else {},
                            "logprobs": None,
                            "finish_reason": out.finish_reason if finished else None,
                            "stop_reason": out.stop_reason if finished else None})
                    continue
                if streamer is None:
                    deltas = [DeltaMessage(content=out.new_text)] if out.new_text else []
                else:
                    pieces = streamer.feed(out.new_text) if out.new_text else []
                    pieces += streamer.finish() if out.finished else []
                    deltas = [DeltaMessage(**piece) for piece in pieces]
                if not (deltas or out.new_logprobs or out.finished):
                    continue
                deltas = deltas or [DeltaMessage()]
                logprobs = (chat_logprobs(self.decode, shown_logprobs(
                    out.new_logprobs or [], out.finish_reason, out.stop_reason))
                            if req.logprobs else None)
                finish_reason = None
                if out.finished:
                    finish_reason = out.finish_reason if streamer is None else _finish_reason(
                        out.finish_reason, tools, len(streamer.calls))
                for j, delta in enumerate(deltas):
                    last = j == len(deltas) - 1
                    yield chunk([ChatChunkChoice(
                        index=index, delta=delta, logprobs=logprobs if j == 0 else None,
                        finish_reason=finish_reason if last else None,
                        stop_reason=out.stop_reason if out.finished and last else None)])
        if include_usage:
            yield chunk([], usage=gen.usage(states, n))
