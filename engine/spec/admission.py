"""Which drafts to verify this step: DSpark's hardware-aware prefix scheduler, and fixed length.

Varlen (DSpark paper §2, Algorithm 1). Request r has confidences c_{r,1..} (conditional
acceptance probabilities) and prefix-survival probabilities a_{r,j} = c_{r,1} ... c_{r,j}
(non-increasing in j). A step that verifies D drafts costs t(D) seconds (t(0): the plain step of
the same rows and prefill tokens; engine/spec/step_rate.py) and commits, in expectation,
tau = tau0 + (sum of the admitted a) tokens (tau0 = R: each decode row commits at least its
correction or bonus token). Throughput is Theta = tau / t(D); the plain step's tau0 / t(0) is
the Theta to beat.

The walk. All (r, j) candidates are sorted by a (ties: smaller j, then earlier r) and admitted
one at a time while Theta rises; the first candidate that does not raise it stops the search.
Since a is non-increasing in j, the order respects each request's prefix order, so what is
admitted is a prefix of each request's drafts. The stop at the first non-improvement keeps the
admission of (r, j) a function of candidates with a >= a_{r,j} only, none of which may depend on
draft j (Appendix A: a search for the best prefix overall lets a draft decide its own admission
and biases the output distribution). "Raise" looks past steps of the cost curve (CUDA-graph
token buckets, kernel row tiles: a second draft can cost more than the next three together):
a candidate that does not raise Theta by itself is still admitted when it and the candidates
after it, each counted at its own survival (an upper bound for theirs, so no later
confidence is read), could (`pays_ahead`). Without that look, the walk stopped at the first
step: SmolLM2 at batch 1 on grounded prompts (CPU box) verified one draft in 15 of 65 steps
where its drafts 3-5 had confidences of ~0.99 and all five paid.

The gate. Entering a verify step costs a jump (extra(1) of the table: other kernels, on the GPU
a blocking step instead of an overlapped one) that no single draft pays at a large batch, though
a draft for every row does: the walk alone would stop at its first candidate. So whether to
verify at all is decided first from the first positions only: the best Theta over the K surest
first drafts, K = 1..R, an unconstrained search (lossless: a_{r,1} = c_{r,1} depends on no
draft). When it beats the plain step, the K* candidates ranked first are admitted (the rank of
(r, j) depends only on candidates with a >= a_{r,j}) and the walk goes on from there on the
verify curve; else nothing is verified. The gate asks for a margin, `min_gain` (SpeculativeConfig.
spec_min_gain): a predicted gain smaller than the error of the step-time estimates is as likely
a loss (the 2-core CPU box, chat at batch 16: one draft of 0.83 priced at 3 ms over a 97 ms
step, a predicted +2 %, cost 9 ms). Where the jump is so large that only drafts past the
first positions pay it (a host-bound step: SmolLM2-sized or smaller models), the first positions
cannot open the gate; DSpark's production variant (§5.2) then helps: a capacity K from an
earlier step's confidences (`capacity`, an unconstrained search, lossless since those cannot
depend on this step's drafts) admits the K candidates ranked first, and the walk goes on.
And where even sure first drafts could not open the gate (one row at a time on the H100: a
verify step of SmolLM2 costs 2.0-2.4x a plain one, so no first draft alone pays it), a drafter
whose confidences are functions of the context alone (`context_confidences`: the n-gram
drafter's counters are keyed by match length, position and past outcomes, never by a draft)
enters at the capacity over this step's own confidences: no confidence there depends on a
draft, so no draft can decide its own admission, and Appendix A holds. Without it varlen at
batch 1 verified only through an earlier step's capacity or a peek, and skipped the drafter on
23-54 % of the steps where fixed length drafted (H100, grounded prompts). Where sure first
drafts could open the gate (the CPU, where one row's verify step costs ~1.35x a plain one) the
gate decides as above: there the capacity over this step's confidences as every step's entry
(tried in s51) admitted middling drafts that the gate refused and measured slower (grounded b1
1.79x against 2.00x).

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
        running *= 0.0 if c < 0.0 else 1.0 if c > 1.0 else c
        products.append(running)
    return products


def ranked_candidates(confidences: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    """(a_{r,j}, j, r) of every candidate with a > 0, surest first (ties: smaller j, then r);
    j is 0-based."""
    survivals = [survival(c) for c in confidences]
    # position-major, then request order: sort is stable, so ties go to smaller j, then r
    candidates = [(a[j], j, r) for j in range(max((len(a) for a in survivals), default=0))
                  for r, a in enumerate(survivals) if j < len(a) and a[j] > 0.0]
    candidates.sort(key=lambda cand: -cand[0])
    return candidates


def best_entry(first_survivals: Sequence[float], step_seconds: Callable[[int], float], *,
               base_committed: float, max_drafts: int | None = None) -> tuple[int, float]:
    """The gate: (K*, Theta) of the best verify step over the K surest first drafts alone.

    Args:
        first_survivals: a_{r,1} of the requests with drafts (any order).
        step_seconds: t(D), seconds of the step verifying D drafts (t(0): plain).
        base_committed: tau0.
        max_drafts: D never exceeds it (None: no cap).
    Returns:
        (K*, tau / t(K*)); (0, tau0 / t(0)) when there is no first draft.
    """
    ranked = sorted((a for a in first_survivals if a > 0.0), reverse=True)
    if max_drafts is not None:
        ranked = ranked[:max(max_drafts, 0)]
    best_k, best = 0, base_committed / step_seconds(0)
    committed = base_committed
    first = True
    for k, probability in enumerate(ranked, start=1):
        committed += probability
        theta = committed / step_seconds(k)
        if first or theta > best:   # K >= 1 always has an entry, even below the plain step
            best_k, best, first = k, theta, False
    return best_k, best


def capacity(confidences: Sequence[Sequence[float]], step_seconds: Callable[[int], float], *,
             base_committed: float | None = None, max_drafts: int | None = None,
             min_gain: float = 0.0) -> int:
    """DSpark §5.2's capacity: the draft count K that maximises tau / t(K) over the K surest
    candidates of `confidences`, an unconstrained search (0 when no K beats the plain step by
    the fraction `min_gain`). Lossless only for confidences this step's drafts cannot have set
    (an earlier step's)."""
    committed = float(len(confidences) if base_committed is None else base_committed)
    ranked = sorted((a for c in confidences for a in survival(c) if a > 0.0), reverse=True)
    if max_drafts is not None:
        ranked = ranked[:max(max_drafts, 0)]
    best_k, best = 0, (1.0 + min_gain) * committed / step_seconds(0)
    for k, probability in enumerate(ranked, start=1):
        committed += probability
        theta = committed / step_seconds(k)
        if theta > best:
            best_k, best = k, theta
    return best_k


def admit_varlen(confidences: Sequence[Sequence[float]], step_seconds: Callable[[int], float],
                 *, base_committed: float | None = None, max_drafts: int | None = None,
                 min_drafts: int = 0, min_gain: float = 0.0,
                 ranked: list[tuple[float, int, int]] | None = None,
                 context_confidences: bool = False) -> list[int]:
    """The gate, then Algorithm 1's walk (module docstring): how many drafts each request
    verifies.

    Args:
        confidences: per decode request, c_{r,1..k_r} (k_r may differ; empty: no drafts).
        step_seconds: t(D), seconds of the step verifying D drafts; t(0) the plain step.
        base_committed: tau0, expected tokens committed without drafts (default: one per
            request).
        max_drafts: the drafts the step's token budget leaves room for (None: no cap).
        min_drafts: a capacity decided beforehand from confidences this step's drafts cannot
            have set (`capacity` of the previous step's, DSpark §5.2): the candidates ranked
            first up to it are admitted whatever the gate says, then the walk goes on.
        min_gain: the gate opens only when the best entry's Theta beats the plain step's by
            this fraction (a margin for the error of the step-time estimates).
        ranked: `ranked_candidates(confidences)`, when the caller has it.
        context_confidences: no confidence depends on any draft (the drafter's
            `context_confidences`): where even sure first drafts could not open the gate,
            the entry is `capacity` over `confidences`.
    Returns:
        l_r per request, 0 <= l_r <= k_r: verify the first l_r drafts.
    """
    lengths = [0] * len(confidences)
    committed = float(len(confidences) if base_committed is None else base_committed)
    firsts = [min(max(c[0], 0.0), 1.0) if c else 0.0 for c in confidences]
    entry, entry_theta = best_entry(firsts, step_seconds, base_committed=committed,
                                    max_drafts=max_drafts)
    if entry == 0 or entry_theta <= (1.0 + min_gain) * committed / step_seconds(0):
        entry = 0
    if entry == 0 and context_confidences and not best_entry(
            [1.0] * sum(1 for f in firsts if f > 0.0), step_seconds, base_committed=committed,
            max_drafts=max_drafts)[1] > (1.0 + min_gain) * committed / step_seconds(0):
        # even sure first drafts could not open the gate: the entry is the capacity over
        # this step's confidences, which read no draft (module docstring)
        entry = capacity(confidences, step_seconds, base_committed=committed,
                         max_drafts=max_drafts, min_gain=min_gain)
    entry = max(entry, min_drafts)
    if entry == 0:
        return lengths
    current = 0.0   # Theta of the admitted candidates
    if ranked is None:
        ranked = ranked_candidates(confidences)
    limit = len(ranked) if max_drafts is None else min(len(ranked), max(max_drafts, 0))
    ahead = max(len(c) for c in confidences) - 1   # one request's drafts after its next
    for index, (probability, position, request) in enumerate(ranked[:limit]):
        theta = (committed + probability) / step_seconds(index + 1)
        if index >= entry and theta <= current and not pays_ahead(
                committed, probability, index, current, min(limit, index + 1 + ahead),
                step_seconds):
            break                       # the first non-improvement ends the search
        committed += probability
        current = theta
        lengths[request] = position + 1
    return lengths


def pays_ahead(committed: float, probability: float, index: int, current: float, last: int,
               step_seconds: Callable[[int], float]) -> bool:
    """Whether candidates index, index + 1, ... up to some count K <= last could raise Theta
    above `current`, each counted at `probability` (candidate index's survival, an upper bound
    for the candidates after it): the walk's look past a step of the cost curve (a CUDA graph's
    token bucket, a kernel's row tile; SmolLM2 on the 2-core CPU box at batch 1: 1 -> 2 drafts
    +5.2 ms, 2 -> 4 drafts +0.7 ms), which one candidate alone does not pay. It reads no
    candidate after `index`, so admission stays a function of surer candidates (Appendix A).
    The walk looks as far as one request's drafts reach (`last`): the optimistic count, further
    out (8 counts, then a geometric grid to the budget), crossed steps that the batch's later,
    much less likely candidates never paid (free chat at batch 16 on the CPU box: 0.92x of
    off with the far look, 0.99x with this one)."""
    return any((committed + (k - index) * probability) / step_seconds(k) > current
               for k in range(index + 2, last + 1))


def drafting_can_pay(num_requests: int, step_seconds: Callable[[int], float], *,
                     max_drafts: int, min_gain: float = 0.0) -> bool:
    """False when drafting cannot pay whatever the confidences: no count of sure drafts
    (a = 1), up to `max_drafts` (the requests' gamma drafts each, within the token budget),
    beats the plain step by the fraction `min_gain`. The step loop then skips the drafter
    altogether."""
    if num_requests == 0 or max_drafts <= 0:
        return False
    plain = (1.0 + min_gain) * num_requests / step_seconds(0)
    # (R + k) / t(k) is monotone between the kinks of a piecewise-linear t: a geometric grid
    # (1, 2, 3, 4, 6, 8, 12, ...) and the end stand in for them
    counts, k = {max_drafts}, 1
    while k < max_drafts:
        counts.update((k, k + k // 2))
        k *= 2
    return any((num_requests + k) / step_seconds(k) > plain
               for k in counts if k <= max_drafts)


def top_candidates(confidences: Sequence[Sequence[float]], num_drafts: int) -> list[int]:
    """The lengths that verify the `num_drafts` candidates ranked first (an exploration step's
    admission, DSpark §5.2's top-K: the rank of (r, j) reads only surer candidates)."""
    lengths = [0] * len(confidences)
    for _, position, request in ranked_candidates(confidences)[:max(num_drafts, 0)]:
        lengths[request] = position + 1
    return lengths


def admit_fixed(num_drafts: Sequence[int], num_speculative_tokens: int) -> list[int]:
    """Fixed-length verification: min(k_r, num_speculative_tokens) drafts for each request."""
    return [min(k, num_speculative_tokens) for k in num_drafts]


def expected_committed(confidences: Sequence[float], length: int) -> float:
    """1 + a_1 + ... + a_length: expected tokens one request commits verifying `length` drafts."""
    return 1.0 + sum(survival(confidences)[:length])
