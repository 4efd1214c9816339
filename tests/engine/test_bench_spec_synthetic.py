"""The synthetic drafter of benchmarks/bench_spec_synthetic.py: draft j is the oracle's token
with probability p (independently per position), another token otherwise, and every
confidence is p, so P(draft j accepted | drafts before it were) = p: a calibrated confidence.
Pure Python on the CPU."""

import importlib.util
import math
from pathlib import Path

import pytest

from deepinfer.engine.spec.drafter import DraftRequest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_spec_synthetic.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_spec_synthetic", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("p", [0.3, 0.9])
def test_drafts_match_the_oracle_at_rate_p_with_confidence_p(bench, p):
    vocab, gamma = 1000, 5
    prompts = [tuple(range(i, i + 6)) for i in range(40)]
    oracle = {q: [(7 * t + i) % vocab for t in range(64)] for i, q in enumerate(prompts)}
    drafter = bench.SyntheticDrafter(oracle, {q: p for q in prompts}, vocab)
    hits = trials = 0
    for done in range(0, 58):
        requests = [DraftRequest(f"r{i}", list(q) + oracle[q][:done], len(q), gamma)
                    for i, q in enumerate(prompts)]
        proposals = drafter.propose(requests)
        for i, q in enumerate(prompts):
            drafts = proposals[f"r{i}"]
            assert drafts.confidences == [p] * gamma
            expected = oracle[q][done:done + gamma]
            hits += sum(d == e for d, e in zip(drafts.token_ids, expected))
            trials += gamma
            assert all(0 <= d < vocab for d in drafts.token_ids)
        again = drafter.propose(requests)   # the same draws: reruns are comparable
        assert [again[f"r{i}"].token_ids for i in range(len(prompts))] == [
            proposals[f"r{i}"].token_ids for i in range(len(prompts))]
    assert not drafter.diverged
    sigma = math.sqrt(p * (1 - p) / trials)
    assert abs(hits / trials - p) < 4 * sigma


def test_a_request_that_left_its_oracle_is_counted(bench):
    prompt = (1, 2, 3)
    drafter = bench.SyntheticDrafter({prompt: [5, 6, 7, 8]}, {prompt: 1.0}, 100)
    assert drafter.propose([DraftRequest("r", [1, 2, 3, 5], 3, 2)])["r"].token_ids == [6, 7]
    drafter.propose([DraftRequest("r", [1, 2, 3, 9], 3, 2)])
    assert drafter.diverged == {prompt}


def test_expected_length_is_one_plus_the_geometric_sum(bench):
    assert bench.expected_length([0.5], 3) == pytest.approx(1.875)
    assert bench.expected_length([1.0, 0.0], 5) == pytest.approx(3.5)
