"""DSpark's speculation policy with measured numbers: the online step-rate table (plain steps
and the verify extra), the skip of the drafter when no draft can pay, the per-request back-off
and cost-bounded exploration (engine/spec/step_rate.py, admission.py, manager.py). Pure: no
model, no torch.

Step times are SmolLM2-135M on this repository's 2-core CPU box (2 threads, 150-token contexts,
fastest of 5, 2026-12-04): one decode row 14.9 ms, with 1 / 2 / 4 / 8 drafts 20.1 / 21.0 / 27.9 /
34.4 ms; 16 decode rows 50.2 ms, with 1 / 2 / 4 / 8 / 16 drafts on one row 62.3 / 62.9 / 64.3 /
70.5 / 83.8 ms. The first draft costs a jump (the batch leaves the decode-only attention
kernel): 5 ms at batch 1, 12 ms at batch 16.
"""

import dataclasses
import math

import pytest
from test_scheduler import make_request, make_scheduler

from deepinfer.engine.config import SpeculativeConfig
from deepinfer.engine.outputs import ModelRunnerOutput
from deepinfer.engine.spec.admission import admit_varlen, drafting_can_pay, survival
from deepinfer.engine.spec.drafter import DraftProposal
from deepinfer.engine.spec.manager import (COST_WINDOW, FRESH_PEEKS, SKIP_REASONS, SpecDecoder,
                                           _recent_median)
from deepinfer.engine.spec.realized_gain import MAX_RAISE, RealizedGain
from deepinfer.engine.spec.step_rate import StepRateTable, batch_bucket

MS = 1e-3
PLAIN = {1: 14.9 * MS, 16: 50.2 * MS}
EXTRA_BATCH_1 = {1: 5.2 * MS, 2: 6.1 * MS, 4: 13.0 * MS, 8: 19.5 * MS}
EXTRA_BATCH_16 = {1: 12.1 * MS, 2: 12.7 * MS, 4: 14.1 * MS, 8: 20.3 * MS, 16: 33.6 * MS}
# grounded prompts at batch 1 (bench_spec.py, fixed k=5): acceptance per position 0.864,
# 0.682, 0.682, 0.682, 0.591 -> conditional confidences
GROUNDED = [0.864, 0.682 / 0.864, 1.0, 1.0, 0.591 / 0.682]
# a verify extra no count of drafts pays at batch 16: 60 ms for one, 300 ms for 80
COSTLY = {1: 0.060, 80: 0.300}


def measured_table(extra=EXTRA_BATCH_1, window=8, load_smoothing=0.5):
    return StepRateTable(PLAIN, extra, window, load_smoothing)


def test_a_verify_step_is_the_plain_step_plus_the_extra_of_its_drafts():
    table = measured_table(EXTRA_BATCH_16)
    assert table.seconds(16) == pytest.approx(0.0502)
    assert table.seconds(16, 1) == pytest.approx(0.0623)
    assert table.seconds(16, 16) == pytest.approx(0.0838)
    assert table.seconds(1, 1) == pytest.approx(0.0149 + 0.0121)
    assert table.seconds(8) == pytest.approx(0.0149 + 7 / 15 * 0.0353)   # interpolated


def test_batch_one_grounded_admits_all_five_drafts_and_batch_16_chat_none():
    table = measured_table()
    assert admit_varlen([GROUNDED], table.step_seconds(1)) == [5]
    # free chat at batch 16: a few requests with a confident first draft (0.85, the measured
    # acceptance of varlen's admitted first drafts on chat), the others 0.3: 16 first drafts
    # (tau + 7.0) cost 67 % more, 4 (tau + 3.4) 28 %: the gate stays shut
    table = measured_table(EXTRA_BATCH_16)
    chat = [[0.85, 0.15]] * 4 + [[0.3]] * 12
    assert admit_varlen(chat, table.step_seconds(16)) == [0] * 16
    # sure drafts for all 16 rows would pay (32 tokens for 1.67x the step): the drafter is
    # asked, and its confidences decide; with COSTLY no count of sure drafts pays
    assert drafting_can_pay(16, table.step_seconds(16), max_drafts=80)
    assert not drafting_can_pay(16, measured_table(COSTLY).step_seconds(16), max_drafts=80)


def test_online_steps_replace_a_wrong_start_up_profile():
    """A start-up profile taken while another process held the cores made the first draft look
    cheap; the engine's own steps take over within a few steps, and an outlier step (a 300 ms
    stall) moves nothing."""
    table = StepRateTable({16: 0.050}, {1: 0.001, 4: 0.002}, window=8, load_smoothing=0.0)
    chat = [[0.85]] * 4 + [[]] * 12
    assert admit_varlen(chat, table.step_seconds(16)) == [1] * 4 + [0] * 12
    for seconds in (0.0641, 0.300, 0.0640, 0.0641, 0.0642, 0.0641):
        table.observe(16, 4, seconds)
    # the window at 4 drafts: the start-up value and the 6 steps; median 0.0641, stall ignored
    assert table.seconds(16, 4) == pytest.approx(0.0641)
    # the start-up value at one draft (1 ms) is read at the scale measured at 4 drafts (14.1 /
    # 2 ms): 7 ms, which a draft of 0.85 at batch 16 does not pay either
    assert table.seconds(16, 1) == pytest.approx(0.050 + 0.001 * 0.0141 / 0.002)
    assert admit_varlen(chat, table.step_seconds(16)) == [0] * 16
    for _ in range(8):                                          # plain steps slow down (load)
        table.observe(16, 0, 0.100)
    assert table.seconds(16) == pytest.approx(0.100)
    assert table.seconds(16, 4) == pytest.approx(0.1141)        # the extra stays its own


