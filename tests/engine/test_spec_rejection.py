"""Speculative (rejection) sampling keeps the target distribution (engine/spec/rejection.py).

A 5-token vocabulary, two draft positions, draft distributions far from the target's, and a
target whose second position depends on the first token (as a model's does). Over N samples
the committed first token must follow p_1, and the second (when the first draft was accepted)
p_2 given x_1. Pearson chi-square tests at significance 1e-3 each: a correct sampler fails
either with probability < 2e-3 (the generator is seeded, so the outcome is also reproducible).
"""

import math

import pytest
import torch

from deepinfer.engine.spec.rejection import rejection_sample

ALPHA = 1e-3
N = 6000


def chi_square_pvalue(observed: list[int], expected: list[float]) -> float:
    """Pearson's test over 5 categories (4 degrees of freedom): the chi-square survival
    function for even df = 2m is exp(-x/2) * sum_{i<m} (x/2)^i / i!."""
    x = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert len(observed) == 5
    return math.exp(-x / 2) * (1 + x / 2)


def target_rows(first_token: int) -> torch.Tensor:
    p1 = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
    p2 = torch.roll(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]), first_token)   # depends on x_1
    p3 = torch.full((5,), 0.2)
    return torch.stack([p1, p2, p3])


@pytest.mark.parametrize("point_mass", [False, True])
def test_committed_tokens_follow_the_target(point_mass):
    generator = torch.Generator().manual_seed(1)
    q = torch.tensor([[0.05, 0.05, 0.1, 0.2, 0.6], [0.3, 0.3, 0.2, 0.1, 0.1]])
    first, second = [0] * 5, [0] * 5
    cond = 0 if point_mass else 2    # x_1 whose continuation is checked (~N / 10 accepted)
    accepted_first = 0
    for _ in range(N):
        x1 = int(torch.multinomial(q[0], 1, generator=generator)) if not point_mass else 0
        x2 = int(torch.multinomial(q[1], 1, generator=generator)) if not point_mass else 1
        target = target_rows(x1)
        committed = rejection_sample(target, [x1, x2], None if point_mass else q, generator)
        assert 1 <= len(committed) <= 3
        first[committed[0]] += 1
        if len(committed) >= 2:     # draft 1 accepted: the second token is drawn given x_1
            accepted_first += 1
            if x1 == cond:
                second[committed[1]] += 1
    p1 = target_rows(0)[0]
    assert chi_square_pvalue(first, (p1 * N).tolist()) > ALPHA
    p2 = target_rows(cond)[1]
    total = sum(second)
    assert total > 400
    assert chi_square_pvalue(second, (p2 * total).tolist()) > ALPHA
    if point_mass:   # accepted with probability p_1(x_1) exactly
        assert abs(accepted_first / N - 0.40) < 4 * (0.4 * 0.6 / N) ** 0.5


def test_no_drafts_is_plain_sampling_and_equal_distributions_always_accept():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0]])
    assert rejection_sample(p, [], None, generator) == [1]
    target = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    for token in range(3):   # q == p: ratio 1, always accepted, then the bonus
        out = rejection_sample(target, [token], target[:1], generator)
        assert len(out) == 2 and out[0] == token
