"""The drafter interface of speculative decoding (DSpark's contract, see engine/spec/__init__.py).

A drafter proposes, for each running request that decodes next step, up to gamma draft token ids
and one confidence per draft: c_j = P(draft j is accepted | drafts 1..j-1 were accepted). c_j may
depend on the context and on drafts before j, never on draft j itself; that is what lets the
admission (engine/spec/admission.py) cut a request's drafts by confidence without biasing what
it commits (DSpark paper, Appendix A). After each verify step the drafter is told how many of
the drafts it proposed were verified and accepted, so it can calibrate its confidences online.

Pure module: no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class DraftRequest:
    """What a drafter sees of one request that decodes in the next step.

    request_id: the engine's id.
    token_ids: prompt + output tokens so far (read only; the drafter must not keep it).
    num_prompt_tokens: how many of them are the prompt.
    max_drafts: the most drafts the request can use (gamma, capped by its token limit).
    greedy: temperature 0 (acceptance statistics differ between greedy and sampled requests).
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_drafts: int
    greedy: bool = True


@dataclass
class DraftProposal:
    """token_ids[j] is draft j + 1; confidences[j] its conditional acceptance probability in
    [0, 1] (same length). Empty lists: no draft for this request."""

    token_ids: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)


class Drafter(Protocol):
    """One drafter per engine; only the step loop calls it.

    context_confidences: True when every confidence is a function of the context alone (of no
        draft, not even earlier ones): the admission may then search over a step's
        confidences freely (engine/spec/admission.py). Drafters without the attribute are
        taken as False.
    """

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, DraftProposal]:
        """Drafts for each request (requests without a draft may be left out)."""
        ...

    def observe(self, request_id: str, num_verified: int, num_accepted: int) -> None:
        """The request's last proposal: its first `num_verified` drafts were verified and the
        first `num_accepted` of those accepted (0 <= num_accepted <= num_verified)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop what is kept for it."""
        ...


class BetaCounter:
    """Online posterior of a Bernoulli rate with a Beta(prior_accepted, prior_rejected) prior.

    `mean` is the posterior mean (accepted + a) / (trials + a + b): a calibrated estimate of
    the rate as soon as observations accumulate, the prior's mean before any."""

    __slots__ = ("accepted", "trials", "prior_accepted", "prior_rejected")

    def __init__(self, prior_accepted: float = 1.0, prior_rejected: float = 1.0):
        self.accepted = 0
        self.trials = 0
        self.prior_accepted = prior_accepted
        self.prior_rejected = prior_rejected

    def add(self, accepted: bool) -> None:
        self.trials += 1
        self.accepted += int(accepted)

    @property
    def mean(self) -> float:
        return ((self.accepted + self.prior_accepted)
                / (self.trials + self.prior_accepted + self.prior_rejected))


def observed_positions(num_verified: int, num_accepted: int) -> list[tuple[int, bool]]:
    """(0-based position, accepted) of each draft whose conditional acceptance was observed:
    positions 0..m-1 accepted, position m rejected when m < verified, later ones unobserved
    (their condition, all earlier drafts accepted, did not hold)."""
    observed = [(j, True) for j in range(num_accepted)]
    if num_accepted < num_verified:
        observed.append((num_accepted, False))
    return observed


class RequestCalibration:
    """Each request's own acceptance against what the shared confidences said of it: a
    multiplicative correction `factor` = (A + s) / (E + s), where A counts the request's
    accepted drafts and E sums the shared confidences of the same observed positions (the
    acceptances they predicted), s = `strength` pseudo-positions at factor 1. Shared counters
    pool every request (calibrated over the traffic, not per request): after grounded prompts
    they hold ~0.87 at the first draft, and free chat, whose drafts pass ~0.3 of the time,
    read that until its own misses outweighed hundreds of grounded trials. A request whose
    drafts keep failing reads its confidences scaled down after a few outcomes (verifications,
    or for the n-gram drafter proposals scored against the tokens decoded after them); one
    whose drafts pass more often than predicted reads them scaled up (at most `ceiling`). The
    factor depends on past outcomes only, never on the drafts it scales (DSpark Appendix A).

    Args:
        strength: pseudo-positions of the factor-1 prior (> 0); default 1: one rejected
            first draft predicted at 0.86 (grounded counters, read by chat) reads the next
            ones at 0.54x (2 pseudo-positions: 0.70x, and chat at batch 16 on the H100 kept
            verifying at 0.71x of speculation off).
        ceiling: the largest confidence a scaled one reads (< 1)."""

    __slots__ = ("strength", "ceiling", "_evidence", "_proposed")

    def __init__(self, strength: float = 1.0, ceiling: float = 0.99):
        if strength <= 0.0 or not 0.0 < ceiling < 1.0:
            raise ValueError(f"strength={strength} must be > 0 and ceiling={ceiling} in (0, 1)")
        self.strength, self.ceiling = strength, ceiling
        self._evidence: dict[str, list[float]] = {}   # request id -> [accepted A, predicted E]
        self._proposed: dict[str, list[float]] = {}   # request id -> its last shared values

    def factor(self, request_id: str) -> float:
        evidence = self._evidence.get(request_id)
        if evidence is None:
            return 1.0
        return (evidence[0] + self.strength) / (evidence[1] + self.strength)

    def scaled(self, request_id: str, shared: list[float]) -> list[float]:
        """The request's confidences: the shared ones (remembered for `observe`) times its
        factor, capped at `ceiling` (never below the shared one when that is higher)."""
        self._proposed[request_id] = shared
        factor = self.factor(request_id)
        if factor == 1.0:
            return shared
        if factor < 1.0:
            return [c * factor for c in shared]
        return [max(min(c * factor, self.ceiling), c) for c in shared]

    def observe(self, request_id: str, num_verified: int, num_accepted: int) -> None:
        """Its last proposal's outcome (`Drafter.observe`'s arguments; num_verified 0: kept
        for a later outcome, as `scaled` replaces it at the next proposal)."""
        if num_verified == 0:
            return
        shared = self._proposed.pop(request_id, None)
        if shared is None:
            return
        evidence = self._evidence.setdefault(request_id, [0.0, 0.0])
        for position, accepted in observed_positions(num_verified, num_accepted):
            evidence[0] += accepted
            evidence[1] += shared[position]

    def forget(self, request_id: str) -> None:
        self._evidence.pop(request_id, None)
        self._proposed.pop(request_id, None)