def test_the_load_factor_keeps_a_stale_verify_extra_comparable():
    """Another process takes the cores: plain steps at batch 16 take twice as long, while the
    extra of one draft keeps its idle-box time (nothing was verified since). Through the load
    factor the verify step is still 24 % dearer than the plain one; with absolute times (no
    load factor) only 12 %."""
    for load_smoothing in (0.0, 0.5):
        table = measured_table(EXTRA_BATCH_16, load_smoothing=load_smoothing)
        for _ in range(8):                  # the idle box, as profiled
            table.observe(16, 0, 0.0502)
        table.observe(16, 1, 0.0623)
        for _ in range(8):                  # another process arrives
            table.observe(16, 0, 0.1004)
        assert table.seconds(16) == pytest.approx(0.1004, rel=0.02)
        jump = table.seconds(16, 1) / table.seconds(16)
        assert jump == pytest.approx(62.3 / 50.2 if load_smoothing else 1.12, rel=0.02)
    with pytest.raises(ValueError, match="load_smoothing"):
        StepRateTable({2: 0.02}, {1: 0.01}, load_smoothing=1.5)


def test_a_window_of_zero_never_re_measures():
    table = StepRateTable({2: 0.02}, {1: 0.01}, window=0)
    table.observe(2, 0, 1.0)
    table.observe(2, 1, 1.0)
    assert table.seconds(2, 1) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="window"):
        StepRateTable({2: 0.02}, {1: 0.01}, window=-1)


# ---- the step loop's policy (SpecDecoder) on a real scheduler with a fake drafter ----------

class CountingDrafter:
    """Proposes `drafts` for every request it is asked about, with confidences `conf`."""

    def __init__(self, drafts, conf):
        self.drafts, self.conf = drafts, conf
        self.asked: list[list[str]] = []
        self.observed: list[tuple[str, int, int]] = []

    def propose(self, requests):
        self.asked.append([r.request_id for r in requests])
        return {r.request_id: DraftProposal(list(self.drafts[:r.max_drafts]),
                                            list(self.conf[:r.max_drafts])) for r in requests}

    def observe(self, request_id, num_verified, num_accepted):
        self.observed.append((request_id, num_verified, num_accepted))

    def forget(self, request_id):
        pass


def run(spec, scheduler, accept=0, seconds=0.0502, verify_seconds=0.0700, measures_plain=True):
    """One engine step: propose, schedule, a fake runner that accepts `accept` drafts of every
    row and samples 7, update, observe (the step took `seconds`, or `verify_seconds` when it
    scored drafts; measures_plain False: a blocking step that does not time the plain step)."""
    admitted = spec.propose(scheduler)
    out = scheduler.schedule()
    req_ids, sampled = [], []
    for request_id in out.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        scored = out.scheduled_spec_decode_tokens.get(request_id, [])
        req_ids.append(request_id)
        done = request.num_computed_tokens == request.num_tokens + len(scored)
        sampled.append(scored[:accept] + [7] if done else [])
    runner_output = ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))
    scheduler.update_from_output(out, runner_output)
    spec.observe(out, runner_output,
                 verify_seconds if out.scheduled_spec_decode_tokens else seconds,
                 measures_plain=measures_plain)
    return admitted, out


def decoding_scheduler(num_requests):
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=16, budget=256)
    for i in range(num_requests):
        scheduler.add_request(make_request(f"r{i}", 6, max_tokens=200, first_token=10 * i))
    return scheduler


def spec_decoder(drafter, table, **options):
    config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=5, **options)
    return SpecDecoder(config, drafter, table, 256)


def scored_drafts(out):
    return sum(len(d) for d in out.scheduled_spec_decode_tokens.values())


def test_batch_16_never_calls_the_drafter_when_no_draft_can_pay():
    scheduler = decoding_scheduler(16)
    drafter = CountingDrafter([1, 2, 3, 4, 5], [0.99] * 5)
    spec = spec_decoder(drafter, measured_table(COSTLY), spec_explore_fraction=0.0)
    run(spec, scheduler)                        # the prefill step: nobody decodes yet
    for _ in range(5):
        admitted, out = run(spec, scheduler)
        assert admitted == {} and out.scheduled_spec_decode_tokens == {}
        assert out.total_num_scheduled_tokens == 16
    assert drafter.asked == [] and spec.num_skipped_steps == 5
    assert spec.skip_reasons == {**dict.fromkeys(SKIP_REASONS, 0), "gate_closed": 5}
    assert spec.stats.num_drafts == 0


def test_exploration_re_measures_but_never_prices_below_the_profile(monkeypatch):
    """The profile says a verify step costs 60 ms on top of the 50 ms plain step at batch 16
    for one draft, 300 ms for 80, so no count of sure drafts pays: the drafter is not called.
    Exploration (a tenth of the step time here) verifies the gate's best set, a first draft
    for each row, once 0.1 x the elapsed time of batch 16's bucket covers its predicted cost
    (66 ms over the plain step: the 23rd decode step; the prefill step's time counts in its
    own bucket). Those steps take 70 ms and commit 32 tokens where a 50.2 ms plain
    step commits 16: their 19.8 ms over the plain step are less than the 50.2 ms of plain
    steps their 16 accepted drafts saved, so exploring costs the budget nothing and goes on
    every step. But the extra never reads below the profile's (EXTRA_FLOOR): a free or too
    cheap draft priced from a biased plain estimate cost chat at batch 16 more than a profile
    that overstates costs here (drafts of 0.9 that would pay are explored, not admitted)."""
    monkeypatch.setattr("deepinfer.engine.spec.manager.time.perf_counter", lambda: 0.0)
    scheduler = decoding_scheduler(16)
    drafter = CountingDrafter([1, 2, 3], [0.9, 0.9, 0.9])
    table = measured_table(COSTLY, load_smoothing=0.0)
    spec = spec_decoder(drafter, table, spec_explore_fraction=0.1)
    run(spec, scheduler)
    verified = [scored_drafts(run(spec, scheduler, accept=3)[1]) for _ in range(30)]
    assert verified == [0] * 22 + [16] * 8
    assert spec.num_explored_steps == 8 and len(drafter.asked) == 8
    assert spec.explore_seconds == 0.0
    # measured: the window's median of 19.8 ms (the profile's 60 ms pushed out), pooled by
    # the monotone fit with the profile's 60 ms at one draft (weight 1 against 8)
    assert table.as_milliseconds()["extra"][16][16] == pytest.approx((60 + 8 * 19.8) / 9,
                                                                     abs=1e-3)
    assert table.seconds(16, 16) == pytest.approx(0.0502 + 0.060 + 15 / 79 * 0.240)


