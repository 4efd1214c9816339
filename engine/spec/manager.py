"""`SpecDecoder`: the step loop's speculative decoding, between the drafter and the scheduler.

Before each schedule, `propose` asks the drafter for drafts of every running request that
decodes next (one known token behind, nothing in flight), decides how many of each
to verify (varlen: DSpark's admission over the step-rate table, counting the prefill tokens the
step will carry; fixed: num_speculative_tokens) and hands them to the scheduler
(`Scheduler.update_draft_token_ids`). After the step, `observe` tells the drafter how many drafts
were accepted (its confidences learn from it), re-measures the step rate (plain or verify step)
and counts the metrics (`SpecDecodeStats`).

When drafting cannot pay, the step is a plain decode step and costs what one costs: with varlen,
if even a sure draft would not raise the admission's Theta over the plain step
(`drafting_can_pay`), the drafter is not called at all; and a request whose last
`MISSES_BEFORE_BACKOFF` verified proposals were all rejected at their first draft is not
proposed for 1, 2, 4, ... up to `max_backoff_steps` steps (then proposed again; varlen only:
fixed length verifies every request, the baseline it is). Every `probe_interval` steps without
drafting (varlen; 4x as many once the verify step of one draft more than the plain batch was
measured `PROBES` times), the surest first draft is verified anyway, a little exploration that
keeps two traps open: a decision to stop drafting that rests on a start-up profile or a verify
step another process slowed (the table's load factor keeps measured points comparable), and a
confidence bucket whose estimate fell below what pays after a few early misses, which nothing
would ever verify (and so correct) again.

Acceptance itself happens in the model runner: a draft is accepted iff it equals the target's own
sample at that position (greedy argmax, or the seeded exponential race), so outputs are those of
plain decoding (engine/model_runner.py).

Pure module: no torch import.
"""

from __future__ import annotations

from deepinfer.engine.config import SpeculativeConfig
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput, SpecDecodeStats
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.spec.admission import admit_fixed, admit_varlen, drafting_can_pay
from deepinfer.engine.spec.drafter import DraftRequest, Drafter
from deepinfer.engine.spec.step_rate import StepRateTable

