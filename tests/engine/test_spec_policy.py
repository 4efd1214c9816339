"""DSpark's speculation policy with measured numbers: the online step-rate table (plain and
verify steps), the skip of the drafter when no draft can pay, the per-request back-off and the
probe (engine/spec/step_rate.py, admission.py, manager.py). Pure: no model, no torch.

Step times are SmolLM2-135M on this repository's 2-core CPU box (2 threads, 150-token contexts,
fastest of 5, 2026-12-04): one decode row 14.9 ms, with 1 / 2 / 4 / 8 drafts 20.1 / 21.0 / 27.9 /
34.4 ms; 16 decode rows 50.2 ms, with 1 / 2 / 4 / 8 / 16 drafts on one row 62.3 / 62.9 / 64.3 /
70.5 / 83.8 ms. The first draft row costs a jump (the batch leaves the decode-only attention
kernel): 5 ms at batch 1, 12 ms at batch 16.
"""

import pytest
from test_scheduler import make_request, make_scheduler

from deepinfer.engine.config import SpeculativeConfig
from deepinfer.engine.outputs import ModelRunnerOutput
from deepinfer.engine.spec.admission import admit_varlen, drafting_can_pay, survival
from deepinfer.engine.spec.drafter import DraftProposal
from deepinfer.engine.spec.manager import SpecDecoder, probe_lengths
from deepinfer.engine.spec.step_rate import StepRateTable

MS = 1e-3
PLAIN = {1: 14.9 * MS, 16: 50.2 * MS}
VERIFY = {2: 20.1 * MS, 3: 21.0 * MS, 5: 27.9 * MS, 9: 34.4 * MS,
          17: 62.3 * MS, 18: 62.9 * MS, 20: 64.3 * MS, 24: 70.5 * MS, 32: 83.8 * MS}
# grounded prompts at batch 1 (bench_spec.py, fixed k=5): acceptance per position 0.864,
# 0.682, 0.682, 0.682, 0.591 -> conditional confidences
GROUNDED = [0.864, 0.682 / 0.864, 1.0, 1.0, 0.591 / 0.682]


def measured_table(window=8, load_smoothing=0.5):
    return StepRateTable(VERIFY, PLAIN, window, load_smoothing)


def test_a_verify_step_costs_at_least_the_plain_step_and_plain_has_its_own_curve():
    table = measured_table()
    assert table.seconds(16, verify=False) == pytest.approx(0.0502)
    assert table.seconds(17) == pytest.approx(0.0623)
    assert table.seconds(1, verify=False) == pytest.approx(0.0149)
    assert table.seconds(1) == pytest.approx(0.0201)            # flat below the first point
    assert table.plain_rate(1) == pytest.approx(1 / 0.0149)
    only_verify = StepRateTable({2: 0.02, 4: 0.03})
    assert only_verify.seconds(3, verify=False) == pytest.approx(0.025)   # no plain curve yet


def test_batch_one_grounded_admits_all_five_drafts_and_batch_16_none():
    table = measured_table()
    lengths = admit_varlen([GROUNDED], table, base_tokens=1,
                           plain_steps_per_second=table.plain_rate(1))
    assert lengths == [5]
    # free chat at batch 16: a few requests with a confident first draft (0.85, the measured
    # acceptance of varlen's admitted first drafts on chat); the 12 ms jump does not pay
    chat = [[0.85, 0.15]] * 4 + [[0.3]] * 12
    assert admit_varlen(chat, table, base_tokens=16,
                        plain_steps_per_second=table.plain_rate(16)) == [0] * 16
    # ... and even a sure draft would not: the drafter need not run
    assert not drafting_can_pay(16, table, base_tokens=16,
                                plain_steps_per_second=table.plain_rate(16))
    assert drafting_can_pay(1, table, base_tokens=1, plain_steps_per_second=table.plain_rate(1))


