"""DSpark admission (engine/spec/admission.py), the step-rate table and the n-gram drafter, on
hand-made confidence and steps/s tables: pure functions, no model, no torch."""

import itertools

import pytest

from deepinfer.engine.spec.admission import (admit_fixed, admit_varlen, expected_committed,
                                             survival)
from deepinfer.engine.spec.drafter import DraftRequest, observed_positions
from deepinfer.engine.spec.ngram import NgramDrafter, longest_suffix_match
from deepinfer.engine.spec.step_rate import StepRateTable, nondecreasing


def linear_sps(per_token: float, fixed: float = 1.0):
    """SPS(B) of a step costing `fixed + per_token * B` seconds."""
    return lambda tokens: 1.0 / (fixed + per_token * tokens)


def theta(confidences, lengths, sps, base_tokens):
    committed = sum(expected_committed(c, n) for c, n in zip(confidences, lengths))
    return committed * sps(base_tokens + sum(lengths))


def test_survival_is_the_running_product():
    assert survival([0.9, 0.5, 1.0, 0.2]) == pytest.approx([0.9, 0.45, 0.45, 0.09])
    assert survival([1.5, -1]) == [1.0, 0.0]     # clamped to [0, 1]


def test_free_verification_admits_every_draft_and_costly_verification_none():
    confidences = [[0.9, 0.8, 0.7], [0.3], [0.5, 0.5]]
    flat = lambda tokens: 100.0   # memory-bound: a bigger step costs nothing
    assert admit_varlen(confidences, flat, base_tokens=3) == [3, 1, 2]
    # each token costs as much as the whole step: no draft pays
    assert admit_varlen(confidences, linear_sps(1.0, fixed=0.0), base_tokens=3) == [0, 0, 0]
    assert admit_varlen([[], []], flat, base_tokens=2) == [0, 0]


def test_candidates_go_by_survival_across_requests():
    """Cost 0.1 of a step per token: a candidate pays while a > (tau) * 0.1 / (1 + 0.1 B)...
    checked against brute force over all prefix-closed choices (Theta is unimodal here, so
    the greedy walk finds the optimum)."""
    confidences = [[0.95, 0.9, 0.9, 0.5], [0.6, 0.9], [0.99, 0.99, 0.99, 0.99]]
    sps = linear_sps(0.05)
    lengths = admit_varlen(confidences, sps, base_tokens=3)
    best = max(itertools.product(*[range(len(c) + 1) for c in confidences]),
               key=lambda ls: theta(confidences, ls, sps, 3))
    assert lengths == list(best)
    assert lengths[2] == 4 and lengths[1] <= lengths[0]


def test_ties_go_to_earlier_positions_then_earlier_requests():
    # all survivals equal at 0.5; room for exactly two more tokens under the budget
    confidences = [[0.5, 1.0], [0.5, 1.0]]
    assert admit_varlen(confidences, lambda b: 10.0, base_tokens=2, max_tokens=3) == [1, 0]
    assert admit_varlen(confidences, lambda b: 10.0, base_tokens=2, max_tokens=4) == [1, 1]


def test_prefill_tokens_in_the_step_make_drafts_relatively_cheaper():
    confidences = [[0.6, 0.6, 0.6]]
    sps = linear_sps(0.2)
    alone = admit_varlen(confidences, sps, base_tokens=1)
    with_prefill = admit_varlen(confidences, sps, base_tokens=1 + 64)
    assert alone == [2] and with_prefill == [3]   # Theta 1.23 > 1.21 at 3 alone


def test_the_token_budget_caps_admission():
    assert admit_varlen([[1.0] * 5, [1.0] * 5], lambda b: 1.0, base_tokens=2,
                        max_tokens=6) == [2, 2]


def brute_force_best_prefix(confidences, sps, base_tokens):
    """The exhaustive search the paper's Appendix A warns about: the best lengths overall."""
    return list(max(itertools.product(*[range(len(c) + 1) for c in confidences]),
                    key=lambda ls: theta(confidences, ls, sps, base_tokens)))


