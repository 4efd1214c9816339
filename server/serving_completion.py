"""POST /v1/completions: prompts as a string, strings, token ids or lists of token ids; `echo`;
n choices per prompt (choice index = prompt_index * n + i); one JSON body or SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request, Response

from deepinfer.engine.outputs import RequestOutput
from deepinfer.server import generation as gen
from deepinfer.server.logprobs import CompletionLogprobsBuilder, TokenDecoder
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.prompts import Prompt, completion_prompts
from deepinfer.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from deepinfer.server.sse import ChunkHead, sse_event
from deepinfer.server.structured import check_compiles, so_args_from_request
from deepinfer.server.validation import (COMPLETIONS_DEFAULT_MAX_TOKENS, build_params,
                                        check_completion_fields, check_kv_transfer_params,
                                        check_model, completion_kwargs, fit_max_tokens)


class CompletionServing:
    def __init__(self, engine: Any, metrics: ServerMetrics, decode: TokenDecoder) -> None:
        self.engine = engine
        self.metrics = metrics
        self.decode = decode

    def _sub_requests(self, req: CompletionRequest, prompts: list[Prompt], n: int,
                      so_args: dict[str, Any] | None) -> list[gen.SubRequest]:
        kwargs, asked_max_tokens = completion_kwargs(req)
        kwargs["so_args"] = so_args
        handoff = check_kv_transfer_params(req, n * len(prompts))
        subs = []
        for p, prompt in enumerate(prompts):
            max_tokens = fit_max_tokens(asked_max_tokens, len(prompt.token_ids),
                                        self.engine.max_model_len, prompt_param="prompt",
                                        default=COMPLETIONS_DEFAULT_MAX_TOKENS)
            for i, params in enumerate(build_params(kwargs, max_tokens).fan_out(n)):
                subs.append(gen.SubRequest(p * n + i, prompt.token_ids, params, handoff))
        return subs

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        check_model(req.model, self.engine.model_name)
        check_completion_fields(req)
        prompts = await asyncio.to_thread(completion_prompts, self.engine.tokenizer,
                                          req.prompt, self.engine.max_model_len)
        n = req.n or 1
        so_args, so_param = so_args_from_request(req)
        if so_args is not None:
            await check_compiles(self.engine, so_args, so_param)
        subs = self._sub_requests(req, prompts, n, so_args)
        echoes = [prompts[sub.index // n].text if req.echo else "" for sub in subs]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await gen.respond(
            raw, self.engine, self.metrics, request_id, subs, bool(req.stream),
            events=lambda outputs: self._events(req, request_id, n, echoes, outputs),
            body=lambda states: self._body(req, request_id, n, echoes, states),
            choices_param="prompt" if len(prompts) > 1 else "n")

    def _body(self, req: CompletionRequest, request_id: str, n: int, echoes: list[str],
              states: list[gen.ChoiceState]) -> CompletionResponse:
        choices = []
        for state, echo in zip(states, echoes):
            logprobs = None
            if req.logprobs is not None:
                logprobs = CompletionLogprobsBuilder(self.decode, len(echo)).add(state.logprobs)
            choices.append(CompletionChoice(index=state.index, text=echo + state.text,
                                            logprobs=logprobs,
                                            finish_reason=state.finish_reason,
                                            stop_reason=state.stop_reason))
        return CompletionResponse(id=request_id, model=self.engine.model_name, choices=choices,
                                  usage=gen.usage(states, n),
                                  kv_transfer_params=states[0].kv_transfer_params)

    async def _events(self, req: CompletionRequest, request_id: str, n: int, echoes: list[str],
                      outputs: AsyncIterator[tuple[int, RequestOutput]]
                      ) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        exclude = {"kv_transfer_params"} | (set() if include_usage else {"usage"})
        created = int(time.time())
        states = [gen.ChoiceState(i) for i in range(len(echoes))]
        builders = [CompletionLogprobsBuilder(self.decode, len(echo)) for echo in echoes]

        def chunk(choices: list[CompletionChoice], **extra: Any) -> bytes:
            return sse_event(CompletionResponse(id=request_id, created=created,
                                                model=self.engine.model_name, choices=choices,
                                                **extra), exclude=exclude)

        fast = ChunkHead(request_id, created, self.engine.model_name, "text_completion",
                         include_usage)
        for index, echo in enumerate(echoes):
            if echo:
                yield chunk([CompletionChoice(index=index, text=echo, finish_reason=None)])
        async with contextlib.aclosing(outputs):
            async for index, out in outputs:
                states[index].update(out)
                if not (out.new_text or out.new_logprobs or out.finished):
                    continue
                if req.logprobs is None:   # the hot path: no pydantic model per token
                    finished = out.finished
                    yield fast.event({"index": index, "text": out.new_text, "logprobs": None,
                                      "finish_reason": out.finish_reason if finished else None,
                                      "stop_reason": out.stop_reason if finished else None})
                    continue
                logprobs = builders[index].add(out.new_logprobs or [])
                yield chunk([CompletionChoice(
                    index=index, text=out.new_text, logprobs=logprobs,
                    finish_reason=out.finish_reason if out.finished else None,
                    stop_reason=out.stop_reason if out.finished else None)])
        if include_usage:
            yield chunk([], usage=gen.usage(states, n))
