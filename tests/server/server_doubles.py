"""Test doubles for the server's unit tests: a character tokenizer and a scripted engine.

They exist only so the HTTP layer (validation, error bodies, SSE framing, fan-out, aborts) can be
tested in milliseconds; the slow tests run the same app on the real AsyncLLM.
"""

from __future__ import annotations

import asyncio
import json
import time

from jinja2 import TemplateError

from deepinfer.engine.errors import QueueFullError
from deepinfer.engine.outputs import RequestMetrics, RequestOutput, SchedulerStats, TokenLogprobs
from deepinfer.engine.sampling_params import SamplingParams

BOS, EOS = 256, 257
SPECIAL = {BOS: "<s>", EOS: "</s>"}


class CharTokenizer:
    """One token per byte value (id = ord(char) for ASCII); `<s>` is the BOS special token."""

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(len(self))}

    def __len__(self) -> int:
        return 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS] if add_special_tokens else []
        while text:
            if text.startswith("<s>"):
                ids.append(BOS)
                text = text[3:]
            else:
                ids.append(ord(text[0]))
                text = text[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("" if skip_special_tokens and i in SPECIAL else SPECIAL.get(i, chr(i))
                       for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return SPECIAL.get(token_id, chr(token_id))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool,
                            tokenize: bool) -> str:
        assert tokenize is False
        if messages[-1]["role"] == "assistant" and add_generation_prompt:
            raise TemplateError("the conversation must end with a user message")
        text = "<s>" + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class ScriptedEngine:
    """Answers every request with `reply`, one character per token and per step.

    max_tokens cuts it short (finish_reason "length"); otherwise it ends with "stop". A seed
    picks a rotation of the reply, so equal seeds give equal text and different seeds differ.
    Records each request's params, and the ids of requests abandoned before finishing.
    """

    model_name = "test-model"
    max_in_flight = 300   # AsyncLLM's max_num_seqs + max_waiting_requests

    def __init__(self, reply: str = "Hello world", max_model_len: int = 64,
                 step_delay_s: float = 0.0, first_token_delay_s: float = 0.0) -> None:
        self.tokenizer = CharTokenizer()
        self.max_model_len = max_model_len
        self.reply = reply
        self.step_delay_s = step_delay_s
        self.first_token_delay_s = first_token_delay_s   # a queue wait or a long prefill
        self.queue_full = False
        self.dead = False
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.compiled: list[dict] = []

    async def compile_grammar(self, so_args: dict) -> None:
        """Records the constraint; refuses what the real engine's key check refuses (bad
        shape, too long: `grammar_key`), then what its first check of a JSON schema refuses
        (`check_valid`) and, standing in for the compiler, a schema that mentions INVALID."""
        from deepinfer.engine.structured import check_valid, grammar_key

        self.compiled.append(so_args)
        kind, text = grammar_key(so_args)
        if kind == "json":
            check_valid(json.loads(text))
        if "INVALID" in str(so_args.get("schema")):
            raise ValueError("invalid or unsupported regex: Regex parsing error at position 3.")

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.running), kv_cache_usage=0.25,
                              prefix_cache_queries=10, prefix_cache_hits=4)

    def check_health(self) -> None:
        if self.dead:
            from deepinfer.engine.errors import EngineDeadError
            raise EngineDeadError("step loop raised RuntimeError('boom')")

    def _text(self, params: SamplingParams) -> str:
        shift = (params.seed or 0) % len(self.reply)
        return self.reply[shift:] + self.reply[:shift]

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, kv_transfer_params: dict | None = None):
        if self.queue_full:
            raise QueueFullError("waiting queue holds 2 requests (max_waiting_requests=2).")
        self.requests[request_id] = (list(prompt_token_ids), sampling_params)
        self.running.add(request_id)
        metrics = RequestMetrics(arrival_time=time.monotonic())
        text = self._text(sampling_params)[:sampling_params.max_tokens]
        finished = False
        try:
            await asyncio.sleep(self.first_token_delay_s)
            for i, ch in enumerate(text):
                await asyncio.sleep(self.step_delay_s)
                last = i == len(text) - 1
                now = time.monotonic()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                logprobs = None
                if sampling_params.logprobs is not None:
                    top = [(ord(ch), -0.5), (ord("x"), -1.5)][:sampling_params.logprobs]
                    logprobs = [TokenLogprobs(ord(ch), -0.5, 1, top)]
                reason = None
                if last:
                    reason = "length" if len(text) == sampling_params.max_tokens else "stop"
                    metrics.finished_time = now
                finished = last
                yield RequestOutput(request_id, list(prompt_token_ids), [ord(ch)], ch, logprobs,
                                    i + 1, 2, last, reason, None, metrics)
        finally:
            self.running.discard(request_id)
            if not finished:
                self.aborted.append(request_id)