def test_exploration_stays_within_its_share_of_the_step_time(monkeypatch):
    """Chat at batch 16 where verify steps really cost 2.4x the plain step, and a profile that
    priced them at 1.2x: the first step verifies every draft (the admission's own choice) and
    re-measures the extra of 32 drafts, which shuts the gate. The one exploration step that
    follows (the surest first draft, when 1 % of the elapsed time covers its predicted cost)
    costs its time over the plain step's divided by the gate's margin (1.05: it committed no
    more than a plain step), and nothing else fits the budget in 150 steps. When
    a request is preempted (the KV blocks run out) the batch drops to 15 rows, a new batch
    bucket of the verify extra whose start-up values no step re-measured yet: with two
    observations so far (fewer than SCALE_OBSERVATIONS) they read unscaled, the admission
    verifies there once, and the third observation scales every bucket's start-up values."""
    # the fake drafter takes no time (a look's drafter seconds count as exploration)
    monkeypatch.setattr("deepinfer.engine.spec.manager.time.perf_counter", lambda: 0.0)
    scheduler = decoding_scheduler(16)
    drafter = CountingDrafter([1, 2], [0.3, 0.3])
    table = measured_table({1: 0.010}, load_smoothing=0.0)   # a profile far too cheap
    spec = spec_decoder(drafter, table, spec_explore_fraction=0.01)
    run(spec, scheduler)
    verified = [scored_drafts(run(spec, scheduler, accept=0, verify_seconds=0.120)[1])
                for _ in range(150)]
    assert [(i, n) for i, n in enumerate(verified) if n] == [(0, 32), (19, 1), (59, 30)]
    assert spec.num_explored_steps == 1
    assert spec.explore_seconds <= 0.01 * spec.elapsed_seconds
    assert spec.explore_seconds == pytest.approx(0.120 - 0.0502 / 1.05)


def test_a_stalled_exploration_step_is_charged_the_median_of_its_bucket():
    """Exploration steps at batch 16 cost 20 ms over the admission's choice; one stalls to
    200 ms. Each is charged the median of its bucket's last COST_WINDOW (an 11.7 ms one on
    the emulated H100 spent batch 1's account for the rest of a run); batch 1 keeps its own."""
    costs = {}
    assert [_recent_median(costs, 16, c) for c in (0.020, 0.020, 0.200, 0.020)] == [
        0.020, 0.020, 0.020, 0.020]
    assert _recent_median(costs, 1, 0.004) == 0.004
    assert _recent_median(costs, 12, 0.200) == 0.020                  # bucket 16: 2 of 5
    assert len(costs[16]) == COST_WINDOW


def test_a_request_whose_drafts_keep_failing_backs_off_then_is_proposed_again():
    scheduler = decoding_scheduler(1)
    drafter = CountingDrafter([1, 2], [0.9, 0.9])
    spec = spec_decoder(drafter, measured_table(), spec_max_backoff_steps=4)
    # the back-off alone: these rejected steps would also close the gate by their shortfall
    spec.realized_gain = RealizedGain(window=10 ** 6, min_steps=10 ** 6)
    run(spec, scheduler)

    def proposed(accept):
        before = len(drafter.asked)
        run(spec, scheduler, accept=accept, verify_seconds=0.021, seconds=0.0149)
        return len(drafter.asked) > before

    # rejected at once each time: 2 misses, then waits of 1, 2, 4, 4 steps between proposals
    assert [proposed(0) for _ in range(16)] == [
        True, True, False, True, False, False, True, False, False, False, False, True,
        False, False, False, False]
    # the next proposal is accepted: the back-off ends, every step proposes again
    assert [proposed(1) for _ in range(3)] == [True, True, True]


def test_survival_of_the_grounded_confidences():
    assert survival(GROUNDED) == pytest.approx([0.864, 0.682, 0.682, 0.682, 0.591])


def test_a_start_up_profile_spoiled_by_load_does_not_stop_batch_one():
    """What a run at load 5-6 did before probes and round-robin profiling: the profile's first
    draft came out 45 ms over the plain step (a burst of load during its repeats), so drafting
    'could not pay' and batch 1 grounded ran at 1.07x. Priced as a jump shared by every draft
    of the step, the spoiled point no longer stops it: sure drafts at all five positions would
    pay, so the drafter is asked; the first look's first position alone does not open the gate
    (1.86 tokens for 2.4x the plain step), and from the next step on the capacity from the
    last look's confidences (4.5 tokens for 2.4x) verifies all five drafts, whose steps
    re-measure the extra."""
    scheduler = decoding_scheduler(1)
    drafter = CountingDrafter([1, 2, 3, 4, 5], GROUNDED)
    table = measured_table({1: 0.045, 2: 0.0061, 4: 0.013}, load_smoothing=0.0)
    spec = spec_decoder(drafter, table)
    run(spec, scheduler)
    scored = [scored_drafts(run(spec, scheduler, accept=5, seconds=0.0149,
                                verify_seconds=0.0201)[1]) for _ in range(10)]
    assert scored == [0] + [5] * 9 and spec.num_explored_steps == 0
    assert table.measured(1, 5) == 9
    # the monotone fit pools the spoiled 45 ms with the profile's 6.1 and 13 ms and the last 8
    # steps' 5.2 ms (9.6 ms); reads never go below the profile's 13 ms (EXTRA_FLOOR)
    assert table.as_milliseconds()["extra"][1][5] == pytest.approx(
        (45 + 6.1 + 13 + 8 * 5.2) / 11, rel=1e-3)
    assert table.seconds(1, 5) == pytest.approx(0.0149 + 0.013)


