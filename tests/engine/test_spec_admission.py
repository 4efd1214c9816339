"""DSpark admission (engine/spec/admission.py), the step-rate table and the n-gram drafter, on
hand-made confidence and steps/s tables: pure functions, no model, no torch."""

import itertools

import pytest

from deepinfer.engine.spec.admission import (admit_fixed, admit_varlen, best_entry, capacity,
                                             drafting_can_pay, expected_committed,
                                             ranked_candidates, survival, top_candidates)
from deepinfer.engine.spec.drafter import DraftRequest, observed_positions
from deepinfer.engine.spec.ngram import NgramDrafter, TokenIndex, longest_suffix_match
from deepinfer.engine.spec.step_rate import StepRateTable, nondecreasing


def linear_seconds(per_draft: float, plain: float = 1.0, jump: float = 0.0):
    """t(D) of a step costing `plain` seconds, plus `jump + per_draft * D` when it verifies
    D > 0 drafts."""
    return lambda drafts: plain + (jump + per_draft * drafts if drafts else 0.0)


def theta(confidences, lengths, seconds):
    committed = sum(expected_committed(c, n) for c, n in zip(confidences, lengths))
    return committed / seconds(sum(lengths))


def brute_force_best_prefix(confidences, seconds):
    """The exhaustive search the paper's Appendix A warns about: the best lengths overall."""
    return list(max(itertools.product(*[range(len(c) + 1) for c in confidences]),
                    key=lambda ls: theta(confidences, ls, seconds)))


def test_survival_is_the_running_product():
    assert survival([0.9, 0.5, 1.0, 0.2]) == pytest.approx([0.9, 0.45, 0.45, 0.09])
    assert survival([1.5, -1]) == [1.0, 0.0]     # clamped to [0, 1]


def test_free_verification_admits_every_draft_and_costly_verification_none():
    confidences = [[0.9, 0.8, 0.7], [0.3], [0.5, 0.5]]
    flat = lambda drafts: 0.01   # memory-bound: drafts cost nothing
    assert admit_varlen(confidences, flat) == [3, 1, 2]
    # each draft costs as much as the whole step: no draft pays
    assert admit_varlen(confidences, linear_seconds(1.0)) == [0, 0, 0]
    assert admit_varlen([[], []], flat) == [0, 0]


def test_candidates_go_by_survival_across_requests():
    """A draft costs 5 % of the plain step: checked against brute force over all prefix-closed
    choices (Theta is unimodal here, so the gate and walk find the optimum)."""
    confidences = [[0.95, 0.9, 0.9, 0.5], [0.6, 0.9], [0.99, 0.99, 0.99, 0.99]]
    seconds = linear_seconds(0.05, plain=1.15)
    lengths = admit_varlen(confidences, seconds)
    assert lengths == brute_force_best_prefix(confidences, seconds) == [4, 2, 4]
    assert [(j, r) for _, j, r in ranked_candidates(confidences)][:4] == [
        (0, 2), (1, 2), (2, 2), (3, 2)]    # 0.99 ** 4 = 0.961 > 0.95


def test_ties_go_to_earlier_positions_then_earlier_requests():
    # all survivals equal at 0.5; room for one or two drafts under the budget
    confidences = [[0.5, 1.0], [0.5, 1.0]]
    assert admit_varlen(confidences, lambda drafts: 0.1, max_drafts=1) == [1, 0]
    assert admit_varlen(confidences, lambda drafts: 0.1, max_drafts=2) == [1, 1]
    assert top_candidates(confidences, 3) == [2, 1]


def test_prefill_tokens_in_the_step_make_drafts_relatively_cheaper():
    confidences = [[0.6, 0.6, 0.6]]
    table = StepRateTable({1: 1.2, 65: 13.0}, {1: 0.2, 3: 0.6}, window=0)   # 0.2 s a token
    alone = admit_varlen(confidences, table.step_seconds(1))
    with_prefill = admit_varlen(confidences, table.step_seconds(1 + 64))
    assert alone == [2] and with_prefill == [3]   # Theta 1.23 > 1.21 at 3 alone


