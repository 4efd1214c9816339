"""Which drafts to verify this step: DSpark's hardware-aware prefix scheduler, and fixed length.

Varlen (DSpark paper §2, Algorithm 1). Request r has confidences c_{r,1..} (conditional
acceptance probabilities) and prefix-survival probabilities a_{r,j} = c_{r,1} ... c_{r,j}
(non-increasing in j). Verifying l_r drafts of each of R requests costs B = B0 + sum(l_r) batch
tokens (B0 = R decode tokens plus the step's prefill tokens) and commits, in expectation,
tau = tau0 + sum_r sum_{j <= l_r} a_{r,j} tokens (tau0 = R: each decode row commits at least its
correction or bonus token). Throughput is Theta = tau * SPS(B), SPS the verify steps per second at
B tokens; the step without drafts runs at its own rate, the plain step's (the first draft row
costs a jump: on CPU 7 ms on a 51 ms step of 16 decode rows), which is the Theta to beat. All
(r, j) candidates are sorted by a (ties: smaller j, then earlier r) and admitted one at a time
while Theta rises; the first candidate that does not raise it stops the search. Since a
is non-increasing in j, the order respects each request's prefix order, so what is admitted is
a prefix of each request's drafts. The stop at the first non-improvement is what keeps the
admission of (r, j) a function of candidates with a >= a_{r,j} only, none of which may depend on
draft j (Appendix A: a search for the best prefix overall lets a draft decide its own admission
and biases the output distribution).

Fixed: every request verifies min(its drafts, num_speculative_tokens) (the scheduler then caps
them by the token budget and the request's max_tokens).

Pure module: no torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def survival(confidences: Sequence[float]) -> list[float]:
    """[a_1, ..., a_k]: running products of the confidences (each clamped to [0, 1])."""
    products, running = [], 1.0
    for c in confidences:
        running *= min(max(float(c), 0.0), 1.0)
        products.append(running)
    return products


def admit_varlen(confidences: Sequence[Sequence[float]], steps_per_second: Callable[[int], float],
                 *, base_tokens: int, base_committed: float | None = None,
                 max_tokens: int | None = None,
                 plain_steps_per_second: float | None = None) -> list[int]:
    """Algorithm 1 of the DSpark paper: how many drafts each request verifies.

    Args:
        confidences: per decode request, c_{r,1..k_r} (k_r may differ; empty: no drafts).
        steps_per_second: SPS(B), verify steps per second at B batch tokens (B >= base_tokens).
        base_tokens: batch tokens without drafts (decode rows + prefill tokens in the step).
        base_committed: tau0, expected tokens committed without drafts (default: one per
            request).
        max_tokens: the step's token budget; B never exceeds it.
        plain_steps_per_second: steps per second of the step without drafts (default
            SPS(base_tokens)): the Theta the first admitted draft must beat.
    Returns:
        l_r per request, 0 <= l_r <= k_r: verify the first l_r drafts.
    """
    num_requests = len(confidences)
    lengths = [0] * num_requests
    survivals = [survival(c) for c in confidences]
    # position-major, then request order: sort is stable, so ties go to smaller j, then r
    candidates = [(a[j], j, r) for j in range(max((len(a) for a in survivals), default=0))
                  for r, a in enumerate(survivals) if j < len(a) and a[j] > 0.0]
    candidates.sort(key=lambda cand: -cand[0])
    tokens = base_tokens
    committed = float(num_requests if base_committed is None else base_committed)
    best = committed * (steps_per_second(max(tokens, 1)) if plain_steps_per_second is None
                        else plain_steps_per_second)
    for probability, position, request in candidates:
        if max_tokens is not None and tokens + 1 > max_tokens:
            break
        theta = (committed + probability) * steps_per_second(tokens + 1)
        if theta <= best:
            break                       # the first non-improvement ends the search
        tokens += 1
        committed += probability
        best = theta
        lengths[request] = position + 1
    return lengths


def drafting_can_pay(num_requests: int, steps_per_second: Callable[[int], float], *,
                     base_tokens: int, plain_steps_per_second: float | None = None,
                     max_tokens: int | None = None) -> bool:
    """False when `admit_varlen` admits nothing whatever the confidences: even a draft sure
    to be accepted (a = 1) does not raise Theta over the plain step, and the walk stops at its
    first candidate. The step loop then skips the drafter altogether."""
    if num_requests == 0 or (max_tokens is not None and base_tokens + 1 > max_tokens):
        return False
    plain = (steps_per_second(max(base_tokens, 1)) if plain_steps_per_second is None
             else plain_steps_per_second)
    return (num_requests + 1.0) * steps_per_second(base_tokens + 1) > num_requests * plain


def admit_fixed(num_drafts: Sequence[int], num_speculative_tokens: int) -> list[int]:
    """Fixed-length verification: min(k_r, num_speculative_tokens) drafts for each request."""
    return [min(k, num_speculative_tokens) for k in num_drafts]


def expected_committed(confidences: Sequence[float], length: int) -> float:
    """1 + a_1 + ... + a_length: expected tokens one request commits verifying `length` drafts."""
    return 1.0 + sum(survival(confidences)[:length])