def test_an_exploration_of_a_shut_gate_is_free_only_above_the_gate_s_margin(monkeypatch):
    """A profile that overstates verify costs shuts the gate at batch 16 (as above). Each
    exploration verifies a sure first draft for every row and all pass: 32 tokens in 98 ms,
    where plain steps would take 100.4 ms, a gain of 2.4 %, under the gate's 5 % margin.
    Charged against the plain steps alone such steps cost nothing and ran every step after the
    first (drafting through a shut gate at no gain that the gate would accept); charged what
    they fall short of the margin (2.4 ms each), they stay within their share of the time."""
    monkeypatch.setattr("deepinfer.engine.spec.manager.time.perf_counter", lambda: 0.0)
    scheduler = decoding_scheduler(16)
    drafter = CountingDrafter([1, 2, 3], [0.9, 0.9, 0.9])
    spec = spec_decoder(drafter, measured_table(COSTLY, load_smoothing=0.0),
                        spec_explore_fraction=0.01)
    spec._account(16).elapsed = 10.6   # room for the first one (106 ms predicted)
    run(spec, scheduler)
    verified = [scored_drafts(run(spec, scheduler, accept=3, verify_seconds=0.098)[1])
                for _ in range(40)]
    assert verified[0] == 16 and set(verified) == {0, 16}
    assert 8 <= verified.count(16) <= 12                    # one step in 3-5, not every one
    charge = 0.098 - 2 * 0.0502 / 1.05
    assert spec.explore_seconds == pytest.approx(charge * verified.count(16))
    assert spec.explore_seconds <= 0.01 * spec._account(16).elapsed + charge


def test_a_bucket_whose_confidence_fell_too_low_still_gets_verified_now_and_then(monkeypatch):
    """After a few early misses a confidence bucket can say 0.1, below what pays at batch 1
    (a > 0.35 with these step times); without exploration nothing would verify it again and
    its estimate would never recover. Exploration verifies the surest first draft when its
    cost fits the budget: once accepted, its 20.1 ms cost less than the 2 x 14.9 ms of plain
    steps for the two tokens it commits, so it costs the budget nothing and is verified every
    step; when rejected, its 5.2 ms over the plain step are charged and bound how often."""
    monkeypatch.setattr("deepinfer.engine.spec.manager.time.perf_counter", lambda: 0.0)
    scheduler = decoding_scheduler(1)
    drafter = CountingDrafter([1, 2, 3], [0.1, 0.9, 0.9])
    spec = spec_decoder(drafter, measured_table(), spec_max_backoff_steps=0)
    run(spec, scheduler)
    scored = [scored_drafts(run(spec, scheduler, accept=3, seconds=0.0149,
                                verify_seconds=0.0201)[1]) for _ in range(100)]
    first = scored.index(1)
    assert set(scored[:first]) == {0} and scored[first:] == [1] * (100 - first)
    assert ("r0", 1, 1) in drafter.observed and spec.explore_seconds == 0.0
    rejected = [scored_drafts(run(spec, scheduler, accept=0, seconds=0.0149,
                                  verify_seconds=0.0201)[1]) for _ in range(200)]
    assert 2 <= rejected.count(1) <= 8
    assert spec.explore_seconds <= 0.01 * spec.elapsed_seconds + 0.0052


def test_with_overlapped_plain_steps_a_verify_step_also_pays_the_lost_overlap():
    """H200 shape: the profile times a blocking plain step of 16 rows at 1.30 ms and 16 drafts
    0.20 ms more; the engine's overlapped plain steps take 1.08 ms, and a verify step, which
    blocks, 2.50 ms: its extra as measured against the overlapped plain step (1.42 ms) holds
    the lost overlap, and the keys not observed read the profile at that scale."""
    table = StepRateTable({16: 1.30 * MS}, {16: 0.20 * MS, 32: 0.30 * MS}, window=4,
                          load_smoothing=0.5)
    table.overlapped_plain = True
    for _ in range(8):
        table.observe(16, 0, 1.08 * MS)
    assert table.seconds(16, 16) == pytest.approx((1.08 + 0.20) * MS)   # nothing observed
    for _ in range(3):
        table.observe(16, 16, 2.50 * MS)                   # the real verify steps
    assert table.seconds(16, 16) == pytest.approx(2.50 * MS)
    assert table.seconds(16, 32) == pytest.approx((1.08 + 0.30 * 1.42 / 0.20) * MS)
    assert table.load == 1.0                               # no load factor here


def test_a_plain_key_the_engine_runs_reads_its_own_median_whatever_the_fit_pooled():
    """A chat batch's tail runs 12 rows a few times, slowly (6 ms: a step that also waited on
    the host); 16 rows ran 8 times at 1.0 ms. The non-decreasing fit pools the two, but 16
    rows read what they measured, and so does the extra measured against them."""
    table = StepRateTable({12: 4.0 * MS, 16: 4.4 * MS}, {1: 0.2 * MS, 4: 0.5 * MS}, window=8,
                          load_smoothing=0.0)
    table.overlapped_plain = True
    for _ in range(8):
        table.observe(16, 0, 1.0 * MS)
    for _ in range(2):
        table.observe(12, 0, 6.0 * MS)
    assert table.as_milliseconds()["plain"][16] > 1.5          # pooled by the fit
    assert table.seconds(16) == pytest.approx(1.0 * MS)
    for _ in range(3):
        table.observe(16, 4, 3.0 * MS)
    assert table.seconds(16, 4) == pytest.approx(3.0 * MS)


def test_with_overlapped_plain_steps_the_load_factor_stays_one():
    """A blocking start-up profile (3.6 ms for one row, 4.4 for 16) against overlapped plain
    steps of ~0.94 and 0.96 ms, the two batches alternating with their verify steps: each
    reads what it measured, as a load factor moved by one batch's steps would not leave the
    other's."""
    table = StepRateTable({1: 3.6 * MS, 8: 3.9 * MS, 16: 4.4 * MS}, {1: 0.3 * MS, 5: 0.6 * MS},
                          window=8, batch_extra_seconds={16: {1: 0.5 * MS, 80: 2 * MS}})
    table.overlapped_plain = True
    for _ in range(10):
        for step in range(60):
            verify = step % 3 == 0
            table.observe(1, 5 if verify else 0, 1.9 * MS if verify else 0.94 * MS)
        for step in range(120):
            verify = step % 40 == 0
            table.observe(16, 20 if verify else 0, 3.0 * MS if verify else 0.96 * MS)
    assert table.load == 1.0
    # (batch 8, never run, reads its start-up value at the others' scale: 0.93 ms, and the
    # non-decreasing fit pools batch 1 with it)
    assert table.seconds(1) == pytest.approx(0.94 * MS, rel=0.01)
    assert table.seconds(16) == pytest.approx(0.96 * MS)
    assert table.seconds(1, 5) == pytest.approx(1.9 * MS, rel=0.01)
    assert table.seconds(16, 20) == pytest.approx(3.0 * MS)


