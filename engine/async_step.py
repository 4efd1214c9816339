"""Async scheduling: prepare step N+1 on the host while step N runs on the device.

The synchronous step (`EngineCore.step`) waits for each step's sampled ids before it schedules
the next one, so the device idles through scheduling, input building, graph launch and output
processing. Here (vLLM v1's async scheduling, `vllm/v1/core/sched/async_scheduler.py` and
`AsyncGPUModelRunnerOutput`; SGLang's overlap scheduler) one step stays in flight:

    step():  schedule N+1 -> launch N+1 (its decode inputs gathered on the device from N's
             sampled ids) -> wait for N's ids (already there or nearly) -> update the scheduler
             and detokenize N while N+1 runs on the device

- A decode step adds exactly one token per request, so the scheduler needs no token values: a
  sampled token not yet copied back counts as a placeholder (`Request.num_output_placeholders`)
  and is scheduled like a known token. The runner holds -1 for it in its token list; every
  step's sampled ids also land in the runner's device buffer `last_sampled`, and the next step
  takes the real id from there (`AsyncRunnerOutput.feed_rows`: inside the decode graph, or by a
  gather before an eager forward). Block tables, positions and slot mappings need only counts.
- Stop rules (EOS, stop ids, stop strings, max_tokens) are applied one step late: a request that
  finished at step N may already be in step N+1; that extra token is computed and dropped. Its
  KV slot was allocated with the request and is freed with it (one stream orders every write
  before any reuse of the block). A request whose in-flight token is its max_tokens-th is not
  scheduled again (`Scheduler._schedule_running`).
- Requests that need the previous token's value on the host before the next step (structured
  outputs: the grammar accepts it before the next bitmask; penalties: counts of output tokens)
  switch the engine to synchronous steps while they run: the step in flight is resolved first.
- Random sampling and logprobs still synchronize inside the sampler (correct, less overlap);
  greedy batches never wait for the device before the next launch.

Ownership: the step loop (EngineCore) owns `AsyncStepper`; `AsyncRunnerOutput` is made by
`ModelRunner.execute_async` and read once, by `AsyncStepper`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.engine.input_batch import CachedRequestState
from deepinfer.engine.kv_transfer import IDLE_WAIT_S
from deepinfer.engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput, TokenLogprobs
from deepinfer.engine.request import Request
from deepinfer.engine.sampling_metadata import uses_penalty
from deepinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.engine_core import EngineCore



def needs_sync_steps(params: SamplingParams) -> bool:
    """True when a request needs each token on the host before the next step is built: a
    grammar (bitmask after accepting the token) or penalties (counts of output tokens)."""
    return params.so_args is not None or uses_penalty(params)


@dataclass
class AsyncRunnerOutput:
    """One launched step's sampled ids, still on their way to the host.

    req_ids: the scheduled requests, in runner order.
    sampling_states: the runner states that sample this step (row r of `token_ids`); each holds
        -1 at `token_indices[r]` until `resolve()`.
    token_ids: [num_sampling] int64 on the device (None when no row samples).
    host_token_ids: [num_sampling] int64, page-locked host copy (filled when `ready` fires).
    ready: CUDA event recorded after the copy; None on CPU (already there).
    logprobs: per sampling row (None unless asked; the sampler synchronized for them).
    """

    req_ids: list[str]
    sampling_states: list[CachedRequestState] = field(default_factory=list)
    token_indices: list[int] = field(default_factory=list)
    token_ids: torch.Tensor | None = None
    host_token_ids: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    logprobs: list[TokenLogprobs] | None = None
    rows: dict[str, int] = field(default_factory=dict)   # request id -> row of token_ids

    @classmethod
    def empty(cls) -> AsyncRunnerOutput:
        return cls(req_ids=[])

    @classmethod
    def launch(cls, req_ids: list[str], sampling_states: list[CachedRequestState],
               token_ids: torch.Tensor | None,
               logprobs: list[TokenLogprobs] | None) -> AsyncRunnerOutput:
        """Start the device-to-host copy of `token_ids` ([B] int64) behind the step's work."""
        host, ready = token_ids, None
        if token_ids is not None and token_ids.is_cuda:
            host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            host.copy_(token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return cls(req_ids=req_ids, sampling_states=sampling_states,
                   token_indices=[len(s.token_ids) - 1 for s in sampling_states],
                   token_ids=token_ids, host_token_ids=host, ready=ready, logprobs=logprobs,
                   rows={s.request_id: row for row, s in enumerate(sampling_states)})

    def feed_rows(self, states: list[CachedRequestState], num_scheduled: list[int]
                  ) -> np.ndarray | None:
        """Where the next step feeds this step's sampled ids: for each of its tokens (in
        `states` order, `num_scheduled` each), the row of this step's `token_ids` whose id it
        takes, or -1 (its id is known). A request's chunk feeds its last token when the runner
        still holds -1 for it. None when nothing is fed.

        Returns:
            [num_tokens] int64 or None.
        Raises:
            RuntimeError: a -1 that this step did not sample (more than one step in flight).
        """
        end = 0
        feed = None
        for state, num_tokens in zip(states, num_scheduled):
            end += num_tokens
            if state.token_ids[state.num_computed_tokens + num_tokens - 1] != -1:
                continue
            row = self.rows.get(state.request_id)
            if row is None:
                raise RuntimeError(f"request {state.request_id}: token of an older step is "
                                   "still unresolved; async scheduling keeps one step in flight")
            if feed is None:
                feed = np.full(sum(num_scheduled), -1, dtype=np.int64)
            feed[end - 1] = row
        return feed

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the ids, fill the runner's placeholders, return them as plain lists."""
        if self.ready is not None:
            self.ready.synchronize()
        sampled = [] if self.host_token_ids is None else self.host_token_ids.tolist()
        for state, index, token_id in zip(self.sampling_states, self.token_indices, sampled):
            state.token_ids[index] = token_id
        rows = [self.rows.get(request_id) for request_id in self.req_ids]
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[[] if row is None else [sampled[row]] for row in rows],
            logprobs=[None if row is None or self.logprobs is None else [self.logprobs[row]]
                      for row in rows])