def test_the_token_budget_caps_admission():
    assert admit_varlen([[1.0] * 5, [1.0] * 5], lambda drafts: 1.0, max_drafts=4) == [2, 2]
    assert admit_varlen([[1.0] * 5], lambda drafts: 1.0, max_drafts=0) == [0]


def test_the_gate_pays_the_jump_into_a_verify_step_with_a_draft_for_every_row():
    """16 rows, drafts of confidence 0.9, entering a verify step costs 30 % of the plain step
    and each draft 1 % more (the shape of a GPU batch: a blocking verify step against an
    overlapped plain one). One draft alone does not pay the jump (16.9 / 1.31 < 16 / 1), which
    stopped Algorithm 1's walk at its first candidate (H200, synthetic p = 0.9: one draft per
    row where fixed length made 2.5x). The gate over the first positions opens at 16 drafts
    (30.4 / 1.46 = 20.8 > 16), then the walk goes on while Theta rises: here to every draft."""
    confidences = [[0.9] * 5] * 16
    seconds = linear_seconds(0.01, jump=0.3)
    assert (16 + 0.9) / seconds(1) < 16 / seconds(0)
    assert best_entry([0.9] * 16, seconds, base_committed=16.0) == (
        16, pytest.approx((16 + 16 * 0.9) / 1.46))
    assert admit_varlen(confidences, seconds) == [5] * 16
    assert drafting_can_pay(16, seconds, max_drafts=80)
    # a 3 % draft price stops the walk after the fourth positions (at tau = 16 + 16 * 3.10
    # and t = 1.3 + 0.03 * 64 a draft needs a > 0.61; a_5 = 0.59); at 4 % the gate stays shut
    assert admit_varlen(confidences, linear_seconds(0.03, jump=0.3)) == [4] * 16
    assert admit_varlen(confidences, linear_seconds(0.04, jump=0.3)) == [0] * 16
    # a jump of 90 %: a draft for every row (tau 30.4) does not pay 1.9 x the step
    assert admit_varlen(confidences, linear_seconds(0.01, jump=0.9)) == [0] * 16
    # sure drafts for every position would pay a jump of the whole step (96 tokens for 2x the
    # time), not one of five steps
    assert drafting_can_pay(16, linear_seconds(0.0, jump=1.0), max_drafts=80)
    assert not drafting_can_pay(16, linear_seconds(0.0, jump=5.0), max_drafts=80)


def test_a_capacity_from_earlier_confidences_carries_past_a_jump_no_first_draft_pays():
    """A host-bound step (a jump of three plain steps, drafts then free): 16 first drafts of
    0.9 do not pay it (30.4 tokens for 4x the time), all 80 drafts do (75 tokens). The gate
    reads first positions only, so it stays shut; DSpark §5.2's capacity, an unconstrained
    search over an earlier step's confidences, admits the 80 candidates ranked first."""
    confidences = [[0.9] * 5] * 16
    seconds = linear_seconds(0.0, jump=3.0)
    assert admit_varlen(confidences, seconds) == [0] * 16
    assert capacity(confidences, seconds) == 80
    assert admit_varlen(confidences, seconds, min_drafts=80) == [5] * 16
    # the walk goes on past the capacity while Theta rises, and a capacity that does not pay
    # is 0
    assert admit_varlen(confidences, seconds, min_drafts=16) == [5] * 16
    assert capacity([[0.2] * 5] * 16, seconds) == 0