def test_the_verify_extra_is_priced_per_batch_bucket():
    """Extras measured at batch 1 do not price drafts at batch 16: each batch bucket (B0 = 1,
    2, 3-5, 6-11, 12-22, ...: the nearest power of two in log scale) keeps its own extra curve, started from the profile of its
    size (rows between two profiled row counts interpolate linearly)."""
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 6, 11, 12, 16, 22, 23)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 16, 32]
    table = StepRateTable(PLAIN, EXTRA_BATCH_1, window=4, load_smoothing=0.0,
                          batch_extra_seconds={16: EXTRA_BATCH_16})
    assert table.seconds(1, 1) == pytest.approx(0.0149 + 0.0052)
    assert table.seconds(16, 1) == pytest.approx(0.0502 + 0.0121)
    assert table.seconds(31, 16) == pytest.approx(table.seconds(31) + 0.0336)
    # bucket 8: 7/15 of the way from the batch-1 profile to the batch-16 one
    assert table.seconds(8, 1) - table.seconds(8) == pytest.approx(0.0052 + 7 / 15 * 0.0069)
    # chat at batch 16 after grounded prompts at batch 1 verified cheap drafts there: the
    # batch-16 price stays its own
    for _ in range(8):
        table.observe(1, 1, 0.0149 + 0.0030)
    assert table.seconds(1, 1) == pytest.approx(0.0149 + 0.0052)   # the profile is a floor
    assert table.seconds(16, 1) == pytest.approx(0.0502 + 0.0121)
    assert table.measured(1, 1) == 8 and table.measured(16, 1) == 0
    extras = table.as_milliseconds()["extra"]   # fitted, before the floor: batch 1 measured
    # 3 ms, the other buckets read their profiles at that scale (3 / 5.2)
    assert sorted(extras) == [1, 8, 16, 32] and extras[1][1] == pytest.approx(3.0)
    assert extras[16][16] == pytest.approx(33.6 * 3.0 / 5.2, abs=1e-3)


def test_a_new_batch_bucket_reads_its_profile_at_the_scale_the_others_showed():
    """H200 shape: verify steps cost 4x what the profile timed. After 3 observations at batch
    1, batch 16 (never verified) reads its own profiled values at that scale; its own
    observations then take over. A bucket never verified reads the largest scale shown."""
    table = StepRateTable({1: 1.0 * MS, 16: 1.3 * MS}, {1: 0.1 * MS, 5: 0.3 * MS}, window=4,
                          load_smoothing=0.0, batch_extra_seconds={16: {1: 0.2 * MS,
                                                                       80: 1.0 * MS}})
    for _ in range(3):
        table.observe(1, 3, (1.0 + 0.8) * MS)   # profile at 3 drafts: 0.2 ms (interpolated)
    assert table.seconds(16, 80) == pytest.approx((1.3 + 4.0) * MS)
    assert table.seconds(16, 1) == pytest.approx((1.3 + 0.8) * MS)
    for _ in range(3):
        table.observe(16, 80, (1.3 + 2.0) * MS)   # batch 16's own scale: 2x
    assert table.seconds(16, 80) == pytest.approx((1.3 + 2.0) * MS)
    assert table.seconds(16, 1) == pytest.approx((1.3 + 0.4) * MS)
    # bucket 4, never verified: the dearer of the scales of buckets 1 (4x) and 16 (2x)
    assert table.seconds(4, 1) - table.seconds(4) == pytest.approx(
        4.0 * (0.1 + 3 / 15 * 0.1) * MS)
    with pytest.raises(ValueError, match="batch_extra_seconds"):
        StepRateTable({1: 0.01}, {1: 0.01}, batch_extra_seconds={16: {}})


def test_the_gate_asks_for_a_margin_over_the_plain_step():
    """Chat at batch 16, the 2-core CPU box: one first draft of 0.83 priced at 3 ms over a
    97 ms plain step predicts +2.3 % (it cost 9 ms: -4 %); three drafts of 2.4 expected tokens
    at 10 ms predict +4.6 %. With spec_min_gain 0.05 neither opens the gate; grounded prompts
    at batch 1 (+100 % and more) are not touched, nor is the walk after the gate."""
    table = StepRateTable({16: 0.097}, {1: 0.003, 3: 0.010}, window=0)
    one = [[0.83]] + [[]] * 15
    three = [[0.95, 0.9, 0.95]] + [[]] * 15
    assert admit_varlen(one, table.step_seconds(16)) == [1] + [0] * 15
    assert admit_varlen(three, table.step_seconds(16)) == [3] + [0] * 15
    assert admit_varlen(one, table.step_seconds(16), min_gain=0.05) == [0] * 16
    assert admit_varlen(three, table.step_seconds(16), min_gain=0.05) == [0] * 16
    grounded = measured_table()
    assert admit_varlen([GROUNDED], grounded.step_seconds(1), min_gain=0.05) == [5]
    # no count of sure drafts beats the plain step by half: the drafter is not asked
    assert drafting_can_pay(16, table.step_seconds(16), max_drafts=3)
    assert not drafting_can_pay(16, table.step_seconds(16), max_drafts=3, min_gain=0.5)
    with pytest.raises(ValueError, match="spec_min_gain"):
        SpeculativeConfig(speculative_method="ngram", spec_min_gain=-0.1)



