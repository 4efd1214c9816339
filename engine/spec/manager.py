"""`SpecDecoder`: the step loop's speculative decoding, between the drafter and the scheduler.

Before each schedule, `propose` asks the drafter for drafts of every running request that
decodes next (one known token behind, nothing in flight), decides how many of each
to verify (varlen: DSpark's admission over the step-rate table, counting the prefill tokens the
step will carry; fixed: num_speculative_tokens) and hands them to the scheduler
(`Scheduler.update_draft_token_ids`). After the step, `observe` tells the drafter how many drafts
were accepted (its confidences learn from it), re-measures the step rate and counts the
metrics (`SpecDecodeStats`). Acceptance itself happens in the model runner: a draft is accepted
iff it equals the target's own sample at that position (greedy argmax, or the seeded
exponential race), so outputs are those of plain decoding (engine/model_runner.py).

Pure module: no torch import.
"""

from __future__ import annotations

from deepinfer.engine.config import SpeculativeConfig
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput, SpecDecodeStats
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.spec.admission import admit_fixed, admit_varlen
from deepinfer.engine.spec.drafter import DraftRequest, Drafter
from deepinfer.engine.spec.step_rate import StepRateTable

GREEDY_TEMPERATURE = 1e-5   # engine/sampling_metadata.py's threshold


def decodes_next(request: Request) -> bool:
    """True for a running request whose next step is a plain decode that may carry drafts
    (structured outputs too: the runner masks each draft position by its grammar)."""
    return (request.num_output_placeholders == 0
            and request.num_computed_tokens == request.num_tokens - 1)


def prefill_tokens_next(scheduler: Scheduler) -> int:
    """An estimate of the prefill tokens the next step carries: running requests still behind
    by more than one token, then waiting prompts while running slots last, capped by the token
    budget (the scheduler itself decides; this only sizes the admission's base batch)."""
    budget = scheduler.config.max_num_batched_tokens
    behind = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.running
                 if r.num_tokens - r.num_computed_tokens > 1)
    slots = max(scheduler.config.max_num_seqs - len(scheduler.running), 0)
    waiting = sum(r.num_tokens for r in list(scheduler.waiting)[:slots])
    return min(behind + waiting, budget)


class SpecDecoder:
    """Args:
        config: the speculative decoding settings.
        drafter: proposes drafts and confidences (engine/spec/drafter.py).
        step_rate: SPS(B) for varlen admission (None: fixed length).
        max_num_batched_tokens: the step's token budget.
    """

    def __init__(self, config: SpeculativeConfig, drafter: Drafter,
                 step_rate: StepRateTable | None, max_num_batched_tokens: int):
        self.config = config
        self.drafter = drafter
        self.step_rate = step_rate if config.spec_varlen else None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self._proposed: dict[str, list[int]] = {}   # request id -> drafts handed over

    def propose(self, scheduler: Scheduler) -> dict[str, list[int]]:
        """Draft for the next step and hand the admitted drafts to the scheduler; returns them
        (request id -> draft ids, only requests with at least one)."""
        gamma = self.config.num_speculative_tokens
        decoding = [r for r in scheduler.running if decodes_next(r)]
        views = [DraftRequest(r.request_id, r.all_token_ids, r.num_prompt_tokens,
                              max_drafts=min(gamma, max(r.max_total_tokens - r.num_tokens - 1, 0)),
                              greedy=r.sampling_params.temperature < GREEDY_TEMPERATURE)
                 for r in decoding]
        proposals = self.drafter.propose([v for v in views if v.max_drafts > 0])
        ids = [r.request_id for r in decoding]
        drafts = [proposals[i].token_ids if i in proposals else [] for i in ids]
        if self.step_rate is not None:
            lengths = admit_varlen(
                [proposals[i].confidences if i in proposals else [] for i in ids],
                self.step_rate, base_tokens=len(ids) + prefill_tokens_next(scheduler),
                max_tokens=self.max_num_batched_tokens)
        else:
            lengths = admit_fixed([len(d) for d in drafts], gamma)
        admitted = {i: d[:n] for i, d, n in zip(ids, drafts, lengths) if n > 0}
        for request_id in proposals.keys() - admitted.keys():
            self.drafter.observe(request_id, 0, 0)   # proposed, none verified
        scheduler.update_draft_token_ids({i: admitted.get(i, []) for i in ids})
        self._proposed = admitted
        return admitted

    def observe(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                step_seconds: float | None) -> None:
        """A step's results: acceptance per request to the drafter and the metrics, and the
        step's time to the step-rate table (None: not timed)."""
        scored = scheduler_output.scheduled_spec_decode_tokens
        for request_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            drafts = scored.get(request_id)
            if not drafts or not sampled:
                continue
            num_accepted = min(len(sampled) - 1, len(drafts))
            self.drafter.observe(request_id, len(drafts), num_accepted)
            stats = self.stats
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                stats.num_accepted_tokens_per_pos[position] += 1
        for request_id in self._proposed.keys() - scored.keys():
            self.drafter.observe(request_id, 0, 0)   # admitted, but the budget left no room
        self._proposed = {}
        if self.step_rate is not None and step_seconds is not None:
            self.step_rate.observe(scheduler_output.total_num_scheduled_tokens, step_seconds)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.drafter.forget(request_id)
