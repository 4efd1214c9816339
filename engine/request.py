"""Request state, owned by the scheduler (only the step loop mutates it).

A request's `num_computed_tokens` catches up with `num_tokens` (prompt + output): prefill, chunked
prefill, prefix-cache hits and recompute after preemption are all the same rule. "Is prefill" is
derived, never stored.

Pure module: no torch import.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from deepinfer.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    WAITING_FOR_REMOTE_KV = 6  # its prompt blocks are being fetched from the KV store
    FINISHED_ERROR = 7  # a step failed on it alone (EngineCore's fault isolation)

    @property
    def finished(self) -> bool:
        return (RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ABORTED
                or self == RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
                RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass
class Request:
    """One sequence being generated.

    prompt_token_ids: the prompt, already tokenized.
    eos_token_ids: ids that end generation unless `sampling_params.ignore_eos`.
    max_total_tokens: prompt + output may not exceed this (the context window, or max_tokens).
    seed: the resolved 64-bit sampling seed (see `SamplingParams.resolved_seed`).
    cache_salt: isolates this request's prefix-cache and KV-store blocks from requests with
        another salt (engine/kv_cache/hashing.py); defaults to `sampling_params.cache_salt`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int = 1 << 30
    seed: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    # async scheduling (engine/async_step.py): sampled tokens still on the device, not yet in
    # output_token_ids; the scheduler schedules them as if known (set and cleared by EngineCore)
    num_output_placeholders: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[int] = field(default_factory=list)  # chain over full blocks, filled lazily
    # prefill/decode disaggregation ({"do_remote_decode": true} or what a prefill returned)
    kv_transfer_params: dict | None = None
    # speculative decoding: draft tokens proposed after the last output token, to be scored
    # in the next step (Scheduler.update_draft_token_ids); never part of num_tokens
    spec_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    # images (engine.multimodal.ImageInput, placed at their placeholder spans in the prompt)
    mm_inputs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cache_salt is None:
            self.cache_salt = getattr(self.sampling_params, "cache_salt", None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop rules after a new token: EOS, stop_token_ids, max_tokens, context.

        Stop strings are text-level and checked by the output processor.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
