"""Continuous batching scheduler: counts tokens, not phases.

Every step, each request's `num_computed_tokens` catches up with `num_tokens` (prompt + output)
under a token budget: a decode is a request one token behind, a prefill chunk one many tokens
behind, a prefix-cache hit starts ahead. When KV blocks run out, the most recently admitted running
request is preempted by recompute (its blocks freed, it goes back to the front of the queue).
Policy is first-come first-served, as in vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py).

With a KV store (engine/kv_transfer.py), a new request whose prompt blocks may be in the store
waits in `waiting_for_remote_kv` (holding no blocks) while they are fetched; once fetched it
rejoins `waiting`, and when admitted its fetched blocks count as computed like prefix-cache hits
(`SchedulerOutput.kv_loads` says which blocks to fill). Full prompt blocks a step completes are
listed in `SchedulerOutput.kv_saves`. Preempted requests are reported by `take_preempted()` so
that the engine can fetch again what their preemption evicted.

Speculative decoding: draft tokens given by `update_draft_token_ids` extend a decode row's
target, so the row scores its last sampled token plus k drafts (1 + k tokens, lookahead slots
allocated for the drafts, `SchedulerOutput.scheduled_spec_decode_tokens`). The runner returns
the committed tokens; `update_from_output` rolls the k - m rejected positions back by lowering
`num_computed_tokens` and frees the blocks wholly past it. Drafts never enter block hashes.

Only the step loop calls this class. Pure module: no torch import.
"""

from __future__ import annotations

from collections import deque

from deepinfer.engine.config import SchedulerConfig
from deepinfer.engine.errors import QueueFullError
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.outputs import (CachedRequestData, EngineCoreOutput, KVBlocks, ModelRunnerOutput,
                            NewRequestData, SchedulerOutput, SchedulerStats)
from deepinfer.engine.multimodal import images_in_range
from deepinfer.engine.request import Request, RequestStatus