def test_a_peek_from_the_known_tokens_decides_whether_a_blocking_look_pays(monkeypatch):
    """Plain steps overlap the host and the last look admitted nothing: instead of waiting for
    the step in flight to look again, the drafter is asked from the tokens known (one behind,
    one draft more: its first guesses the token in flight). Low confidences: no look, the next
    step launches without waiting; sure ones: a look. A peek feeds nothing back to the
    drafter (no observation) and the look it asked for proposes from the real token."""
    monkeypatch.setattr("deepinfer.engine.spec.manager.time.perf_counter", lambda: 0.0)
    scheduler = decoding_scheduler(1)
    drafter = CountingDrafter([1, 2, 3, 4, 5, 6], [0.01] * 6)
    spec = spec_decoder(drafter, measured_table(), spec_explore_fraction=0.01)
    spec.async_plain_steps = True
    run(spec, scheduler)                                    # the prefill step
    for _ in range(3):   # overlapped plain steps, as measured
        spec.step_rate.observe(1, 0, 0.0149)
    for _ in range(4):   # a look that admits nothing, its blocking cost over the budget
        assert scored_drafts(run(spec, scheduler, measures_plain=False)[1]) == 0
    assert len(drafter.asked) == 1 and spec.explore_seconds > 0.01 * spec.elapsed_seconds
    spec._account(1).elapsed = 1.5 * spec.explore_seconds / 0.01   # room for a peek, not a look
    assert spec._peek_due(1) and not spec._explore_due(spec.look_cost(1), 1)
    looks, observed = len(drafter.asked), list(drafter.observed)
    out = scheduler.schedule()                              # a plain step left in flight
    request = scheduler.requests["r0"]
    request.num_output_placeholders += 1
    assert not spec.may_draft(scheduler)                    # peek: 0.01 pays nothing
    spec.skip_step(scheduler)                               # the step launched plain
    assert spec.skip_reasons["peek_declined"] == 1
    drafter.conf = [0.95] * 6
    assert spec.may_draft(scheduler)                        # peek: c1 c2 = 0.90, then 0.95s
    assert len(drafter.asked) == looks + 2 and spec.num_peeks == 2
    assert spec.num_fruitful_peeks == 1 and drafter.observed == observed
    request.num_output_placeholders -= 1                    # the step in flight resolves
    scheduler.update_from_output(out, ModelRunnerOutput(["r0"], [[7]], [None]))
    admitted, out = run(spec, scheduler, accept=5)          # the look the peek asked for
    assert admitted == {"r0": [1, 2, 3, 4, 5]} and scored_drafts(out) == 5


def overlapped_batch_one(monkeypatch, drafter):
    """One request decoding at batch 1 where plain steps overlap the host (14.9 ms each, as
    measured), its prefill step run; the drafter takes no time. Returns (scheduler, spec)."""
    monkeypatch.setattr("deepinfer.engine.spec.manager.time.perf_counter", lambda: 0.0)
    scheduler = decoding_scheduler(1)
    spec = spec_decoder(drafter, measured_table(), spec_explore_fraction=0.01)
    spec.async_plain_steps = True
    run(spec, scheduler)                                    # the prefill step
    for _ in range(3):   # overlapped plain steps, as measured
        spec.step_rate.observe(1, 0, 0.0149)
    return scheduler, spec


def test_a_hunt_that_finds_drafts_that_pass_repays_its_account(monkeypatch):
    """Grounded prompts at batch 1 where plain steps overlap the host: a look that admits
    nothing costs its blocking step over the overlapped plain one (10 ms here), charged to the
    exploration account, and the next look waits until 1 % of the elapsed time covers it again.
    When that look admits five drafts that all pass, its saving (6 plain steps of 14.9 ms less
    its own 70 ms: 19.4 ms) repays the account: the hunt goes on without another wait."""
    drafter = CountingDrafter([1, 2, 3, 4, 5], [0.01] * 5)
    scheduler, spec = overlapped_batch_one(monkeypatch, drafter)
    run(spec, scheduler, seconds=0.0249, measures_plain=False)   # the fruitless look
    assert len(drafter.asked) == 1 and spec.explore_seconds == pytest.approx(0.010)
    drafter.conf = [0.95] * 5
    plain_steps = 0
    while len(drafter.asked) == 1:
        admitted, out = run(spec, scheduler, seconds=0.0149, accept=5)
        plain_steps += not admitted
    # the look waited for 1 % of its batch bucket's elapsed time (the look, plain steps; the
    # prefill step counts in its own bucket) to cover what it and the last one cost
    assert plain_steps == math.ceil((0.020 / 0.01 - 0.0249) / 0.0149)
    assert spec.skip_reasons["no_look_budget"] == plain_steps == spec.num_skipped_steps
    assert admitted == {"r0": [1, 2, 3, 4, 5]} and scored_drafts(out) == 5
    assert spec.explore_seconds == 0.0                      # 10 ms owed, 19.4 ms saved


def test_one_stalled_look_neither_prices_nor_charges_the_looks_after_it(monkeypatch):
    """Fruitless looks at batch 1 cost 10 ms over the overlapped plain step; one stalls to
    100 ms (another process took the host). A look is priced and charged at the median of the
    bucket's last COST_WINDOW: the stall costs the account 10 ms, and the next look waits
    for 1 % of the step time to cover 10 ms more, not 100."""
    drafter = CountingDrafter([1, 2, 3, 4, 5], [0.95] * 5)
    scheduler, spec = overlapped_batch_one(monkeypatch, drafter)
    drafter.drafts, drafter.conf = [], []                   # looks that find nothing
    spec._account(1).elapsed = 10.0                         # 100 ms to spend
    for extra in (0.010, 0.010, 0.100):
        looks = len(drafter.asked)
        while len(drafter.asked) == looks:
            run(spec, scheduler, seconds=0.0149 + extra, measures_plain=False)
    assert spec.look_cost(1) == pytest.approx(0.010)
    assert spec._account(1).explore == pytest.approx(0.030)
    assert spec._explore_due(spec.look_cost(1), 1)


