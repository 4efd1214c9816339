"""`SpecDecoder`: the step loop's speculative decoding, between the drafter and the scheduler.

Before each schedule, `propose` asks the drafter for drafts of every running request that
decodes next (one known token behind, nothing in flight), decides how many of each
to verify (varlen: DSpark's admission over the step-rate table, counting the prefill tokens the
step will carry, with a capacity from the last proposal's confidences when that capacity needs
positions past the first; fixed: num_speculative_tokens) and hands them to the scheduler
(`Scheduler.update_draft_token_ids`). After the step, `observe` tells the drafter how many drafts
were accepted (its confidences learn from it), re-measures the step rate (plain or verify step)
and counts the metrics (`SpecDecodeStats`).

When drafting cannot pay, the step is a plain decode step and costs what one costs: with varlen,
if even a sure first draft for every request would not open the admission's gate
(`drafting_can_pay`), the drafter is not called at all. Where plain steps overlap the host
(`async_plain_steps`), a look (a step that calls the drafter) is a blocking step, and it and
every verify step are timed by their whole loop iteration (EngineCore), as an overlapped plain
step is by its period. When sure drafts would pay but the last look admitted nothing, the
drafter is first asked without blocking, from the tokens known while a step is in flight (a
peek: one token behind, its first draft guessing the token in flight); a look follows only
when that proposal would pay. Peeks, and the looks they asked for that admitted nothing, are
charged to an account of their own, within one allowance with exploration's
(`spec_explore_fraction` of the elapsed step time, `BudgetAccount`); a look not asked for by a
peek waits for that allowance too, priced (and charged) at the median of what
the last few fruitless looks at its batch size cost (`look_cost`). A hunt (the
looks after one that admitted nothing) that finds drafts worth verifying pays its account back:
the verify step's realized saving (the plain-step time its committed tokens would have taken,
less its own time) comes off the debt of the account that paid for the hunt, down to none. Where
drafts pass (grounded prompts at batch 1 on the H100: ~4.5 tokens a verify step of 1-1.6 ms
against 0.95 ms plain steps, several plain steps saved where a fruitless look costs less than
one) the hunt goes on; where they do not (chat at batch 16), the debt stays. And a hunt for
requests whose own looks have paid needs no budget (`hunts_pay`, kept per request: its hunts'
net saving decides), so that one kind of traffic's losses at a batch size do not stop another's
looks there. A request never looked at peeks without a budget on its first FRESH_PEEKS steps
and then at its 4th, 8th, 16th, ... output token (`_fresh`), until a peek asks for a look: a
blocking first look for every new request cost free chat at batch 16 on the H100 four looks of
~2 ms a run (1.5 % of its time), where a peek costs host time only; and peeks on the first
steps alone missed grounded requests whose output starts with words of its own (grounded b1
fell to 2.21x in one process of four).
And a request whose last `MISSES_BEFORE_BACKOFF` verified proposals were all rejected at their
first draft is not proposed for 1, 2, 4, ... up to `spec_max_backoff_steps` steps (then
proposed again; varlen only: fixed length verifies every request, the baseline it is).

Exploration (varlen), bounded by its cost: the admission only re-measures the verify costs it
chooses, so a cost that a profile or a slowed step overstated, or a confidence bucket that fell
below what pays after a few early misses, would never be tried (and so corrected) again. An
exploration step verifies more than the admission chose, draft-independently: when nothing was
admitted, the gate's best set of surest first drafts (`best_entry`); else the next-ranked
candidates after the walk's stop, half as many again (`top_candidates`). It runs only while
what all exploration steps cost (each charged at the median of its batch bucket's last
COST_WINDOW, so that a stalled step does not spend the budget), plus this one's predicted
cost, stays below `spec_explore_fraction` of the elapsed step time. Past drafts the admission
chose, an exploration costs its measured time minus the predicted time of that choice, less
the plain-step time of the drafts it got accepted (no credit for what it may commit); one of a
shut gate costs its time over that of the plain steps its committed tokens would take, divided
by the gate's margin (1 + `spec_min_gain`, raised by the realized shortfall): it is free only
where it realized a gain the gate would have admitted. Either may then go on. Charged against
the plain steps alone, free chat at batch 16 on a 2-core Xeon explored on 51-98 of its 128
steps a run (each accepting ~1.5 drafts: about what it cost, while a closed batch saves less
than a plain step's time per token), through a gate its realized gains kept shut, and read
0.92-0.98x of speculation off. On a fast device a blocking step costs several overlapped plain
steps: probes at a fixed interval (every 8 steps without drafts) held chat at batch 16 on the
H200 at 0.85x of speculation off.

What the admission predicted is checked against what happened (varlen): each verify step's
realized throughput gain over the plain step (an exploration's too) is compared with the gain
the same prices and confidences predicted for it, and the batch bucket's shortfall raises the
gate's margin there (engine/spec/realized_gain.py): prices and confidences that the table's
own re-measurement does not correct stop costing throughput after a few steps, and
explorations reopen a gate whose predictions hold again.

Acceptance itself happens in the model runner: a draft is accepted iff it equals the target's own
sample at that position (greedy argmax, or the seeded exponential race), so outputs are those of
plain decoding (engine/model_runner.py).

Pure module: no torch import.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from deepinfer.engine.config import SpeculativeConfig
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput, SpecDecodeStats
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.spec.admission import (admit_fixed, admit_varlen, best_entry, capacity,
                                             drafting_can_pay, expected_committed,
                                             ranked_candidates, top_candidates)
from deepinfer.engine.spec.drafter import DraftRequest, Drafter
from deepinfer.engine.spec.realized_gain import RealizedGain
from deepinfer.engine.spec.step_rate import StepRateTable, batch_bucket, median

GREEDY_TEMPERATURE = 1e-5   # engine/sampling_metadata.py's threshold
MISSES_BEFORE_BACKOFF = 2   # verified proposals rejected at draft 1 in a row before a back-off
PLAIN_MEASUREMENTS = 3      # async plain steps measured at a batch size before drafting there
# where plain steps overlap the host, a plain step whose key already holds a full window of
# measurements is timed once in this many: every observation rebuilds the step-rate readers
# and re-decides `drafting_can_pay`, host work that a step skipping the drafter paid in full
# (1-layer Llama, async scheduling on the 2-core CPU box, batch 16, nothing to verify: 0.12
# ms a step over off's 1.36 ms)
PLAIN_SAMPLE_EVERY = 8
# fruitless looks (exploration steps) per batch bucket whose median prices and charges one
COST_WINDOW = 5
# a request's hunts (looks after one that admitted nothing) whose net value decides whether
# the next hunt needs a budget (`SpecDecoder.hunts_pay`)
HUNT_WINDOW = 8
# a request never looked at peeks without a budget on this many first steps, then at each
# power-of-two output length (`SpecDecoder._fresh`)
FRESH_PEEKS = 4
# why a step did not call the drafter (`SpecDecoder.skip_reasons`): nothing running decodes (a
# prefill-only step); its batch's overlapped plain
# step not measured PLAIN_MEASUREMENTS times yet; even sure first drafts would not pay and no
# exploration fits its budget; sure drafts would pay but the last look admitted nothing and
# neither a look nor a peek fits its budget; a peek said this step's drafts would not pay
SKIP_REASONS = ("no_decode_rows", "measuring_plain", "gate_closed", "no_look_budget",
                "peek_declined")


def decodes_next(request: Request) -> bool:
    """True for a running request whose next step is a plain decode that may carry drafts
    (structured outputs too: the runner masks each draft position by its grammar)."""
    return (request.num_output_placeholders == 0
            and request.num_computed_tokens == request.num_tokens - 1)


def draft_view(request: Request, gamma: int, behind: int = 0) -> DraftRequest:
    """What the drafter sees of `request`: its known tokens and up to gamma drafts within its
    token limit, plus `behind` more (a peek: the first guesses the token still in flight)."""
    limit = min(gamma, max(request.max_total_tokens - request.num_tokens - 1 - behind, 0))
    return DraftRequest(request.request_id, request.all_token_ids, request.num_prompt_tokens,
                        max_drafts=limit + behind if limit else 0,
                        greedy=request.sampling_params.temperature < GREEDY_TEMPERATURE)


def prefill_tokens_next(scheduler: Scheduler) -> int:
    """An estimate of the prefill tokens the next step carries: running requests still behind
    by more than one token, then waiting prompts while running slots last, capped by the token
    budget (the scheduler itself decides; this only sizes the admission's base batch)."""
    behind = 0
    for r in scheduler.running:   # read every step: the attributes, not the properties
        gap = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
        if gap > 1:
            behind += gap
    slots = max(scheduler.config.max_num_seqs - len(scheduler.running), 0)
    waiting = sum(r.num_tokens for r in list(scheduler.waiting)[:slots]) if slots else 0
    return min(behind + waiting, scheduler.config.max_num_batched_tokens)


@dataclass
class BudgetAccount:
    """One batch bucket's exploration and peek accounts (seconds): the step time observed
    there, and what exploration steps and fruitless looks (`explore`) and peeks and the looks
    they asked for (`peek`) cost there. Together they may spend `spec_explore_fraction` of
    `elapsed` (each its own share read twice that: free chat at batch 16 on the H100 spent
    8-15 ms of looks and peeks a 495 ms run, and ran at 0.97-0.99x of speculation off); kept
    apart so that a hunt's saving repays the one that paid for it. Kept per batch bucket
    (engine/spec/step_rate.batch_bucket), so that traffic where looking
    pays (grounded prompts at batch 1: their hunts repay what they cost) does not lend its
    allowance to traffic where it does not (chat at batch 16), nor the other way round (H100,
    SmolLM2, one account for all: chat at batch 16 spent 23-45 peeks a 130-step run on the
    allowance grounded traffic had earned, and grounded prompts then skipped the drafter on
    47-81 % of their steps)."""
    elapsed: float = 0.0
    explore: float = 0.0
    peek: float = 0.0
    largest: float = 0.0   # the largest single charge

    def fits(self, extra: float, fraction: float) -> bool:
        """Both accounts plus `extra` seconds stay within `fraction` of the elapsed time."""
        return fraction > 0.0 and self.explore + self.peek + extra <= fraction * self.elapsed

    def charge(self, peek: bool, seconds: float) -> None:
        """A fruitless look's or an exploration step's cost, to the peek account if a peek
        asked for it, else to the exploration one."""
        if peek:
            self.peek += seconds
        else:
            self.explore += seconds
        self.largest = max(self.largest, seconds)

    def repay(self, peek: bool, seconds: float) -> None:
        """A hunt's saving off the debt of the account that paid for it, down to none."""
        if peek:
            self.peek = max(self.peek - max(seconds, 0.0), 0.0)
        else:
            self.explore = max(self.explore - max(seconds, 0.0), 0.0)


def _recent_median(costs: dict[int, deque[float]], base_tokens: int, cost: float) -> float:
    """`cost` added to the last COST_WINDOW of `base_tokens`' batch bucket; their median."""
    window = costs.setdefault(batch_bucket(base_tokens), deque(maxlen=COST_WINDOW))
    window.append(cost)
    return median(window)


class SpecDecoder:
    """Args:
        config: the speculative decoding settings.
        drafter: proposes drafts and confidences (engine/spec/drafter.py).
        step_rate: step seconds for varlen admission (None: fixed length).
        max_num_batched_tokens: the step's token budget.
    """

    def __init__(self, config: SpeculativeConfig, drafter: Drafter,
                 step_rate: StepRateTable | None, max_num_batched_tokens: int):
        self.config = config
        self.drafter = drafter
        self.step_rate = step_rate if config.spec_varlen else None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.context_confidences = getattr(drafter, "context_confidences", False)
        self.stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        # set by the engine when steps without drafts run asynchronously (varlen n-gram on
        # CUDA): each batch size's overlapped plain step is then measured first
        self.async_plain_steps = False
        self.num_steps = 0            # propose calls
        self.num_skipped_steps = 0    # ... that did not call the drafter (drafting cannot pay)
        # why they did not (SKIP_REASONS -> steps), and the reason `may_draft` gave last
        self.skip_reasons: dict[str, int] = dict.fromkeys(SKIP_REASONS, 0)
        self._skip_reason = "gate_closed"
        self.num_explored_steps = 0   # ... that verified more than the admission chose
        self.num_verify_steps = 0     # steps observed that scored drafts
        self._plain_steps = 0         # plain steps offered to `observe` (PLAIN_SAMPLE_EVERY)
        self._step_accepted = 0       # drafts accepted in the last step observed
        self.accounts: dict[int, BudgetAccount] = {}   # batch bucket -> its budgets
        # an exploration step's baseline: the predicted seconds of the admission's own choice
        # and the drafts it chose (None: not exploring)
        self._explore_baseline: tuple[float, int] | None = None
        # a look: a step that called the drafter and verified nothing (on the GPU a blocking
        # plain step instead of an overlapped one): (drafter seconds, whether a peek asked
        # for it)
        self._look: tuple[float, bool] | None = None
        self._looks_pay: bool | None = None   # the last look admitted drafts (None: no look)
        # peeks (non-blocking looks, `_peek`): count, how many said a look would pay, their
        # host seconds; the last one said so (cleared when the look it asked for proposed)
        self.num_peeks = self.num_fruitful_peeks = 0
        self._peeked = False
        # batch bucket -> what its last COST_WINDOW fruitless looks cost, as measured; and
        # what its last COST_WINDOW exploration steps cost over the admission's choice
        self._look_costs: dict[int, deque[float]] = {}
        self._look_cost_medians: dict[int, float] = {}   # `look_cost`, read every step
        self._explore_costs: dict[int, deque[float]] = {}
        # which account paid for this step's look when the last look admitted nothing (True:
        # the peek account of its batch bucket, False: the exploration one; None: not
        # hunting): a verify step it finds pays that account back
        self._hunt: bool | None = None
        # request id -> its share of the net seconds of its last HUNT_WINDOW hunts
        # (`hunts_pay`); the requests the drafter was asked about (`_fresh`); the decode
        # rows of the last look
        self._hunt_values: dict[str, deque[float]] = {}
        self._looked: set[str] = set()
        self._hunts_paying: set[str] = set()   # ... whose hunts' net saving is positive
        self._look_rows: list[str] = []
        self._proposed: dict[str, list[int]] = {}   # request id -> drafts handed over
        self._last_confidences: dict[str, list[float]] = {}   # of the last proposal
        self._misses: dict[str, int] = {}           # request id -> rejected-at-once in a row
        self._resume_step: dict[str, int] = {}      # request id -> first step it is proposed
        # `drafting_can_pay` of the last (rows, base tokens, step-rate reader) asked: may_draft
        # and propose ask it of the same step
        self._can_pay: tuple[tuple | None, bool] = (None, False)
        # varlen: each admitted verify step's realized gain against its prediction raises
        # the gate's margin of its batch bucket (engine/spec/realized_gain.py)
        self.realized_gain = RealizedGain()
        # (expected committed tokens, priced cost t(D) / t(0), decode rows) of the step
        self._prediction: tuple[float, float, int] | None = None

    def _min_gain(self, base_tokens: int) -> float:
        """The gate's margin at a batch of `base_tokens`: `spec_min_gain`, raised by the
        shortfall of its batch bucket's realized gains."""
        return self.realized_gain.min_gain(base_tokens, self.config.spec_min_gain)

    def may_draft(self, scheduler: Scheduler) -> bool:
        """Whether the next step may carry drafts, asked before its requests' last tokens are
        known (a step in flight): False only under varlen admission when even a sure first
        draft for every running request cannot pay at the running batch
        (`drafting_can_pay`) and no exploration fits its budget. The engine then launches the
        step without waiting for the one in flight (async scheduling), as a plain decode
        step; fixed length drafts every step, so it always answers True.
        With `async_plain_steps`, a batch size whose overlapped plain step was measured fewer
        than PLAIN_MEASUREMENTS times runs plain first (the start-up profile times blocking
        steps, which overstates what a plain step costs when the host overlaps the device),
        unless the last look admitted drafts: drafting that pays goes on while requests
        finish and the batch shrinks (3 plain steps at each new batch size cost the synthetic
        chart at batch 16 a quarter of its speedup)."""
        if self.step_rate is None:
            return True
        num_rows = len(scheduler.running)
        if num_rows == 0:
            self._skip_reason = "no_decode_rows"
            return False
        base_tokens = num_rows + prefill_tokens_next(scheduler)
        if self.async_plain_steps and not self._looks_pay and self.step_rate.measured(
                base_tokens) < PLAIN_MEASUREMENTS:
            self._skip_reason = "measuring_plain"   # what an overlapped plain step costs here
            return False
        rows = [r.request_id for r in scheduler.running]
        if self._may_verify(rows, base_tokens):
            return True
        if self._can_pay[1] and self.async_plain_steps and (
                self._fresh(scheduler.running, rows) or self._peek_due(base_tokens)):
            self._peeked = self._peek(scheduler, base_tokens)
            self._skip_reason = "peek_declined"
        else:
            self._skip_reason = self._no_draft_reason()
        return self._peeked

    @property
    def elapsed_seconds(self) -> float:
        """Observed step time, all batch buckets."""
        return sum(a.elapsed for a in self.accounts.values())

    @property
    def explore_seconds(self) -> float:
        """What exploration steps and fruitless looks cost, all batch buckets."""
        return sum(a.explore for a in self.accounts.values())

    @property
    def peek_seconds(self) -> float:
        """What peeks and the fruitless looks they asked for cost, all batch buckets."""
        return sum(a.peek for a in self.accounts.values())

    def _account(self, base_tokens: int) -> BudgetAccount:
        bucket = batch_bucket(base_tokens)
        account = self.accounts.get(bucket)
        if account is None:
            account = self.accounts[bucket] = BudgetAccount()
        return account

    def _peek_due(self, base_tokens: int) -> bool:
        """Peeking fits the budget of its batch bucket at a batch of `base_tokens`
        (`BudgetAccount.fits`; its peek account holds the peeks' host time, and what the
        looks they asked for cost when those admitted nothing)."""
        return self.async_plain_steps and self._account(base_tokens).fits(
            0.0, self.config.spec_explore_fraction)

    def _peek(self, scheduler: Scheduler, base_tokens: int) -> bool:
        """A non-blocking look, while the step in flight still holds each request's newest
        token: the drafter proposes from the tokens known (one behind), its first draft
        guessing the token in flight. Were that guess right, the next step's drafts would be
        the ones after it, with confidences [c_1 c_2, c_3, ...] (the guess must hold for any
        of them to pass): True when those would pay (`capacity` over them: an unconstrained
        search is fine here, the look this triggers re-proposes from the real token and its
        own admission decides). Costs host time only, counted in the peek account."""
        start = time.perf_counter()
        gamma = self.config.num_speculative_tokens
        views, rows = [], 0
        for r in scheduler.running:
            behind = r.num_output_placeholders == 1 and r.num_computed_tokens == r.num_tokens
            if not behind and not decodes_next(r):
                continue
            rows += 1
            view = draft_view(r, gamma, behind=int(behind))
            if view.max_drafts > behind and self._resume_step.get(
                    r.request_id, 0) <= self.num_steps + 1:
                views.append((behind, view))
        proposals = self.drafter.propose([v for _, v in views]) if views else {}
        confidences = []
        for behind, view in views:
            proposal = proposals.get(view.request_id)
            if proposal is None or len(proposal.confidences) <= behind:
                continue
            values = proposal.confidences
            confidences.append([values[0] * values[1], *values[2:]] if behind else values)
        pays = bool(confidences) and capacity(
            confidences, self.step_rate.step_seconds(base_tokens), base_committed=float(rows),
            max_drafts=max(self.max_num_batched_tokens - base_tokens, 0),
            min_gain=self._min_gain(base_tokens)) > 0
        self.num_peeks += 1
        self.num_fruitful_peeks += pays
        self._account(base_tokens).peek += time.perf_counter() - start
        return pays

    def _may_verify(self, rows: list[str], base_tokens: int) -> bool:
        """Whether to call the drafter for the decode rows `rows` (request ids): drafting can
        pay (sure first drafts would open the gate) and the last look found drafts worth
        verifying or looking costs no overlap (plain steps block too) or a peek said it would
        pay or the rows' hunts pay (`hunts_pay`), or a look or an exploration step (a first
        draft for each row, the most the gate's exploration verifies) fits the exploration
        budget."""
        if self._peeked:
            return True
        num_rows = len(rows)
        step_seconds = self.step_rate.step_seconds(base_tokens)
        max_drafts = max(self.max_num_batched_tokens - base_tokens, 0)
        min_gain = self._min_gain(base_tokens)
        # the reader lasts until an observation
        key = (num_rows, base_tokens, step_seconds, min_gain)
        if self._can_pay[0] != key:
            self._can_pay = key, drafting_can_pay(num_rows, step_seconds, max_drafts=min(
                max_drafts, num_rows * self.config.num_speculative_tokens),
                min_gain=min_gain)
        if self._can_pay[1]:
            return (self._looks_pay is not False or not self.async_plain_steps
                    or self.hunts_pay(rows)
                    or self._explore_due(self.look_cost(base_tokens), base_tokens))
        most = min(num_rows, max_drafts)
        return most > 0 and self._explore_due(step_seconds(most) - step_seconds(0),
                                              base_tokens)

    def _no_draft_reason(self) -> str:
        """Why `_may_verify` said no (SKIP_REASONS): sure drafts would pay but no look fits
        its budget, or even they would not and no exploration fits."""
        return "no_look_budget" if self._can_pay[1] else "gate_closed"

    def _explore_due(self, extra_seconds: float, base_tokens: int) -> bool:
        """An exploration step predicted to cost `extra_seconds` more than the admission's
        choice fits the budget of its batch bucket (`BudgetAccount.fits`: with what looks,
        explorations and peeks cost there, `SpeculativeConfig.spec_explore_fraction` of
        the step time observed there)."""
        return self._account(base_tokens).fits(max(extra_seconds, 0.0),
                                               self.config.spec_explore_fraction)

    def skip_step(self, scheduler: Scheduler) -> None:
        """The next step carries no drafts (`may_draft` said so): counted as a step that did
        not call the drafter, without asking it."""
        self.num_steps += 1
        self.num_skipped_steps += 1
        self.skip_reasons[self._skip_reason] += 1
        self._proposed = {}
        stale = {r.request_id: [] for r in scheduler.running if r.spec_token_ids}
        if stale:   # drafts handed over but not scheduled (the scheduler clears the rest)
            scheduler.update_draft_token_ids(stale)

    def propose(self, scheduler: Scheduler) -> dict[str, list[int]]:
        """Draft for the next step and hand the admitted drafts to the scheduler; returns them
        (request id -> draft ids, only requests with at least one)."""
        self.num_steps += 1
        self._explore_baseline = self._look = self._prediction = None
        self._hunt = None
        if self.async_plain_steps and self._looks_pay is False:
            self._hunt = self._peeked
        gamma = self.config.num_speculative_tokens
        try:
            return self._propose(scheduler, gamma)
        finally:
            self._peeked = False

    def _propose(self, scheduler: Scheduler, gamma: int) -> dict[str, list[int]]:
        decoding = [r for r in scheduler.running if decodes_next(r)]
        ids = [r.request_id for r in decoding]
        if not ids:
            return self._hand_over(scheduler, ids, {}, skipped=False)
        base_tokens = len(ids) + prefill_tokens_next(scheduler)
        if self.step_rate is not None and not self._may_verify(ids, base_tokens):
            self.skip_reasons[self._no_draft_reason()] += 1
            return self._hand_over(scheduler, ids, {}, skipped=True)
        views = [draft_view(r, gamma) for r in decoding
                 if self._resume_step.get(r.request_id, 0) <= self.num_steps]
        views = [v for v in views if v.max_drafts > 0]
        start = time.perf_counter()
        proposals = self.drafter.propose(views) if views else {}
        drafter_seconds = time.perf_counter() - start
        self._looked.update(ids)
        self._look_rows = ids
        drafts = [proposals[i].token_ids if i in proposals else [] for i in ids]
        confidences = [proposals[i].confidences if i in proposals else [] for i in ids]
        if self.step_rate is not None:
            step_seconds = self.step_rate.step_seconds(base_tokens)
            max_drafts = max(self.max_num_batched_tokens - base_tokens, 0)
            min_gain = self._min_gain(base_tokens)
            # DSpark §5.2: a capacity from the last proposal's confidences (unconstrained:
            # this step's drafts cannot have set them) carries past a jump the first
            # positions alone do not pay, when it needs
            # positions past the first (a capacity no larger than the first positions is what
            # the gate already priced, with fresher confidences)
            ranked = ranked_candidates(confidences)
            lengths = admit_varlen(confidences, step_seconds, max_drafts=max_drafts,
                                   min_gain=min_gain, ranked=ranked,
                                   context_confidences=self.context_confidences)
            earlier = [self._last_confidences.get(i, []) for i in ids]
            if sum(lengths) < min(sum(len(c) for c in earlier), max_drafts):
                # the capacity could admit more than the gate and the walk did
                carried = capacity(earlier, step_seconds, max_drafts=max_drafts,
                                   min_gain=min_gain)
                if carried > max(sum(lengths), sum(1 for c in earlier if c)):
                    lengths = admit_varlen(confidences, step_seconds, max_drafts=max_drafts,
                                           min_drafts=carried, min_gain=min_gain,
                                           ranked=ranked,
                                           context_confidences=self.context_confidences)
            self._last_confidences = {i: c for i, c in zip(ids, confidences) if c}
            self._looks_pay = any(lengths)
            lengths = self._explore(confidences, lengths, step_seconds, max_drafts,
                                    base_tokens)
            if any(lengths):   # scored against what it realizes (exploration steps too)
                self._prediction = (sum(map(expected_committed, confidences, lengths)),
                                    step_seconds(sum(lengths)) / step_seconds(0), len(ids))
            if not any(lengths):
                self._look = (drafter_seconds, self._peeked)
        else:
            lengths = admit_fixed([len(d) for d in drafts], gamma)
        admitted = {i: d[:n] for i, d, n in zip(ids, drafts, lengths) if n > 0}
        for request_id in proposals.keys() - admitted.keys():
            self.drafter.observe(request_id, 0, 0)   # proposed, none verified
        return self._hand_over(scheduler, ids, admitted, skipped=False)

    def _explore(self, confidences: list[list[float]], lengths: list[int], step_seconds,
                 max_drafts: int, base_tokens: int) -> list[int]:
        """The admission's lengths, or an exploration step's when one fits the budget (module
        docstring); both are draft-independent. What exploring costs is its step time minus
        the predicted time of the admission's choice, less the plain-step time of the drafts
        it got accepted (a realized saving; no credit for tokens it may commit: confidences
        can be overconfident, and then every exploration would look free); where that choice
        holds none, what its realized gain falls short of the gate's margin (module
        docstring)."""
        chosen = sum(lengths)
        if chosen == 0:
            target, _ = best_entry([c[0] if c else 0.0 for c in confidences], step_seconds,
                                   base_committed=float(len(confidences)),
                                   max_drafts=max_drafts)
        else:
            available = min(sum(len(c) for c in confidences), max_drafts)
            target = min(chosen + max(1, chosen // 2), available)
        if target <= chosen:
            return lengths
        baseline = step_seconds(chosen)
        if not self._explore_due(step_seconds(target) - baseline, base_tokens):
            return lengths
        self.num_explored_steps += 1
        self._explore_baseline = baseline, chosen
        return top_candidates(confidences, target)

    def _hand_over(self, scheduler: Scheduler, ids: list[str], admitted: dict[str, list[int]],
                   *, skipped: bool) -> dict[str, list[int]]:
        """The step's drafts to the scheduler (none for the other decode rows)."""
        self.num_skipped_steps += skipped
        scheduler.update_draft_token_ids({i: admitted.get(i, []) for i in ids})
        self._proposed = admitted
        return admitted

    def observe(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                step_seconds: float | None, *, measures_plain: bool = True) -> None:
        """A step's results: acceptance per request to the drafter and the metrics, and the
        step's time to the step-rate table (None: not timed; measures_plain False: a step
        without drafts that does not time the plain step, a blocking one while plain steps
        overlap the host) and to the exploration budget."""
        scored = scheduler_output.scheduled_spec_decode_tokens
        self._step_accepted = 0
        self.num_verify_steps += bool(scored)
        for request_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids
                                       ) if scored else ():
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
            self._step_accepted += num_accepted
            for position in range(num_accepted):
                stats.num_accepted_tokens_per_pos[position] += 1
        for request_id in self._proposed.keys() - scored.keys():
            self.drafter.observe(request_id, 0, 0)   # admitted, but the budget left no room
        self._proposed = {}
        if step_seconds is not None:
            self.observe_time(scheduler_output, step_seconds, measures_plain=measures_plain)

    def observe_time(self, scheduler_output: SchedulerOutput, step_seconds: float, *,
                     measures_plain: bool = True) -> None:
        """A step's time (the second half of `observe`, which the engine may call later: a
        blocking step, while plain steps overlap the host, costs its whole loop iteration,
        known when that ends) to the step-rate table and the exploration and peek
        budgets. Call it once per timed step, before the next `propose`."""
        scored = scheduler_output.scheduled_spec_decode_tokens
        if self.step_rate is not None:
            num_drafts = sum(len(d) for d in scored.values())
            base_tokens = scheduler_output.total_num_scheduled_tokens - num_drafts
            account = self._account(base_tokens)
            # the plain step as measured, what verify steps and looks are judged against (a
            # plain step, most steps, needs none)
            plain = (self.step_rate.measured_plain(base_tokens)
                     if num_drafts or self._look is not None else 0.0)
            if self._prediction is not None and num_drafts:
                expected, priced_cost, rows = self._prediction
                committed = rows + self._step_accepted
                measured_cost = step_seconds / plain if plain > 0.0 else 0.0
                self.realized_gain.observe(base_tokens, expected, committed, priced_cost,
                                           measured_cost)
                realized = committed / rows * plain / step_seconds   # the realized gain
                if self._hunt is not None and self._explore_baseline is None:
                    # the hunt found drafts the admission chose: what the plain steps
                    # committing its tokens would have taken, less its own time, repays it
                    saving = step_seconds * (realized - 1.0)
                    account.repay(self._hunt, saving)
                    self._hunt_value(list(scored), saving)
            if num_drafts or measures_plain and self._plain_due(base_tokens):
                self.step_rate.observe(base_tokens, num_drafts, step_seconds)
            account.elapsed += step_seconds
            if self._explore_baseline is not None and num_drafts:
                baseline, chosen = self._explore_baseline
                # the plain-step time of the drafts accepted (a plain step's per token)
                saved = self._step_accepted * plain / max(base_tokens, 1)
                # past the admission's drafts: its time over the choice's, less that; a shut
                # gate's: over what the plain steps for its tokens take, less the gate's margin
                extra = (step_seconds - baseline - saved if chosen else step_seconds
                         - (plain + saved) / (1.0 + self._min_gain(base_tokens)))
                account.charge(False, _recent_median(self._explore_costs, base_tokens,
                                                     max(extra, 0.0)))
            if self._look is not None and not num_drafts:
                drafter_seconds, peeked = self._look
                # with overlapped plain steps a look is timed by its loop iteration (the
                # drafter's time included): it costs that over the plain step as measured
                cost = _recent_median(self._look_costs, base_tokens,
                                      max(step_seconds - plain, 0.0) if self.async_plain_steps
                                      else drafter_seconds)
                self._look_cost_medians[batch_bucket(base_tokens)] = cost
                # what a peek's wrong call cost is peeking's, not exploration's
                account.charge(peeked, cost)
                if self._hunt is not None:
                    self._hunt_value(self._look_rows, -cost)
        self._explore_baseline = self._look = self._prediction = self._hunt = None

    def look_cost(self, base_tokens: int) -> float:
        """What a fruitless look costs at a batch of `base_tokens`: the median of its batch
        bucket's last COST_WINDOW (0.0 before any). What the next look is priced at and
        what each is charged: one look stalled by something else (another process on the
        box; on the emulated H100 a 6.4 ms look among 1.6-2.5 ms ones) priced every later look
        at 5.3 ms, so at batch 1 none fitted 1 % of the step time for ~300 steps, and charged
        the peek account with it, so no peek fitted either (in that step trace grounded
        prompts then skipped the drafter for want of budget on most steps of a run).
        Exploration steps are charged the same way
        (an 11.7 ms one spent batch 1's exploration account for the rest of a run)."""
        return self._look_cost_medians.get(batch_bucket(base_tokens), 0.0)

    def hunts_pay(self, rows: list[str]) -> bool:
        """A hunt may look without a budget: the last HUNT_WINDOW hunts of one of the
        running requests `rows` saved more than they cost, net (a verify step a hunt found:
        its realized saving, shared by the requests with drafts; a fruitless one: its look
        cost, shared by the decode rows). Where drafts pass
        after a miss (grounded prompts at batch 1, where a fruitless look costs a fraction
        of a plain step and a verify step saves several) the hunt goes on; where they do not,
        hunts wait for the exploration and peek budgets. Kept per request, not per batch
        size: on the emulated H100 the last requests of free chat at batch 16, hunting at
        batch 1, left batch 1 a loss that kept the next grounded prompts from looking."""
        return not self._hunts_paying.isdisjoint(rows)

    def _fresh(self, running: list[Request], rows: list[str]) -> bool:
        """One of the running requests (ids `rows`) that decodes (its first token sampled or
        in flight) was never looked at, and its output length is below FRESH_PEEKS or a power
        of two: it may peek without a budget (module docstring)."""
        if self._looked.issuperset(rows):
            return False
        for request in running:
            num_output = request.num_output_tokens
            if (request.request_id not in self._looked
                    and num_output + request.num_output_placeholders > 0
                    and (num_output < FRESH_PEEKS or num_output & (num_output - 1) == 0)):
                return True
        return False

    def _hunt_value(self, request_ids: list[str], seconds: float) -> None:
        """A hunt's net seconds, shared equally by `request_ids`."""
        for request_id in request_ids:
            values = self._hunt_values.setdefault(request_id, deque(maxlen=HUNT_WINDOW))
            values.append(seconds / len(request_ids))
            if sum(values) > 0.0:
                self._hunts_paying.add(request_id)
            else:
                self._hunts_paying.discard(request_id)

    def plain_period(self, base_tokens: int) -> float | None:
        """Seconds of an overlapped plain step of `base_tokens` as measured (varlen, where
        plain steps overlap the host), once PLAIN_MEASUREMENTS such steps were; else None."""
        if (self.step_rate is None or not self.async_plain_steps
                or self.step_rate.measured(base_tokens) < PLAIN_MEASUREMENTS):
            return None
        return self.step_rate.measured_plain(base_tokens)

    def _plain_due(self, base_tokens: int) -> bool:
        """Time this plain step: always where plain steps block (their host work is not on
        the device's critical path), else when its key's window is not full yet, or it is
        the PLAIN_SAMPLE_EVERY-th plain step."""
        self._plain_steps += 1
        return (not self.async_plain_steps or self._plain_steps % PLAIN_SAMPLE_EVERY == 0
                or self.step_rate.measured(base_tokens) < self.step_rate.window)

    def _back_off(self, request_id: str, num_accepted: int) -> None:
        """After a verify: a request rejected at its first draft `MISSES_BEFORE_BACKOFF` times
        in a row (and more) skips proposals for 1, 2, 4, ... <= spec_max_backoff_steps steps."""
        if num_accepted > 0:
            self._misses.pop(request_id, None)
            self._resume_step.pop(request_id, None)
            return
        misses = self._misses.get(request_id, 0) + 1
        self._misses[request_id] = misses
        limit = self.config.spec_max_backoff_steps
        if misses >= MISSES_BEFORE_BACKOFF and limit > 0:
            wait = min(2 ** (misses - MISSES_BEFORE_BACKOFF), limit)
            self._resume_step[request_id] = self.num_steps + 1 + wait

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.drafter.forget(request_id)
            self._misses.pop(request_id, None)
            self._resume_step.pop(request_id, None)
            self._hunt_values.pop(request_id, None)
            self._looked.discard(request_id)
            self._hunts_paying.discard(request_id)