def test_context_confidences_enter_at_their_own_capacity_where_no_first_draft_can():
    """One row on the H100: a verify step costs 2.35x a plain one, so not even a sure first
    draft pays it ((1 + 1) / 2.35 < 1) and the gate alone never opens. A drafter whose
    confidences read no draft (n-gram) enters at the capacity over this step's confidences:
    five drafts of 0.95 (5.1 tokens in 2.4x the time) are admitted; drafts that do not pay
    (0.3 each) are not. Where sure first drafts could open the gate (a jump of 30 %), the gate
    decides as without the flag."""
    seconds = linear_seconds(0.01, jump=1.3)
    assert best_entry([1.0], seconds, base_committed=1.0)[1] < 1.0 / seconds(0)
    sure = [[0.95] * 5]
    assert admit_varlen(sure, seconds) == [0]
    assert admit_varlen(sure, seconds, context_confidences=True) == [5]
    assert admit_varlen([[0.3] * 5], seconds, context_confidences=True) == [0]
    gate_opens = linear_seconds(0.01, jump=0.3)
    for confidences in ([[0.2, 0.99, 0.99]], [[0.9] * 5] * 16, [[0.5, 0.05]]):
        assert (admit_varlen(confidences, gate_opens, context_confidences=True)
                == admit_varlen(confidences, gate_opens))


def test_appendix_a_admission_of_a_draft_never_depends_on_later_confidences():
    """Appendix A's shape: one draft alone does not pay but two do (step seconds 1, 1/0.6,
    1/0.6). With a draft-dependent (Markov-feature) confidence, c_2 is a function of draft 1;
    an exhaustive search then admits draft 1 only when draft 1 makes c_2 high, which biases the
    output (the paper's (0.7, 0.3) target became (0.85, 0.15)). The gate reads first positions
    only and the walk stops at the first non-improvement: draft 1 is decided from a_1 alone."""
    seconds = {0: 1.0, 1: 1 / 0.6, 2: 1 / 0.6}.__getitem__
    c1 = 0.5
    for c2 in (0.05, 0.5, 0.95):   # c_2 as draft 1 would set it
        assert admit_varlen([[c1, c2]], seconds) == [0]
    # what the exhaustive search would do: admit both exactly when draft 1 makes c_2 high
    assert brute_force_best_prefix([[c1, 0.05]], seconds) == [0]
    assert brute_force_best_prefix([[c1, 0.95]], seconds) == [2]
    # the same shape across a batch: whether row 0's draft 1 is verified reads the first
    # positions (and what ranks above it), never row 0's own c_2
    batch_seconds = linear_seconds(0.05, jump=0.2)
    for c2 in (0.05, 0.5, 0.95):
        assert admit_varlen([[0.6, c2], [0.9, 0.9]], batch_seconds)[0] >= 1


def test_admission_of_position_j_reads_only_candidates_at_least_as_likely():
    """Changing the confidence after a request's cut (which its drafts may set) never changes
    what was admitted before it."""
    seconds = linear_seconds(0.1, plain=1.2)
    base = [[0.9, 0.7, 0.2], [0.8, 0.3]]
    lengths = admit_varlen(base, seconds)
    assert lengths == [2, 1]
    for later in (0.0, 0.1, 0.3):
        changed = [c[:n + 1] + [later] * (len(c) - n - 1) for c, n in zip(base, lengths)]
        assert admit_varlen(changed, seconds) == lengths


def test_the_walk_looks_past_a_step_of_the_cost_curve():
    """A step-shaped t (SmolLM2 on the CPU box at batch 1: 1 draft +2.3 ms, 2 drafts +7.6 ms,
    4 drafts +8.3 ms): the second draft alone lowers Theta, drafts 2-4 together raise it. The
    walk crosses the step when the candidate's own survival, counted for the ones after it,
    could pay it; never when even that could not; and what it admits still reads no confidence
    past the candidate (changing them changes nothing before it)."""
    steps = {0: 11.7, 1: 14.0, 2: 19.3, 3: 19.3, 4: 20.0, 5: 23.4}.__getitem__
    grounded = [[0.98, 0.48, 0.99, 1.0, 0.66]]     # survivals .98 .47 .47 .47 .31
    assert admit_varlen(grounded, steps) == [4]
    assert theta(grounded, [4], steps) > theta(grounded, [1], steps)
    assert admit_varlen([[0.98, 0.2, 0.2, 0.2, 0.2]], steps) == [1]   # .2 x 3 cannot pay 5.3 ms
    for later in (0.0, 0.5, 1.0):                   # past draft 4, nothing read
        assert admit_varlen([[0.98, 0.48, 0.99, 1.0, later]], steps)[0] >= 4
    # a linear t: the look ahead agrees with the first non-improvement
    seconds = linear_seconds(0.1, plain=1.2)
    for confidences in ([[0.9, 0.7, 0.2], [0.8, 0.3]], [[0.95] * 5, [0.5] * 5]):
        lengths = admit_varlen(confidences, seconds)
        walked, current, committed = [0, 0], 0.0, 2.0
        for index, (a, position, request) in enumerate(ranked_candidates(confidences)):
            if (committed + a) / seconds(index + 1) <= current:
                break
            committed, current = committed + a, (committed + a) / seconds(index + 1)
            walked[request] = position + 1
        assert lengths == walked