def test_each_batch_bucket_spends_only_the_allowance_its_own_steps_earned():
    """Grounded prompts at batch 1 ran 1 s of steps (10 ms to explore and peek with at 1 %);
    chat at batch 16 ran 50 ms (0.5 ms) and spent 0.3 ms peeking: its explorations and peeks
    share what is left, then wait for its own steps, whatever batch 1 left unspent."""
    spec = spec_decoder(CountingDrafter([1], [0.5]), measured_table(), spec_explore_fraction=0.01)
    spec.async_plain_steps = True
    grounded, chat = spec._account(1), spec._account(16)
    grounded.elapsed = 1.0
    chat.elapsed, chat.peek = 0.050, 0.0003
    assert spec._peek_due(1) and spec._explore_due(0.005, 1)
    assert spec._peek_due(16) and spec._explore_due(0.0001, 12)   # batch 12: bucket 16
    assert not spec._explore_due(0.0003, 16)                # 0.6 ms with the peeks'
    chat.peek = 0.0006
    assert not spec._peek_due(16) and not spec._explore_due(0.0, 16)
    assert spec.elapsed_seconds == pytest.approx(1.05) and spec.peek_seconds == 0.0006


def test_verify_steps_that_fall_short_of_their_prediction_close_the_gate_of_their_batch():
    """A step-rate table that never re-measures (window 0) prices 16 rows with five drafts of
    0.99 as a large gain, but no draft passes and each verify step takes 70 ms against 50 ms
    plain (realized gain 0.72): after `RealizedGain.min_steps` such steps the gate of batch
    16's bucket asks for the shortfall on top of its margin and closes; batch 1's is
    untouched."""
    scheduler = decoding_scheduler(16)
    drafter = CountingDrafter([1, 2, 3, 4, 5], [0.99] * 5)
    spec = spec_decoder(drafter, StepRateTable(PLAIN, EXTRA_BATCH_1, window=0,
                                               batch_extra_seconds={16: EXTRA_BATCH_16}),
                        spec_explore_fraction=0.0, spec_max_backoff_steps=0)
    run(spec, scheduler)                        # the prefill step
    verified = [scored_drafts(run(spec, scheduler)[1]) for _ in range(6)]
    steps = spec.realized_gain.min_steps
    assert all(verified[:steps]) and not any(verified[steps:])
    shortfall = spec.realized_gain.shortfall(16)
    assert shortfall > 0.5                      # predicted well above 1, realized 0.72
    assert spec._min_gain(16) == pytest.approx(1.05 * MAX_RAISE - 1.0)   # capped
    assert spec._min_gain(1) == pytest.approx(0.05)


def test_a_shortfall_raises_the_margin_at_most_max_raise():
    """Batch 1's last five verify steps realized a third of their predicted gain (a stalled
    box, or a process's first replays): uncapped, the gate would ask for 3.15x the plain step,
    which grounded drafts (2.3x predicted) never clear, and no verify step would score the
    bucket again. Capped at MAX_RAISE (1.575x) they are admitted; they realize what the same
    prices predict, and once three of the last five did, the margin is back to 5 %."""
    scheduler = decoding_scheduler(1)
    drafter = CountingDrafter([1, 2, 3, 4, 5], GROUNDED)
    spec = spec_decoder(drafter, measured_table(window=0), spec_explore_fraction=0.0)
    for _ in range(5):   # each expected 3x the tokens it committed, at its priced cost
        spec.realized_gain.observe(1, 6.0, 2, 1.3, 1.3)
    assert spec.realized_gain.shortfall(1) == pytest.approx(math.log(3.0))
    assert spec._min_gain(1) == pytest.approx(1.05 * MAX_RAISE - 1.0)
    run(spec, scheduler, seconds=0.0149)                    # the prefill step
    verified = [scored_drafts(run(spec, scheduler, accept=5, seconds=0.0149,
                                  verify_seconds=0.0201)[1]) for _ in range(6)]
    assert verified[1:] == [5] * 5 and spec.num_explored_steps == 0
    assert spec.realized_gain.shortfall(1) <= 0.0 and spec._min_gain(1) == pytest.approx(0.05)


def test_the_shortfall_sums_tokens_and_takes_the_median_of_costs():
    """A bucket's shortfall over its last 5 scored steps: log(expected / committed tokens,
    each summed) plus the median log(measured / priced relative cost). One verify step stalled
    10x by another process moves nothing, a majority of slow steps does, and steps meeting
    their prediction bring it back."""
    gain = RealizedGain(window=5, min_steps=3)
    gain.observe(16, 32.0, 16, 1.5, 1.5)                      # half the tokens expected
    gain.observe(16, 32.0, 16, 1.5, 1.5)
    assert gain.shortfall(16) == 0.0 and gain.min_gain(16, 0.05) == pytest.approx(0.05)
    gain.observe(16, 32.0, 16, 1.5, 1.5)
    assert gain.shortfall(16) == pytest.approx(math.log(2.0))
    assert gain.shortfall(12) == pytest.approx(math.log(2.0))   # the same batch bucket
    assert gain.shortfall(8) == 0.0
    for _ in range(3):
        gain.observe(16, 24.0, 40, 1.5, 1.5)                  # more than expected
    assert gain.shortfall(16) < 0.0 and gain.min_gain(16, 0.05) == pytest.approx(0.05)
    for measured in (1.5, 1.5, 15.0, 1.5):                     # one stall among them
        gain.observe(1, 4.0, 4, 1.5, measured)
    assert gain.min_gain(1, 0.05) == pytest.approx(0.05)
    assert gain.as_dict()[1] == {"shortfall": 0.0, "steps": 4}
    for _ in range(3):                                         # three slow steps of five
        gain.observe(1, 4.0, 4, 1.5, 3.0)
    assert gain.shortfall(1) == pytest.approx(math.log(2.0))
    with pytest.raises(ValueError, match="min_steps"):
        RealizedGain(window=2, min_steps=3)


def test_hunts_are_judged_per_request():
    """Looks after one that admitted nothing (hunts) look without a budget while they pay for
    the request: a request whose hunts lost (fruitless looks) waits for the budgets; another
    request's losses do not count against one whose hunts paid."""
    spec = spec_decoder(CountingDrafter([1, 2], [0.9, 0.9]), measured_table(),
                        spec_explore_fraction=0.0)
    assert not spec.hunts_pay(["chat"])             # no hunt yet: budgets decide
    spec._hunt_value(["chat"], -0.5 * MS)
    assert not spec.hunts_pay(["chat"])
    spec._hunt_value(["grounded"], -0.5 * MS)
    spec._hunt_value(["grounded"], 3.0 * MS)        # a verify step it found
    assert spec.hunts_pay(["grounded"]) and spec.hunts_pay(["chat", "grounded"])
    spec.forget(["grounded"])
    assert not spec.hunts_pay(["grounded"])         # a new request of the same id