def test_appendix_a_admission_of_a_draft_never_depends_on_later_confidences():
    """Appendix A's shape: a step-shaped SPS where one draft alone does not pay but two do.
    With a draft-dependent (Markov-feature) confidence, c_2 is a function of draft 1; an
    exhaustive search then admits draft 1 only when draft 1 makes c_2 high, which biases the
    output (the paper's (0.7, 0.3) target became (0.85, 0.15)). The first-non-improvement stop
    decides draft 1 from a_1 alone."""
    sps_table = {1: 1.0, 2: 0.6, 3: 0.6}
    sps = sps_table.__getitem__
    c1 = 0.5
    for c2 in (0.05, 0.5, 0.95):   # c_2 as draft 1 would set it
        assert admit_varlen([[c1, c2]], sps, base_tokens=1) == [0]
    # what the exhaustive search would do: admit both exactly when draft 1 makes c_2 high
    assert brute_force_best_prefix([[c1, 0.05]], sps, 1) == [0]
    assert brute_force_best_prefix([[c1, 0.95]], sps, 1) == [2]


def test_admission_of_position_j_reads_only_candidates_at_least_as_likely():
    """Changing the confidence after a request's cut (which its drafts may set) never changes
    what was admitted before it."""
    sps = linear_sps(0.1)
    base = [[0.9, 0.7, 0.2], [0.8, 0.3]]
    lengths = admit_varlen(base, sps, base_tokens=2)
    for later in (0.0, 0.1, 0.3):
        changed = [c[:n + 1] + [later] * (len(c) - n - 1) for c, n in zip(base, lengths)]
        assert admit_varlen(changed, sps, base_tokens=2) == lengths


def test_fixed_admission():
    assert admit_fixed([0, 3, 7], 5) == [0, 3, 5]


def test_step_rate_table_interpolates_and_re_measures():
    table = StepRateTable({1: 0.010, 4: 0.013, 8: 0.021}, window=3, load_smoothing=0.0)
    assert table.seconds(2) == pytest.approx(0.011)
    assert table.seconds(16) == pytest.approx(0.037)         # last slope extended
    assert table.seconds(0) == pytest.approx(0.010)
    assert table(4) == pytest.approx(1 / 0.013)
    table.observe(4, 0.017)                                  # median of 0.013, 0.017
    assert table.seconds(4) == pytest.approx(0.015)
    table.observe(4, 0.017)
    table.observe(4, 0.017)                                  # the start-up value is out
    assert table.seconds(4) == pytest.approx(0.017)
    table.observe(6, 0.027)             # a new point, pooled with 8 by the monotone fit
    assert table.seconds(6) == pytest.approx(0.024) and table.seconds(8) == pytest.approx(0.024)
    assert StepRateTable.from_steps_per_second({1: 100.0})(1) == pytest.approx(100.0)
    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert nondecreasing([1.0, 3.0, 2.0], [1.0, 1.0, 3.0]) == [1.0, 2.25, 2.25]


def test_longest_suffix_match():
    tokens = [1, 2, 3, 4, 9, 2, 3, 4, 5, 6, 2, 3, 4]
    # "2 3 4" occurs twice before; the most recent one (ending at index 7) is followed by 5
    assert longest_suffix_match(tokens, 1, 4) == (3, 8)
    assert longest_suffix_match(tokens, 4, 4) == (0, -1)       # "3 4 ... 4"? no 4-gram match
    assert longest_suffix_match([7, 8, 9], 1, 3) == (0, -1)
    assert longest_suffix_match([5, 5, 5, 5], 1, 2) == (2, 3)


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
    drafter.propose([DraftRequest("d", other, 6, 3)])
    drafter.observe("d", 3, 2)                                 # d's first (NEW), now a MISS
    both = drafter.propose([DraftRequest("a", text, 6, max_drafts=3),
                            DraftRequest("d", other, 6, 3)])
    conf = both["a"].confidences
    # MISS bucket of match length 3: 8 trials + 2 pseudo-trials at the pooled mean; pooled
    # MISS: position 0 8 of 8 + Beta(1, 1) = 0.9, position 1 8 of 8 + 2 at 0.9 = 0.98,
    # position 2 0 of 8 + 2 at 0.98 = 0.196
    assert conf == pytest.approx([(8 + 2 * 0.9) / 10, (8 + 2 * 0.98) / 10, (0 + 2 * 0.196) / 10])
    # a position never verified borrows the one before it: with 3 drafts at most, position 3
    # of a 4-draft proposal would say 0.196 (pooled, no counts) -> its bucket mean the same
    assert drafter.pooled_mean(True, drafter.MISS, 3) == pytest.approx(0.196)
    # same match length, another continuation: the same confidences (c_j never reads draft j)
    assert both["d"].token_ids == [99, 98, 97] and both["d"].confidences == conf


def test_observed_positions():
    assert observed_positions(3, 1) == [(0, True), (1, False)]
    assert observed_positions(2, 2) == [(0, True), (1, True)]
    assert observed_positions(0, 0) == []