def test_fixed_admission():
    assert admit_fixed([0, 3, 7], 5) == [0, 3, 5]


def test_step_rate_table_plain_plus_extra_interpolated_and_re_measured():
    table = StepRateTable({1: 0.010, 4: 0.013, 8: 0.021}, {1: 0.004, 4: 0.007}, window=3,
                          load_smoothing=0.0)
    assert table.seconds(2) == pytest.approx(0.011)
    assert table.seconds(16) == pytest.approx(0.037)         # last slope extended
    assert table.seconds(4, 2) == pytest.approx(0.013 + 0.005)
    assert table.step_seconds(4)(0) == pytest.approx(0.013)
    table.observe(4, 0, 0.017)                               # median of 0.013, 0.017
    assert table.seconds(4) == pytest.approx(0.015)
    table.observe(4, 0, 0.017)
    table.observe(4, 0, 0.017)                               # the start-up value is out
    assert table.seconds(4) == pytest.approx(0.017) and table.measured(4) == 3
    # a verify step at the running batch re-measures extra(D): its time minus plain(B0)
    for _ in range(3):
        table.observe(4, 4, 0.017 + 0.012)
    assert table.seconds(4, 4) == pytest.approx(0.029) and table.measured(4, 4) == 3
    # a key not observed yet: its start-up value at the scale of the nearest observed key
    # (4 drafts: 12 ms observed / 7 ms profiled)
    assert table.seconds(4, 1) == pytest.approx(0.017 + 0.004 * 12 / 7)
    table.observe(4, 2, 0.017 + 0.020)  # a new point, pooled with 4 by the monotone fit
    assert table.seconds(4, 2) == pytest.approx(0.017 + 0.014)
    assert table.as_milliseconds()["extra"] == {4: {1: 6.857, 2: 14.0, 4: 14.0}}
    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert nondecreasing([1.0, 3.0, 2.0], [1.0, 1.0, 3.0]) == [1.0, 2.25, 2.25]
    with pytest.raises(ValueError, match="plain and one verify"):
        StepRateTable({1: 0.01}, {})


def test_longest_suffix_match():
    tokens = [1, 2, 3, 4, 9, 2, 3, 4, 5, 6, 2, 3, 4]
    # "2 3 4" occurs twice before; the most recent one (ending at index 7) is followed by 5
    assert longest_suffix_match(tokens, 1, 4) == (3, 8)
    assert longest_suffix_match(tokens, 4, 4) == (0, -1)       # "3 4 ... 4"? no 4-gram match
    assert longest_suffix_match([7, 8, 9], 1, 3) == (0, -1)
    assert longest_suffix_match([5, 5, 5, 5], 1, 2) == (2, 3)


def test_the_token_index_finds_what_the_scan_finds_as_tokens_grow():
    """`TokenIndex` keeps each token's positions as a request's tokens grow (one proposal per
    step then costs the last token's occurrences, not a scan); the match is the scan's, also
    after the list it indexed changed under it (re-indexed)."""
    import random

    rng = random.Random(0)
    index, tokens = TokenIndex(), []
    for step in range(200):
        tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 4)))
        if step == 120:
            tokens = tokens[:50]                         # shrank: re-indexed
        if step == 150:
            tokens[index.indexed - 1] += 100             # changed: re-indexed
        occurrences = index.occurrences(tokens)
        assert list(occurrences) == [e for e in range(len(tokens) - 1)
                                     if tokens[e] == tokens[-1]]
        assert (longest_suffix_match(tokens, 1, 4, occurrences)
                == longest_suffix_match(tokens, 1, 4))
    assert TokenIndex().occurrences([]) == () and TokenIndex().occurrences([3]) == ()