def test_a_new_request_peeks_without_a_budget_then_looks_when_a_peek_pays(monkeypatch):
    """The last look admitted nothing and no budget is left (free chat at batch 16 on the
    GPU): a new request is not given a blocking look (at batch 16 one costs ~2 ms, four a run)
    but peeks on its first FRESH_PEEKS steps and then at power-of-two output lengths, until
    one asks for a look (a grounded request whose output starts with words of its own). A
    request still prefilling has nothing to peek at."""
    drafter = CountingDrafter([1, 2, 3, 4, 5, 6], [0.01] * 6)
    scheduler, spec = overlapped_batch_one(monkeypatch, drafter)
    spec.config = dataclasses.replace(spec.config, spec_explore_fraction=0.0)   # no budget
    run(spec, scheduler, seconds=0.0249, measures_plain=False)   # the first step's look
    assert len(drafter.asked) == 1 and spec._looks_pay is False
    scheduler.add_request(make_request("new", 6, max_tokens=200, first_token=99))
    run(spec, scheduler)                                    # its prefill, beside r0's step
    for _ in range(3):   # overlapped plain steps of two rows, as measured
        spec.step_rate.observe(2, 0, 0.0149)
    peeked = []
    for _ in range(17):
        out = scheduler.schedule()                          # a plain step left in flight
        for request in scheduler.running:
            request.num_output_placeholders += 1
        peeks = spec.num_peeks
        assert not spec.may_draft(scheduler)                # 0.01 pays nothing
        spec.skip_step(scheduler)
        if spec.num_peeks > peeks:
            peeked.append(scheduler.requests["new"].num_output_tokens)
        for request in scheduler.running:
            request.num_output_placeholders -= 1
        scheduler.update_from_output(out, ModelRunnerOutput(
            list(out.num_scheduled_tokens), [[7]] * len(out.num_scheduled_tokens),
            [None] * len(out.num_scheduled_tokens)))
    assert peeked == [*range(1, FRESH_PEEKS), 4, 8, 16]     # the prefill sampled the first
    prefilling = make_request("long", 6, max_tokens=200, first_token=1)
    assert not spec._fresh([prefilling], ["long"])          # nothing sampled or in flight
    prefilling.num_output_placeholders = 1                  # its last chunk in flight
    assert spec._fresh([prefilling], ["long"])
    drafter.conf = [0.95] * 6                               # now its drafts would pay
    while scheduler.requests["new"].num_output_tokens < 32:
        run(spec, scheduler)
    scheduler.schedule()
    for request in scheduler.running:
        request.num_output_placeholders += 1
    assert spec.may_draft(scheduler) and spec.num_fruitful_peeks == 1


def test_calibrated_confidences_on_all_or_nothing_acceptance_raise_no_margin():
    """Grounded text at batch 1: a verify step commits 6 tokens (every draft passed) or 2
    (the first only), 3 : 2, and the confidences expect 4.4 a step, as calibrated. A median of
    per-step gain ratios read that as a shortfall of log(4.4 / 2) whenever 3 of the last 5
    steps committed 2 (about one time in three); summed tokens read the window's own mix."""
    gain = RealizedGain(window=5, min_steps=3)
    for committed in (2, 6, 2, 6, 2):    # 3 of 5 short: the old median said 0.79
        gain.observe(1, 4.4, committed, 1.6, 1.6)
    assert gain.shortfall(1) == pytest.approx(math.log(22.0 / 18.0))
    for committed in (6, 6, 2, 6, 2) * 4:
        gain.observe(1, 4.4, committed, 1.6, 1.6)
        assert gain.shortfall(1) == pytest.approx(0.0)


def test_a_start_up_value_left_in_a_window_is_read_at_the_engine_s_scale():
    """Overlapped plain steps (the GPU) run at a quarter of the blocking start-up profile. 16
    rows were observed 8 times (1.05 ms), 12 rows once (1.0 ms): read at the profile's scale,
    12 rows would be the mean of 4 ms and 1 ms, and the non-decreasing fit would pool 16 rows
    with it to 1.34 ms."""
    table = StepRateTable({1: 3.6 * MS, 12: 4.0 * MS, 16: 4.4 * MS}, EXTRA_BATCH_1, window=8,
                          load_smoothing=0.0)
    table.overlapped_plain = True
    for _ in range(8):
        table.observe(16, 0, 1.05 * MS)
    table.observe(12, 0, 1.0 * MS)
    assert table.seconds(16) == pytest.approx(1.05 * MS)
    assert table.seconds(12) == pytest.approx(1.0 * MS, rel=0.02)
    assert table.seconds(1) == pytest.approx(3.6 * MS * 1.05 / 4.4, rel=0.03)   # never observed
    assert table.measured_plain(16) == pytest.approx(1.05 * MS)
    assert table.measured_plain(12) == pytest.approx(1.0 * MS)


def test_the_measured_plain_step_is_read_as_measured_whatever_the_load_factor_did():
    """The curves hold times divided by the load factor of their moment; when the factor has
    moved since (a settled key ran slower or faster than its median), the plain curve reads
    at the new factor, but a verify step's realized gain and an exploration's cost are judged
    against the plain steps as measured."""
    table = StepRateTable({16: 2.5 * MS}, EXTRA_BATCH_16, window=4, load_smoothing=0.5)
    for _ in range(4):
        table.observe(16, 0, 1.1 * MS)
    assert table.seconds(16) == pytest.approx(1.1 * MS)
    table.load *= 2.0
    assert table.seconds(16) == pytest.approx(2.2 * MS)
    assert table.measured_plain(16) == pytest.approx(1.1 * MS)
    assert table.measured_plain(8) == pytest.approx(table.seconds(8))   # none measured there