def test_online_steps_replace_a_wrong_start_up_profile():
    """A start-up profile taken while another process held the cores made the verify step at
    17 tokens look cheap; the engine's own steps take over within a few steps, and an outlier
    step (a 300 ms stall) moves nothing."""
    table = StepRateTable({17: 0.040, 32: 0.080}, {16: 0.050}, window=8, load_smoothing=0.0)
    chat = [[0.85]] * 4 + [[]] * 12
    rate = table.plain_rate(16)
    admitted = admit_varlen(chat, table, base_tokens=16, plain_steps_per_second=rate)
    assert admitted == [1] * 4 + [0] * 12
    for seconds in (0.0623, 0.300, 0.0621, 0.0622, 0.0624, 0.0622):
        table.observe(17, seconds)
    # the window: 2 of the 4 start-up copies and the 6 steps; median 0.0622, stall ignored
    assert table.seconds(17) == pytest.approx(0.0622)
    assert admit_varlen(chat, table, base_tokens=16, plain_steps_per_second=rate) == [0] * 16
    for _ in range(8):                                          # plain steps slow down (load)
        table.observe(16, 0.100, verify=False)
    assert table.seconds(16, verify=False) == pytest.approx(0.100)
    assert table.seconds(17) == pytest.approx(0.100)            # never below plain


def test_the_load_factor_keeps_a_stale_verify_point_comparable():
    """Another process takes the cores: plain steps at batch 16 take twice as long, while the
    verify point at 17 tokens keeps its idle-box time (nothing was verified since). (A load
    change while a window still holds only its start-up value is absorbed by the window: that
    point then simply re-measures.) Through the
    load factor the verify step is still 24 % dearer than the plain one, and nothing is
    admitted; with absolute times (no load factor) the jump is gone: what is left is the plain
    curve's slope, 5 %."""
    chat = [[0.85]] * 4 + [[]] * 12
    for load_smoothing in (0.0, 0.5):
        table = measured_table(load_smoothing=load_smoothing)
        for _ in range(8):                  # the idle box, as profiled
            table.observe(16, 0.0502, verify=False)
        table.observe(17, 0.0623)
        for _ in range(8):                  # another process arrives
            table.observe(16, 0.1004, verify=False)
        assert table.seconds(16, verify=False) == pytest.approx(0.1004, rel=0.02)
        jump = table.seconds(17) / table.seconds(16, verify=False)
        if load_smoothing:
            assert jump == pytest.approx(62.3 / 50.2, rel=0.05)
        else:   # only the plain curve's slope is left (no draft-row kernel switch)
            assert jump < 1.06
    assert admit_varlen(chat, table, base_tokens=16,
                        plain_steps_per_second=table.plain_rate(16)) == [0] * 16
    with pytest.raises(ValueError, match="load_smoothing"):
        StepRateTable({2: 0.02}, load_smoothing=1.5)


def test_a_window_of_zero_never_re_measures():
    table = StepRateTable({2: 0.02}, window=0)
    table.observe(2, 1.0)
    assert table.seconds(2) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="window"):
        StepRateTable({2: 0.02}, window=-1)


def test_probe_admits_the_single_surest_first_draft():
    assert probe_lengths([[0.4], [0.7, 0.9], [], [0.7]]) == [0, 1, 0, 0]
    assert probe_lengths([[0.1], []]) == [1, 0]
    assert probe_lengths([[], []]) == [0, 0]
    assert probe_lengths([]) == []


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


def run(spec, scheduler, accept=0, seconds=0.0502, verify_seconds=0.0700):
    """One engine step: propose, schedule, a fake runner that accepts `accept` drafts of every
    row and samples 7, update, observe (the step took `seconds`, or `verify_seconds` when it
    scored drafts)."""
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
                 verify_seconds if out.scheduled_spec_decode_tokens else seconds)
    return admitted, out


def decoding_scheduler(num_requests):
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=16, budget=256)
    for i in range(num_requests):
        scheduler.add_request(make_request(f"r{i}", 6, max_tokens=200, first_token=10 * i))
    return scheduler


def spec_decoder(drafter, table, **options):
    config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=5)
    return SpecDecoder(config, drafter, table, 256, **options)


def test_batch_16_never_calls_the_drafter_when_no_draft_can_pay():
    scheduler = decoding_scheduler(16)
    drafter = CountingDrafter([1, 2, 3, 4, 5], [0.99] * 5)
    spec = spec_decoder(drafter, measured_table(), probe_interval=0)
    run(spec, scheduler)                        # the prefill step: nobody decodes yet
    for _ in range(5):
        admitted, out = run(spec, scheduler)
        assert admitted == {} and out.scheduled_spec_decode_tokens == {}
        assert out.total_num_scheduled_tokens == 16
    assert drafter.asked == [] and spec.num_skipped_steps == 5
    assert spec.stats.num_drafts == 0


