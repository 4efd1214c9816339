"""Attention data parallelism on the core's side: one `Scheduler` (and `KVCacheManager`) per DP
rank behind the `Scheduler` interface the core uses, so `EngineCore` drives N ranks as one.

- A new request goes to the least-loaded rank — fewest waiting + running requests, then the
  lowest KV cache usage, then the lowest rank — and stays there (preempted and resumed there).
- `schedule()` schedules every rank and returns a `DPSchedulerOutput`: the ranks' outputs merged
  (what the core reads: counts, ids) plus `per_rank`, which the multi-process executor hands
  to each rank's worker. A rank with nothing scheduled still runs the step (an idle MoE pass,
  engine/moe/expert_parallel.py) so the expert-parallel collectives line up.
- `update_from_output` splits the merged `ModelRunnerOutput` by rank.

Pure: no torch (engine's pure core).
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, field

from deepinfer.engine.outputs import (EngineCoreOutput, ModelRunnerOutput, SchedulerOutput,
                                      SchedulerStats)
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler


@dataclass
class DPSchedulerOutput(SchedulerOutput):
    """The ranks' `SchedulerOutput`s merged (request ids are unique across ranks), and each
    rank's own in `per_rank[rank]`."""

    per_rank: list[SchedulerOutput] = field(default_factory=list)

    @classmethod
    def merge(cls, outputs: list[SchedulerOutput]) -> "DPSchedulerOutput":
        merged = cls(per_rank=outputs)
        for out in outputs:
            merged.scheduled_new_reqs += out.scheduled_new_reqs
            merged.scheduled_cached_reqs += out.scheduled_cached_reqs
            merged.num_scheduled_tokens.update(out.num_scheduled_tokens)
            merged.total_num_scheduled_tokens += out.total_num_scheduled_tokens
            merged.finished_req_ids |= out.finished_req_ids
            merged.scheduled_spec_decode_tokens.update(out.scheduled_spec_decode_tokens)
            merged.scheduled_encoder_inputs.update(out.scheduled_encoder_inputs)
        return merged


def merge_runner_outputs(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """The ranks' outputs as one (rows of rank 0, then rank 1, ...)."""
    merged = ModelRunnerOutput()
    with_logprobs = any(out.logprobs for out in outputs)
    for out in outputs:
        merged.req_ids += out.req_ids
        merged.sampled_token_ids += out.sampled_token_ids
        if with_logprobs:
            merged.logprobs += out.logprobs or [None] * len(out.req_ids)
    return merged


class DPScheduler:
    """N per-rank schedulers as one (module doc). `ranks[r]` is rank r's `Scheduler`."""

    def __init__(self, schedulers: list[Scheduler]):
        self.ranks = schedulers
        self.config = schedulers[0].config
        self.save_kv_blocks = False

    # ---- what the core reads -------------------------------------------------------------
    @property
    def requests(self) -> ChainMap:
        """Every rank's unfinished requests by id (a read-only view)."""
        return ChainMap(*(s.requests for s in self.ranks))

    @property
    def kv_cache_manager(self) -> None:
        """None: each rank has its own (the KV store bridge, which would use it, is off)."""
        return None

    @property
    def isolated_request_id(self) -> str | None:
        return next((s.isolated_request_id for s in self.ranks
                     if s.isolated_request_id is not None), None)

    @isolated_request_id.setter
    def isolated_request_id(self, request_id: str | None) -> None:
        # the suspect runs alone on its rank; the other ranks (which do not hold it) schedule
        # nothing meanwhile
        for s in self.ranks:
            s.isolated_request_id = request_id

    @property
    def num_unfinished_requests(self) -> int:
        return sum(s.num_unfinished_requests for s in self.ranks)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.ranks)

    def rank_of(self, request_id: str) -> int | None:
        return next((r for r, s in enumerate(self.ranks) if request_id in s.requests), None)

    def load(self, rank: int) -> tuple[int, float, int]:
        s = self.ranks[rank]
        return (len(s.waiting) + len(s.waiting_for_remote_kv) + len(s.running),
                s.kv_cache_manager.block_pool.usage, rank)

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue on the least-loaded rank (module doc). Raises QueueFullError as Scheduler."""
        rank = min(range(len(self.ranks)), key=self.load)
        self.ranks[rank].add_request(request)

    def _by_rank(self, request_ids) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.rank_of(request_id)
            if rank is not None:
                groups.setdefault(rank, []).append(request_id)
        return groups

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        for rank, ids in self._by_rank(request_ids).items():
            self.ranks[rank].finish_requests(ids, status)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        for rank, ids in self._by_rank(draft_token_ids).items():
            self.ranks[rank].update_draft_token_ids({i: draft_token_ids[i] for i in ids})

    def wait_for_remote_kv(self, request_id: str) -> None:
        raise RuntimeError("the KV store bridge is not supported with data parallelism.")

    def remote_kv_ready(self, fetched) -> None:
        raise RuntimeError("the KV store bridge is not supported with data parallelism.")

    def take_preempted(self) -> list[Request]:
        return [r for s in self.ranks for r in s.take_preempted()]

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> DPSchedulerOutput:
        return DPSchedulerOutput.merge([s.schedule() for s in self.ranks])

    def undo_step(self, num_valid_tokens: dict[str, int]) -> None:
        for rank, ids in self._by_rank(num_valid_tokens).items():
            self.ranks[rank].undo_step({i: num_valid_tokens[i] for i in ids})

    def update_from_output(self, scheduler_output: DPSchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        rows: dict[int, list[int]] = {}
        for index, request_id in enumerate(runner_output.req_ids):
            rank = self.rank_of(request_id)
            if rank is not None:
                rows.setdefault(rank, []).append(index)
        outputs: list[EngineCoreOutput] = []
        for rank, index in sorted(rows.items()):
            part = ModelRunnerOutput(
                req_ids=[runner_output.req_ids[i] for i in index],
                sampled_token_ids=[runner_output.sampled_token_ids[i] for i in index],
                logprobs=[runner_output.logprobs[i] for i in index] if runner_output.logprobs
                else [])
            outputs += self.ranks[rank].update_from_output(
                scheduler_output.per_rank[rank], part)
        return outputs

    def get_stats(self) -> SchedulerStats:
        """The ranks' stats summed (usage: blocks in use over all blocks); `per_rank` each."""
        per_rank = [s.get_stats() for s in self.ranks]
        blocks = sum(st.num_kv_blocks for st in per_rank)
        free = sum(st.num_free_kv_blocks for st in per_rank)
        return SchedulerStats(
            num_running_reqs=sum(st.num_running_reqs for st in per_rank),
            num_waiting_reqs=sum(st.num_waiting_reqs for st in per_rank),
            kv_cache_usage=(blocks - free) / blocks if blocks else 0.0,
            num_kv_blocks=blocks, num_free_kv_blocks=free,
            prefix_cache_queries=sum(st.prefix_cache_queries for st in per_rank),
            prefix_cache_hits=sum(st.prefix_cache_hits for st in per_rank),
            num_preemptions=sum(st.num_preemptions for st in per_rank), per_rank=per_rank)