@dataclass
class _InFlight:
    scheduler_output: SchedulerOutput
    runner_output: AsyncRunnerOutput
    requests: dict[str, Request]   # the Request objects scheduled (ids may be reused later)


class AsyncStepper:
    """The async step loop body of one `EngineCore` (see the module doc)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.in_flight: _InFlight | None = None
        self._sync_ids: set[str] = set()   # unfinished requests that need synchronous steps

    def add_request(self, request: Request) -> None:
        if needs_sync_steps(request.sampling_params):
            self._sync_ids.add(request.request_id)

    def wants_step(self) -> bool:
        """True when the next step is async: a step is in flight (it must be resolved), or no
        unfinished request needs synchronous steps."""
        if self._sync_ids:
            self._sync_ids &= self.core.scheduler.requests.keys()
        return self.in_flight is not None or not self._sync_ids

    def step(self) -> list[RequestOutput]:
        """Launch step N+1 (unless a request needs sync steps), then finish step N."""
        core, scheduler = self.core, self.core.scheduler
        scheduler.remote_kv_ready(core.kv_transfer.finished_loads())
        launched = None
        if scheduler.has_work() and not self._sync_ids:
            launched = self._launch()
        previous, self.in_flight = self.in_flight, launched
        outputs = self._finish(previous) if previous is not None else []
        if all(s is None or s.scheduler_output.is_empty for s in (previous, launched)):
            core.kv_transfer.wait(IDLE_WAIT_S)  # only KV store traffic: do not spin
        return core.kv_transfer.hold_finished(outputs)

    def _launch(self) -> _InFlight:
        core, scheduler = self.core, self.core.scheduler
        scheduler_output = scheduler.schedule()
        requests = {rid: scheduler.requests[rid] for rid in scheduler_output.num_scheduled_tokens}
        for request in requests.values():   # rows that sample: their token becomes in flight
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        core.kv_transfer.load_blocks(scheduler_output.kv_loads)
        previous = self.in_flight.runner_output if self.in_flight is not None else None
        runner_output = core.model_runner.execute_async(scheduler_output, previous)
        core.kv_transfer.save_blocks(scheduler_output.kv_saves)
        return _InFlight(scheduler_output, runner_output, requests)

    def _finish(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's ids; update the scheduler (one step late) and detokenize.
        Rows of requests finished or replaced (same id, new request) since launch are dropped."""
        core, scheduler = self.core, self.core.scheduler
        result = step.runner_output.resolve()
        keep = []
        for index, (request_id, sampled) in enumerate(zip(result.req_ids,
                                                          result.sampled_token_ids)):
            request = scheduler.requests.get(request_id)
            if request is None or request is not step.requests.get(request_id):
                continue
            if sampled:
                request.num_output_placeholders -= 1
            keep.append(index)
        result = ModelRunnerOutput(req_ids=[result.req_ids[i] for i in keep],
                                   sampled_token_ids=[result.sampled_token_ids[i] for i in keep],
                                   logprobs=[result.logprobs[i] for i in keep])
        return core.finish_step(step.scheduler_output, result)