class Scheduler:
    """Args:
        config: batching limits.
        kv_cache_manager: block tables and the prefix cache.
        save_kv_blocks: list the full prompt blocks each step completes in `kv_saves`.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, *,
                 save_kv_blocks: bool = False):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.save_kv_blocks = save_kv_blocks
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.waiting_for_remote_kv: dict[str, Request] = {}
        self._remote_kv: dict[str, tuple[int, int]] = {}  # id -> (first block, blocks) fetched
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the runner
        self.num_preemptions = 0
        self._preempted: list[Request] = []  # since the last take_preempted()
        # block table lengths cut by rejected drafts, for the runner (CachedRequestData)
        self._num_kept_block_ids: dict[str, int] = {}
        # fault isolation (EngineCore): schedule only this request while set
        self.isolated_request_id: str | None = None

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            QueueFullError: the free running slots (max_num_seqs - running) and
                `max_waiting_requests` more are already taken by waiting requests (a burst that
                arrives before the next schedule() fills the free slots first).
        """
        num_waiting = len(self.waiting) + len(self.waiting_for_remote_kv)
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        if num_waiting >= self.config.max_waiting_requests + free_slots:
            raise QueueFullError(
                f"{num_waiting} requests are waiting for {free_slots} free running slots and "
                f"max_waiting_requests={self.config.max_waiting_requests} more; retry later or "
                f"raise --max-waiting-requests.")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish (abort, stop string) requests by id; unknown or finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.waiting_for_remote_kv[request_id]
            else:
                self.waiting.remove(request)
            self._free_request(request, status)

    def wait_for_remote_kv(self, request_id: str) -> None:
        """Hold a just-added request out of scheduling while its blocks are fetched."""
        request = self.requests[request_id]
        self.waiting.remove(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[request_id] = request

    def remote_kv_ready(self, fetched: dict[str, tuple[int, int]]) -> None:
        """Requests whose fetch finished rejoin the queue; `fetched[id]` is (first block index,
        number of blocks) now staged for them (0 blocks when nothing was found)."""
        for request_id, (first_block, num_blocks) in fetched.items():
            request = self.waiting_for_remote_kv.pop(request_id, None)
            if request is None:
                continue  # aborted meanwhile
            request.status = RequestStatus.WAITING
            self._remote_kv[request_id] = (first_block, num_blocks)
            if request.num_preemptions:  # preempted requests go first, as in _preempt
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Draft tokens to score after each request's last token in the next step (replacing
        any not yet scheduled); unknown or finished ids are ignored."""
        for request_id, token_ids in draft_token_ids.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.spec_token_ids = list(token_ids)

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        """The one place a request ends: status set, blocks freed, runner told."""
        request.status = status
        self._remote_kv.pop(request.request_id, None)
        self._num_kept_block_ids.pop(request.request_id, None)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self.finished_req_ids)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.config.max_num_batched_tokens
        if self.isolated_request_id is not None:
            self._schedule_alone(out, budget, self.requests.get(self.isolated_request_id))
        else:
            budget, preempted = self._schedule_running(out, budget)
            if not preempted:
                self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.requests[request_id]
            if request.mm_inputs:   # images whose placeholder tokens this step computes
                start = request.num_computed_tokens
                if indices := images_in_range(request.mm_inputs, start, start + num_tokens):
                    out.scheduled_encoder_inputs[request_id] = indices
            request.num_computed_tokens += num_tokens
        if self.save_kv_blocks:
            out.kv_saves = self._blocks_to_save(out)
        return out

    def _schedule_alone(self, out: SchedulerOutput, budget: int, request: Request | None
                        ) -> None:
        """Schedule one request by itself (fault isolation); the others wait, keeping their
        blocks and their places."""
        running, waiting = self.running, self.waiting
        self.running = [r for r in running if r is request]
        self.waiting = deque(r for r in waiting if r is request)
        try:
            budget, preempted = self._schedule_running(out, budget)
            if not preempted:
                self._schedule_waiting(out, budget)
        finally:
            self.running = [r for r in running if r is not request] + self.running
            self.waiting = self.waiting + deque(r for r in waiting if r is not request)

    def undo_step(self, num_valid_tokens: dict[str, int]) -> None:
        """A step failed before its results were applied (EngineCore's fault isolation): each
        request (id -> its computed tokens before that step) goes back to the front of the
        queue to be recomputed, as after a preemption, and the blocks that step was filling
        leave the prefix cache (their KV is not valid)."""
        for request in reversed([r for r in self.running if r.request_id in num_valid_tokens]):
            self.kv_cache_manager.uncache_blocks(request, num_valid_tokens[request.request_id])
            self.running.remove(request)
            self._preempt(request)
            self.num_preemptions -= 1   # not a preemption for want of blocks

    def _blocks_to_save(self, out: SchedulerOutput) -> list[KVBlocks]:
        """Full prompt blocks this step completes; a request that hands its KV to a decode
        worker (`do_remote_decode`) also saves the prefix-cache hits it started from."""
        block_size = self.kv_cache_manager.block_size
        new_ids = {new.request_id for new in out.scheduled_new_reqs}
        saves = []
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.requests[request_id]
            start = (request.num_computed_tokens - num_tokens) // block_size
            if request_id in new_ids and (request.kv_transfer_params or {}).get(
                    "do_remote_decode"):
                start = 0
            end = min(request.num_computed_tokens, request.num_prompt_tokens) // block_size
            if end > start:
                block_ids = self.kv_cache_manager.get_block_ids(request_id)[start:end]
                saves.append(KVBlocks(request_id, block_ids, request.block_hashes[start:end]))
        return saves

    def _chunk(self, num_remaining_tokens: int, budget: int) -> int:
        """Tokens to schedule for a request `num_remaining_tokens` behind its target."""
        num_tokens = min(num_remaining_tokens, budget)
        if self.config.long_prefill_token_threshold:
            num_tokens = min(num_tokens, self.config.long_prefill_token_threshold)
        return num_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_known = request.num_tokens + request.num_output_placeholders
            if num_known >= request.max_total_tokens and request.num_output_placeholders:
                index += 1  # async scheduling: its in-flight token is its last (max_tokens)
                continue
            drafts = self._drafts_to_score(request, num_known)
            num_tokens = self._chunk(num_known + len(drafts) - request.num_computed_tokens,
                                     budget)
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_tokens)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_tokens)
            if new_block_ids is None:
                break
            out.scheduled_cached_reqs.append(CachedRequestData(
                request.request_id, new_block_ids, request.num_computed_tokens,
                self._num_kept_block_ids.pop(request.request_id, None)))
            out.num_scheduled_tokens[request.request_id] = num_tokens
            num_drafts = num_tokens - (num_known - request.num_computed_tokens)
            if num_drafts > 0:   # the drafts the budget left room for
                out.scheduled_spec_decode_tokens[request.request_id] = drafts[:num_drafts]
            budget -= num_tokens
            index += 1
        return budget, preempted

    def _drafts_to_score(self, request: Request, num_known: int) -> list[int]:
        """The request's drafts to score this step, taken off it: none unless it is a decode
        row (one known token behind, nothing in flight); at most as many as its token limit
        leaves room for after the token that scoring them samples."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if (not drafts or request.num_output_placeholders
                or request.num_computed_tokens != num_known - 1):
            return []
        return drafts[:max(request.max_total_tokens - num_known - 1, 0)]

    def _preempt(self, request: Request) -> None:
        self._num_kept_block_ids.pop(request.request_id, None)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self.finished_req_ids.add(request.request_id)  # the runner drops its state; resent as new
        self._preempted.append(request)

    def take_preempted(self) -> list[Request]:
        """Requests preempted since the last call that still wait (the KV store may hold what
        their preemption evicted)."""
        preempted, self._preempted = self._preempted, []
        return [r for r in preempted if r.status == RequestStatus.PREEMPTED]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_remote_tokens = self._num_remote_kv_tokens(request, len(hit_blocks))
            num_tokens = self._chunk(request.num_tokens - num_hit_tokens - num_remote_tokens,
                                     budget)
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_tokens, hit_blocks,
                                                                 num_remote_tokens)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            num_hit_tokens += num_remote_tokens
            if self._remote_kv.pop(request.request_id, None) is not None:
                num_remote_blocks = num_remote_tokens // self.kv_cache_manager.block_size
                out.kv_loads.append(KVBlocks(
                    request.request_id, new_block_ids[:num_remote_blocks],
                    request.block_hashes[len(hit_blocks):len(hit_blocks) + num_remote_blocks]))
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled_new_reqs.append(NewRequestData(
                request_id=request.request_id, token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=num_hit_tokens, sampling_params=request.sampling_params,
                seed=request.seed, mm_inputs=request.mm_inputs))
            out.num_scheduled_tokens[request.request_id] = num_tokens
            budget -= num_tokens

    def _num_remote_kv_tokens(self, request: Request, num_hit_blocks: int) -> int:
        """Tokens of fetched store blocks that extend the local prefix-cache hits (0 when the
        local prefix shrank below the fetched range since the lookup)."""
        first_block, num_blocks = self._remote_kv.get(request.request_id, (0, 0))
        if first_block > num_hit_blocks:
            return 0
        return max(first_block + num_blocks - num_hit_blocks, 0) * self.kv_cache_manager.block_size

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply token-level stop rules, free finished requests."""
        outputs = []
        for index, request_id in enumerate(runner_output.req_ids):
            sampled = runner_output.sampled_token_ids[index]
            request = self.requests.get(request_id)
            if not sampled or request is None:
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if drafts:
                self._roll_back_rejected(request, len(drafts) + 1 - len(sampled))
            new_token_ids: list[int] = []
            status = None
            for token_id in sampled:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                status = request.check_stop()
                if status is not None:
                    break
            logprobs = runner_output.logprobs[index] if runner_output.logprobs else None
            if logprobs is not None:
                logprobs = logprobs[:len(new_token_ids)]
            if status is not None:  # also when preempted with a token in flight (async)
                self.finish_requests((request_id,), status)
            outputs.append(EngineCoreOutput(request_id, new_token_ids, logprobs,
                                            status.finish_reason if status else None,
                                            request.stop_reason,
                                            max(request.num_cached_tokens, 0)))
        return outputs

    def _roll_back_rejected(self, request: Request, num_rejected: int) -> None:
        """Forget the KV of `num_rejected` rejected draft positions: lower
        `num_computed_tokens` and free the blocks wholly past it (the runner is told to cut
        its block table at the request's next schedule)."""
        if num_rejected <= 0:
            return
        request.num_computed_tokens -= num_rejected
        num_kept = self.kv_cache_manager.free_blocks_past(request, request.num_computed_tokens)
        if num_kept is not None:
            self._num_kept_block_ids[request.request_id] = num_kept

    def get_stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.block_pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_remote_kv),
            kv_cache_usage=pool.usage, num_kv_blocks=pool.num_blocks,
            num_free_kv_blocks=pool.num_free_blocks,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            num_preemptions=self.num_preemptions)