def test_a_probe_re_measures_the_verify_step_every_interval():
    scheduler = decoding_scheduler(16)
    drafter = CountingDrafter([1, 2, 3], [0.9, 0.9, 0.9])
    table = measured_table(window=2, load_smoothing=0.0)
    spec = spec_decoder(drafter, table, probe_interval=4)
    run(spec, scheduler)
    verified = []
    for _ in range(8):
        admitted, out = run(spec, scheduler, accept=1)
        verified.append(sum(len(d) for d in out.scheduled_spec_decode_tokens.values()))
    # one draft every 4th step without drafts (the prefill step was the first)
    assert verified == [0, 0, 1, 0, 0, 0, 1, 0]
    assert len(drafter.asked) == 2
    # re-measured: the window (2) holds the two probes, 0.070, pooled with 18 and 20 tokens
    # (start-up values, one observation each) by the monotone fit
    assert table.seconds(17) == pytest.approx((2 * 0.0700 + 0.0629 + 0.0643) / 4)
    # a third probe, then every 16th step: the verify step at 17 tokens was measured
    # PROBES = 3 times
    more = [sum(len(d) for d in run(spec, scheduler, accept=1)[1]
                .scheduled_spec_decode_tokens.values()) for _ in range(20)]
    assert more == [0, 0, 1] + [0] * 15 + [1, 0] and table.measured(17) == 4


def test_a_request_whose_drafts_keep_failing_backs_off_then_probes_again():
    scheduler = decoding_scheduler(1)
    drafter = CountingDrafter([1, 2], [0.9, 0.9])
    spec = spec_decoder(drafter, measured_table(), max_backoff_steps=4)
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


def test_a_start_up_profile_spoiled_by_load_is_probed_away_at_batch_one():
    """What a run at load 5-6 did before probes and round-robin profiling: the profile's verify
    step at 2 tokens came out 3x the plain step at 1 (a burst of load during its repeats), so
    drafting 'could not pay' and batch 1 grounded ran at 1.07x. Probes measure the real verify
    step (20.1 ms) and drafting resumes after two of them. (A profile spoiled at every verify
    point would recover only up to the points the engine runs: the walk does not try a B whose
    start-up value says it does not pay.)"""
    scheduler = decoding_scheduler(1)
    drafter = CountingDrafter([1, 2, 3, 4, 5], GROUNDED)
    table = StepRateTable({2: 0.060, 3: 0.0210, 4: 0.0245, 6: 0.0288}, {1: 0.0149})
    spec = spec_decoder(drafter, table, probe_interval=8)
    run(spec, scheduler)
    scored = [sum(len(d) for d in run(spec, scheduler, accept=5, seconds=0.0149,
                                      verify_seconds=0.0201)[1]
                  .scheduled_spec_decode_tokens.values()) for _ in range(18)]
    # skipped, probe (1 draft at 2 tokens), skipped, probe: the window at 2 tokens is now
    # (0.060, 0.0201, 0.0201), median 0.0201, and every step verifies 4-5 drafts again (how
    # many depends on the fake runner's times, 20.1 ms whatever the drafts)
    assert scored[:15] == [0] * 6 + [1] + [0] * 7 + [1]
    assert min(scored[15:]) >= 4 and table.measured(2) == 2


def test_a_bucket_whose_confidence_fell_too_low_still_gets_verified_now_and_then():
    """After a few early misses a confidence bucket can say 0.1, below what pays at batch 1
    (a > 0.35 with these step times); without probes nothing would verify it again and its
    estimate would never recover. Every 8th step without drafts verifies the surest draft."""
    scheduler = decoding_scheduler(1)
    drafter = CountingDrafter([1, 2, 3], [0.1, 0.9, 0.9])
    spec = spec_decoder(drafter, measured_table(), probe_interval=8, max_backoff_steps=0)
    run(spec, scheduler)
    scored = [sum(len(d) for d in run(spec, scheduler, accept=3, seconds=0.0149,
                                      verify_seconds=0.0201)[1]
                  .scheduled_spec_decode_tokens.values()) for _ in range(16)]
    assert scored == [0] * 6 + [1] + [0] * 7 + [1] + [0]
    assert ("r0", 1, 1) in drafter.observed