GREEDY_TEMPERATURE = 1e-5   # engine/sampling_metadata.py's threshold
MISSES_BEFORE_BACKOFF = 2   # verified proposals rejected at draft 1 in a row before a back-off
PROBES = 3                  # verify steps measured at B0 + 1 before probes grow 4x rarer
PLAIN_MEASUREMENTS = 3      # async plain steps measured at a batch size before drafting there


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
        max_backoff_steps: the longest a request whose drafts keep failing goes unproposed.
        probe_interval: varlen steps without drafting between two probes (0: never probe).
    """

    def __init__(self, config: SpeculativeConfig, drafter: Drafter,
                 step_rate: StepRateTable | None, max_num_batched_tokens: int, *,
                 max_backoff_steps: int = 8, probe_interval: int = 8):
        self.config = config
        self.drafter = drafter
        self.step_rate = step_rate if config.spec_varlen else None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_backoff_steps = max_backoff_steps
        self.probe_interval = probe_interval
        self.stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        # set by the engine when steps without drafts run asynchronously (varlen n-gram on
        # CUDA): each batch size's overlapped plain step is then measured first
        self.async_plain_steps = False
        self.num_steps = 0            # propose calls
        self.num_skipped_steps = 0    # ... that did not call the drafter (drafting cannot pay)
        self._steps_without_drafts = 0
        self._proposed: dict[str, list[int]] = {}   # request id -> drafts handed over
        self._misses: dict[str, int] = {}           # request id -> rejected-at-once in a row
        self._resume_step: dict[str, int] = {}      # request id -> first step it is proposed

    def may_draft(self, scheduler: Scheduler) -> bool:
        """Whether the next step may carry drafts, asked before its requests' last tokens are
        known (a step in flight): False only under varlen admission when no probe is due and
        even a sure draft cannot pay at the running batch (`drafting_can_pay`). The engine
        then launches the step without waiting for the one in flight (async scheduling), as
        a plain decode step; fixed length drafts every step, so it always answers True.
        With `async_plain_steps`, a batch size whose overlapped plain step was measured fewer
        than PLAIN_MEASUREMENTS times runs plain first: the start-up profile times blocking
        steps, which overstates what a plain step costs when the host overlaps the device."""
        if self.step_rate is None:
            return True
        num_rows = len(scheduler.running)
        if num_rows == 0:
            return False
        base_tokens = num_rows + prefill_tokens_next(scheduler)
        if self.async_plain_steps and self.step_rate.measured(
                base_tokens, verify=False) < PLAIN_MEASUREMENTS:
            return False   # measure what an overlapped plain step costs at this batch first
        if self._probe_due(base_tokens):
            return True
        return drafting_can_pay(num_rows, self.step_rate, base_tokens=base_tokens,
                                plain_steps_per_second=self.step_rate.plain_rate(base_tokens),
                                max_tokens=self.max_num_batched_tokens)

    def skip_step(self, scheduler: Scheduler) -> None:
        """The next step carries no drafts (`may_draft` said so): counted as a step that did
        not call the drafter, without asking it."""
        self.num_steps += 1
        self._hand_over(scheduler, [r.request_id for r in scheduler.running if decodes_next(r)],
                        {}, skipped=True)

    def _probe_due(self, base_tokens: int) -> bool:
        interval = self.probe_interval * (
            1 if self.step_rate.measured(base_tokens + 1) < PROBES else 4)
        return self.probe_interval > 0 and self._steps_without_drafts + 1 >= interval

    def propose(self, scheduler: Scheduler) -> dict[str, list[int]]:
        """Draft for the next step and hand the admitted drafts to the scheduler; returns them
        (request id -> draft ids, only requests with at least one)."""
        self.num_steps += 1
        gamma = self.config.num_speculative_tokens
        decoding = [r for r in scheduler.running if decodes_next(r)]
        ids = [r.request_id for r in decoding]
        if not ids:
            return self._hand_over(scheduler, ids, {}, skipped=False)
        base_tokens = len(ids) + prefill_tokens_next(scheduler)
        plain_rate = None
        probe = False
        if self.step_rate is not None:
            plain_rate = self.step_rate.plain_rate(base_tokens)
            probe = self._probe_due(base_tokens)
            if not probe and not drafting_can_pay(
                    len(ids), self.step_rate, base_tokens=base_tokens,
                    plain_steps_per_second=plain_rate, max_tokens=self.max_num_batched_tokens):
                return self._hand_over(scheduler, ids, {}, skipped=True)
        views = [DraftRequest(r.request_id, r.all_token_ids, r.num_prompt_tokens,
                              max_drafts=min(gamma, max(r.max_total_tokens - r.num_tokens - 1, 0)),
                              greedy=r.sampling_params.temperature < GREEDY_TEMPERATURE)
                 for r in decoding if self._resume_step.get(r.request_id, 0) <= self.num_steps]
        views = [v for v in views if v.max_drafts > 0]
        proposals = self.drafter.propose(views) if views else {}
        drafts = [proposals[i].token_ids if i in proposals else [] for i in ids]
        confidences = [proposals[i].confidences if i in proposals else [] for i in ids]
        if self.step_rate is not None:
            lengths = admit_varlen(confidences, self.step_rate, base_tokens=base_tokens,
                                   max_tokens=self.max_num_batched_tokens,
                                   plain_steps_per_second=plain_rate)
            if probe and not any(lengths):
                lengths = probe_lengths(confidences)
        else:
            lengths = admit_fixed([len(d) for d in drafts], gamma)
        admitted = {i: d[:n] for i, d, n in zip(ids, drafts, lengths) if n > 0}
        for request_id in proposals.keys() - admitted.keys():
            self.drafter.observe(request_id, 0, 0)   # proposed, none verified
        return self._hand_over(scheduler, ids, admitted, skipped=False, probed=probe)

    def _hand_over(self, scheduler: Scheduler, ids: list[str], admitted: dict[str, list[int]],
                   *, skipped: bool, probed: bool = False) -> dict[str, list[int]]:
        """The step's drafts to the scheduler (none for the other decode rows)."""
        self.num_skipped_steps += skipped
        self._steps_without_drafts = (0 if admitted or probed
                                      else self._steps_without_drafts + 1)
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
            if self.step_rate is not None:   # varlen's policy; fixed verifies every request
                self._back_off(request_id, num_accepted)
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
            self.step_rate.observe(scheduler_output.total_num_scheduled_tokens, step_seconds,
                                   verify=bool(scored))

    def _back_off(self, request_id: str, num_accepted: int) -> None:
        """After a verify: a request rejected at its first draft `MISSES_BEFORE_BACKOFF` times
        in a row (and more) skips proposals for 1, 2, 4, ... <= max_backoff_steps steps."""
        if num_accepted > 0:
            self._misses.pop(request_id, None)
            self._resume_step.pop(request_id, None)
            return
        misses = self._misses.get(request_id, 0) + 1
        self._misses[request_id] = misses
        if misses >= MISSES_BEFORE_BACKOFF and self.max_backoff_steps > 0:
            wait = min(2 ** (misses - MISSES_BEFORE_BACKOFF), self.max_backoff_steps)
            self._resume_step[request_id] = self.num_steps + 1 + wait

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.drafter.forget(request_id)
            self._misses.pop(request_id, None)
            self._resume_step.pop(request_id, None)


def probe_lengths(confidences: list[list[float]]) -> list[int]:
    """A probe step's admission: the one first draft with the highest confidence (ties: the
    earlier request); nothing else. Draft-independent like `admit_varlen`."""
    lengths = [0] * len(confidences)
    best = max(range(len(confidences)), key=lambda r: confidences[r][0] if confidences[r]
               else -1.0, default=None)
    if best is not None and confidences[best]:
        lengths[best] = 1
    return lengths