def test_the_step_rate_reader_prices_every_draft_count_as_the_table_does():
    """The admission's reader (prices made for every D up to the largest read, in one pass)
    reads what `seconds` reads key by key, below, between and past the profiled keys, after
    observations in two batch buckets."""
    table = StepRateTable({1: 0.010, 8: 0.012, 32: 0.030}, {1: 0.002, 5: 0.004, 40: 0.010},
                          batch_extra_seconds={16: {1: 0.003, 80: 0.020}})
    for base, drafts, seconds in [(1, 5, 0.02), (16, 3, 0.05), (16, 0, 0.02), (1, 60, 0.04),
                                  (3, 2, 0.03), (16, 70, 0.09)]:
        table.observe(base, drafts, seconds)
    for base in (1, 3, 12, 16, 40):
        reader = table.step_seconds(base)
        for drafts in (0, 1, 2, 200, 7, 41, 80, 3, 120):
            assert reader(drafts) == pytest.approx(table.seconds(base, drafts), rel=1e-12)


def test_ngram_drafts_and_their_confidences():
    drafter = NgramDrafter(num_speculative_tokens=3, min_n=1, max_n=3)
    text = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    proposals = drafter.propose([DraftRequest("a", text, 6, max_drafts=3),
                                 DraftRequest("b", [1, 2, 3], 3, max_drafts=3),
                                 DraftRequest("c", text, 6, max_drafts=1)])
    assert proposals["a"].token_ids == [13, 14, 15]
    assert "b" not in proposals                                # no earlier match
    assert proposals["c"].token_ids == [13]
    assert proposals["a"].confidences == [0.5, 0.5, 0.5]      # pooled Beta(1, 1) prior
    drafter.observe("a", 3, 2)                                 # a's first: NEW bucket
    for _ in range(8):                                         # 2 of 3 accepted, 8 times
        drafter.propose([DraftRequest("a", text, 6, max_drafts=3)])
        drafter.observe("a", 3, 2)                             # ... after a MISS
    other = [10, 11, 12, 99, 98, 97, 10, 11, 12]
    d_first = drafter.propose([DraftRequest("d", other, 6, 3)])["d"].confidences
    drafter.observe("d", 3, 2)                                 # d's first (NEW), now a MISS
    both = drafter.propose([DraftRequest("a", text, 6, max_drafts=3),
                            DraftRequest("d", other, 6, 3)])
    shared = drafter.confidences(3, True, drafter.MISS, 3)
    # MISS bucket of match length 3: 8 trials + 2 pseudo-trials at the pooled mean; pooled
    # MISS: position 0 8 of 8 + Beta(1, 1) = 0.9, position 1 8 of 8 + 2 at 0.9 = 0.98,
    # position 2 0 of 8 + 2 at 0.98 = 0.196
    assert shared == pytest.approx([(8 + 2 * 0.9) / 10, (8 + 2 * 0.98) / 10,
                                    (0 + 2 * 0.196) / 10])
    # a position never verified borrows the one before it: with 3 drafts at most, position 3
    # of a 4-draft proposal would say 0.196 (pooled, no counts) -> its bucket mean the same
    assert drafter.pooled_means(True, drafter.MISS, 4)[3] == pytest.approx(0.196)
    # same match length, another continuation: the same shared confidences (c_j never reads
    # draft j), each scaled by its request's own record (RequestCalibration)
    assert both["d"].token_ids == [99, 98, 97]
    for request_id in ("a", "d"):
        factor = drafter.calibration.factor(request_id)
        assert both[request_id].confidences == pytest.approx(
            [max(min(c * factor, 0.99), c) if factor > 1 else c * factor for c in shared])
    # d: its one verification passed 2 of the 3 positions observed (at NEW's confidences)
    assert drafter.calibration.factor("d") == pytest.approx((2 + 1) / (sum(d_first) + 1))


