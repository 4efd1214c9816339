"""Async scheduling: prepare step N+1 on the host while step N runs on the device.

A synchronous step waits for each step's sampled ids before it schedules the next one, so the
device idles through scheduling, input building, graph launch and output processing. With
async scheduling (vLLM v1's `AsyncGPUModelRunnerOutput`; SGLang's overlap scheduler) the
executor returns a future instead of the output (`AsyncRunnerOutput`, made by
`ModelRunner.execute_async`), and `EngineCore.step` — the one step loop — resolves it in its
next call, after launching the next step:

    step():  schedule N+1 -> launch N+1 (its decode inputs gathered on the device from N's
             sampled ids) -> N's future.result() (already there or nearly) -> update the
             scheduler and detokenize N while N+1 runs on the device

- A sampled token not yet copied back counts as a placeholder
  (`Request.num_output_placeholders`, set by EngineCore when it launches a step) and is
  scheduled like a known token: block tables, positions and slot mappings need only counts.
  The runner holds -1 for it in its token list; every step's sampled ids also land in the
  runner's device buffer `last_sampled`, and the next step takes the real id from there
  (`AsyncRunnerOutput.feed_rows`: inside the decode graph, or by a gather before an eager
  forward). `result()` fills the runner's -1s with the real ids.
- Stop rules (EOS, stop ids, stop strings, max_tokens) are applied one step late: a request that
  finished at step N may already be in step N+1; that extra token is computed and dropped. Its
  KV slot was allocated with the request and is freed with it (one stream orders every write
  before any reuse of the block). A request whose in-flight token is its max_tokens-th is not
  scheduled again (`Scheduler._schedule_running`).
- Requests that need the previous token's value on the host before the next step
  (`needs_sync_steps`: structured outputs, penalties) make EngineCore launch blocking steps
  while they run: the step in flight is resolved first.
- Random sampling and logprobs still synchronize inside the sampler (correct, less overlap);
  greedy batches never wait for the device before the next launch.

Ownership: `AsyncRunnerOutput` is made by `ModelRunner.execute_async`, returned through the
executor (engine/executor.py) and resolved once, by EngineCore.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.input_batch import CachedRequestState
from deepinfer.engine.outputs import ModelRunnerOutput, TokenLogprobs
from deepinfer.engine.sampling_metadata import uses_penalty
from deepinfer.engine.sampling_params import SamplingParams


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

    def result(self) -> ModelRunnerOutput:
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