def test_a_request_reads_the_shared_confidences_scaled_by_its_own_record():
    """Shared counters learnt on grounded prompts (first drafts pass 0.9 of the time) do not
    keep a chat request, whose drafts fail, at 0.9: each of its verifications moves its factor
    (A + 1) / (E + 1) towards what it showed; a request that matches the shared rate keeps
    them; a forgotten request starts again at 1."""
    drafter = NgramDrafter(num_speculative_tokens=3, min_n=1, max_n=3)
    grounded = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    for _ in range(40):   # 9 of 10 verifications pass in full, the last fails at once
        for outcome in range(10):
            drafter.propose([DraftRequest("g", grounded, 6, max_drafts=3)])
            drafter.observe("g", 3, 0 if outcome == 9 else 3)
        drafter.forget("g")
    chat = [20, 21, 22, 23, 20, 21]
    first = drafter.propose([DraftRequest("chat", chat, 4, max_drafts=2)])["chat"].confidences
    assert first[0] > 0.8                                     # the shared rate, nothing else yet
    for _ in range(3):
        drafter.observe("chat", 2, 0)                         # rejected at the first draft
        values = drafter.propose([DraftRequest("chat", chat, 4, 2)])["chat"].confidences
    factor = drafter.calibration.factor("chat")   # 1 / (1 + ~1.6 predicted acceptances)
    assert factor < 0.45
    assert values == pytest.approx([factor * c for c in drafter.confidences(
        2, True, drafter.MISS, 2)])
    for _ in range(20):   # a grounded request that passes as the counters say stays near 1
        drafter.propose([DraftRequest("g2", grounded, 6, max_drafts=3)])
        drafter.observe("g2", 3, 3)
    assert 0.95 < drafter.calibration.factor("g2") <= 1.3
    drafter.forget("chat")
    assert drafter.calibration.factor("chat") == 1.0


def test_a_proposal_never_verified_is_scored_against_the_tokens_decoded_after_it():
    """A proposal the admission did not verify (observe(..., 0, 0)) is scored at the
    request's next proposal against the tokens decoded since: the drafts that match them count
    as accepted, the first that does not as rejected, positions not decoded yet as
    unobserved; the counters and the request's calibration learn from it as from a
    verification, and a verified proposal is not scored twice."""
    drafter = NgramDrafter(num_speculative_tokens=3, min_n=1, max_n=3)
    text = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    first = drafter.propose([DraftRequest("a", text, 6, max_drafts=3)])["a"]
    assert first.token_ids == [13, 14, 15]
    drafter.observe("a", 0, 0)                                   # admitted none
    drafter.propose([DraftRequest("a", text + [13, 14], 6, max_drafts=3)])
    # two positions decoded, both as drafted: 2 of 2 accepted in the NEW bucket
    assert [drafter.counter(3, True, j).trials for j in range(3)] == [1, 1, 0]
    assert drafter.counter(3, True, 1).accepted == 1
    assert drafter.calibration.factor("a") == pytest.approx((2 + 1) / (sum(first.confidences[:2])
                                                                     + 1))
    drafter.observe("a", 3, 3)                                   # verified: recorded once
    drafter.propose([DraftRequest("a", text + [13, 14, 15, 10, 11, 12], 6, max_drafts=3)])
    assert sum(drafter.counter(2, True, 0, o).trials for o in range(3)) + sum(
        drafter.counter(3, True, 0, o).trials for o in range(3)) == 2
    # a chat-like request whose unverified drafts the decoded tokens contradict
    chat = [20, 21, 22, 23, 20, 21]
    drafter.propose([DraftRequest("b", chat, 4, max_drafts=2)])
    drafter.propose([DraftRequest("b", chat + [30, 31], 4, max_drafts=2)])
    assert drafter.calibration.factor("b") < 1.0 and drafter._outcome["b"] == drafter.MISS


def test_observed_positions():
    assert observed_positions(3, 1) == [(0, True), (1, False)]
    assert observed_positions(2, 2) == [(0, True), (1, True)]
    assert observed_positions(0, 0) == []
