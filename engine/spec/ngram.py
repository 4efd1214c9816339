"""N-gram (prompt lookup) drafter with counter-calibrated confidences.

Drafts: the longest suffix of the request's tokens (prompt + output) of n in [min_n, max_n]
tokens that also occurs earlier in them; the tokens that followed its most recent earlier
occurrence are the drafts (up to gamma). This is vLLM's n-gram proposer's rule (longest match
first, `vllm/v1/spec_decode/ngram_proposer.py`), written here in plain Python; it pays off on
input-grounded generation (repeat, fix or rewrite a given text or code).

Confidence (DSpark's c_j, engine/spec/drafter.py): online Beta-Bernoulli counters of the
conditional acceptance at draft position j, bucketed by (match length, greedy or sampled, how the
request's previous verification went: none yet, all verified drafts accepted, or one rejected).
A bucket's prior is the pooled posterior of its (greedy, outcome, position) over all match lengths
with `prior_strength` pseudo-trials; a pooled position's prior is in turn the pooled posterior of
the position before it (copying text, a draft that followed accepted drafts is about as likely
as they were; a fixed 1/2 there kept varlen from ever verifying a 4th draft, so it never learnt
that on grounded prompts those pass 68 % of the time), and only position 0 starts from `prior`
(mean 1/2, so that the first drafts of a fresh engine get verified and measured). A match length never seen
yet thus borrows what the others showed (on free chat, soon ~0.1) instead of the over-confident
1/2 a fresh counter of its own would say, and its own counts take over as they accumulate. The
posterior mean is calibrated on the served traffic by construction. The key is fixed before any
draft is read (match length and past outcomes are properties of the context), so c_j never
depends on draft j. Each request then reads those confidences scaled by its own acceptance so
far against what they predicted for it (`RequestCalibration`): the counters are shared by
all the traffic, and chat after grounded prompts would read the grounded prompts' rates.

Pure module: no torch import.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from deepinfer.engine.spec.drafter import (BetaCounter, DraftProposal, DraftRequest,
                                           RequestCalibration, observed_positions)


def longest_suffix_match(token_ids: Sequence[int], min_n: int, max_n: int,
                         occurrences: Sequence[int] | None = None) -> tuple[int, int]:
    """(match length n, start of the continuation) of the longest suffix of `token_ids` with
    min_n <= n <= max_n that also ends at an earlier position e (tokens[e-n+1..e] ==
    tokens[-n:]); among equally long matches the most recent. (0, -1) when none.

    occurrences: the positions e < len - 1 holding the last token, ascending (`TokenIndex`);
        None scans the tokens for them.
    Cost: O(occurrences * max_n) with `occurrences`, else O(L) more for the scan.
    """
    length = len(token_ids)
    if length < 2:
        return 0, -1
    last = token_ids[-1]
    if occurrences is None:
        occurrences = [e for e in range(length - 1) if token_ids[e] == last]
    best_n, best_start = 0, -1
    for end in reversed(occurrences):           # most recent first
        n = 1
        while n < max_n and end - n >= 0 and token_ids[end - n] == token_ids[length - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_start = n, end + 1
            if n == max_n:
                break
    if best_n < min_n:
        return 0, -1
    return best_n, best_start


class TokenIndex:
    """Where each token occurs in one request's tokens (all but the newest: a match must leave
    a continuation), kept up to date as the tokens grow, so a proposal costs the last token's
    occurrences instead of a scan of the context (16 rows of ~300 tokens on the CPU box, under
    cProfile: the scan took 0.23 ms of a 2.7 ms verify step). Tokens only grow while a request
    runs; a list that shrank or changed under it is indexed again."""

    __slots__ = ("positions", "indexed", "last_indexed")

    def __init__(self) -> None:
        self.positions: dict[int, array] = {}   # int32 arrays: 4 bytes a position
        self.indexed = 0          # tokens[:indexed] are in `positions`
        self.last_indexed = -1    # tokens[indexed - 1], to notice a list that changed

    def occurrences(self, token_ids: Sequence[int]) -> Sequence[int]:
        """Ascending positions e < len(token_ids) - 1 where token_ids[e] == token_ids[-1]."""
        stop = len(token_ids) - 1
        if stop < self.indexed or (self.indexed and
                                   token_ids[self.indexed - 1] != self.last_indexed):
            self.positions.clear()
            self.indexed = 0
        positions = self.positions
        for position in range(self.indexed, stop):
            token = token_ids[position]
            found = positions.get(token)
            if found is None:
                positions[token] = array("i", (position,))
            else:
                found.append(position)
        if stop > self.indexed:
            self.indexed, self.last_indexed = stop, token_ids[stop - 1]
        return positions.get(token_ids[-1], ()) if stop >= 0 else ()


class NgramDrafter:
    """Args:
        num_speculative_tokens: gamma, the most drafts per request.
        min_n, max_n: shortest and longest suffix matched (vLLM's prompt_lookup_min / _max).
        prior: Beta prior (accepted, rejected) of the pooled counters (over match lengths).
        prior_strength: pseudo-trials of the pooled mean in a match length's own counter.
        request_strength: pseudo-positions of a request's factor-1 prior
            (`RequestCalibration`).
    """

    # a request's previous verification: none yet, every verified draft accepted, one rejected
    NEW, HIT, MISS = 0, 1, 2
    # confidences keyed by match length, position and past outcomes: none reads a draft
    context_confidences = True

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4,
                 prior: tuple[float, float] = (1.0, 1.0), prior_strength: float = 2.0,
                 request_strength: float = 1.0):
        self.gamma = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self.prior = prior
        self.prior_strength = prior_strength
        self._counters: dict[tuple, BetaCounter] = {}
        self._pooled: dict[tuple[bool, int, int], BetaCounter] = {}
        # request id -> its last proposal: (bucket, drafts, tokens known when proposed)
        self._last: dict[str, tuple[tuple[int, bool, int], list[int], int]] = {}
        self._outcome: dict[str, int] = {}                       # request id -> NEW / HIT / MISS
        self._index: dict[str, TokenIndex] = {}                  # request id -> its tokens' index
        self.calibration = RequestCalibration(request_strength)

    def pooled(self, greedy: bool, outcome: int, position: int) -> BetaCounter:
        """The counter of draft `position` (0-based) over every match length."""
        key = (greedy, outcome, position)
        if key not in self._pooled:
            self._pooled[key] = BetaCounter(*self.prior)
        return self._pooled[key]

    def counter(self, match_len: int, greedy: bool, position: int,
                outcome: int = NEW) -> BetaCounter:
        """The counter of draft `position` (0-based) after a match of `match_len` tokens."""
        key = (match_len, greedy, outcome, position)
        if key not in self._counters:
            self._counters[key] = BetaCounter(0.0, 0.0)
        return self._counters[key]

    def pooled_means(self, greedy: bool, outcome: int, count: int) -> list[float]:
        """Pooled posterior means of positions 0..count-1: each its counts, with the pooled
        mean of the position before as prior (`prior_strength` pseudo-trials; position 0:
        `prior`)."""
        means, mean = [], 0.0
        for j in range(count):
            counts = self.pooled(greedy, outcome, j)
            mean = (counts.mean if j == 0 else (counts.accepted + self.prior_strength * mean)
                    / (counts.trials + self.prior_strength))
            means.append(mean)
        return means

    def confidences(self, match_len: int, greedy: bool, outcome: int,
                    count: int) -> list[float]:
        """Drafts 0..count-1's confidences after a match of `match_len` tokens: each the
        posterior mean of its bucket, its prior the pooled mean with `prior_strength`."""
        strength, values = self.prior_strength, []
        for j, pooled in enumerate(self.pooled_means(greedy, outcome, count)):
            own = self.counter(match_len, greedy, j, outcome)
            values.append((own.accepted + strength * pooled) / (own.trials + strength))
        return values

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, DraftProposal]:
        proposals = {}
        buckets: dict[tuple[int, bool, int], list[float]] = {}   # this call's confidences
        for request in requests:
            limit = min(self.gamma, request.max_drafts)
            if limit <= 0:
                continue
            index = self._index.get(request.request_id)
            if index is None:
                index = self._index[request.request_id] = TokenIndex()
            tokens = request.token_ids
            self._score_unverified(request.request_id, tokens)
            match_len, start = longest_suffix_match(tokens, self.min_n, self.max_n,
                                                    index.occurrences(tokens))
            if match_len == 0:
                continue
            drafts = list(tokens[start:start + limit])
            if not drafts:
                continue
            outcome = self._outcome.get(request.request_id, self.NEW)
            key = (match_len, request.greedy, outcome)
            self._last[request.request_id] = (key, drafts, len(tokens))
            values = buckets.get(key)
            if values is None:
                values = buckets[key] = self.confidences(*key, self.gamma)
            proposals[request.request_id] = DraftProposal(drafts, self.calibration.scaled(
                request.request_id, values[:len(drafts)]))
        return proposals

    def observe(self, request_id: str, num_verified: int, num_accepted: int) -> None:
        """A verification's outcome; a proposal not verified (num_verified 0) stays pending
        and is scored against the tokens the request then decodes (`_score_unverified`)."""
        if num_verified == 0:
            return
        last = self._last.pop(request_id, None)
        if last is not None:
            self._record(request_id, last[0], num_verified, num_accepted)

    def _record(self, request_id: str, key: tuple[int, bool, int], num_verified: int,
                num_accepted: int) -> None:
        self.calibration.observe(request_id, num_verified, num_accepted)
        match_len, greedy, outcome = key
        for position, accepted in observed_positions(num_verified, num_accepted):
            self.counter(match_len, greedy, position, outcome).add(accepted)
            self.pooled(greedy, outcome, position).add(accepted)
        self._outcome[request_id] = self.HIT if num_accepted == num_verified else self.MISS

    def _score_unverified(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request's last proposal, if it was never verified, scored against the tokens
        decoded since (as many positions as arrived, up to its drafts): draft j counts as
        accepted iff it and the drafts before it equal the tokens decoded there. That is what
        verification would have said for greedy and seeded requests, and for unseeded ones an
        outcome of the same probability (a draft passes the rejection test with the target's
        probability of it, the probability a plain step samples it). So a proposal that a
        look or a peek made and the admission did not verify still teaches the counters and
        the request's calibration, at no device cost: a grounded request whose shared
        counters were lowered by chat shows what its drafts are worth without being verified
        first."""
        last = self._last.pop(request_id, None)
        if last is None:
            return
        key, drafts, known = last
        judged = min(len(drafts), len(token_ids) - known)
        if judged <= 0:
            return
        accepted = 0
        while accepted < judged and token_ids[known + accepted] == drafts[accepted]:
            accepted += 1
        self._record(request_id, key, judged, accepted)

    def forget(self, request_id: str) -> None:
        self.calibration.forget(request_id)
        self._last.pop(request_id, None)
        self._outcome.pop(request_id, None)
        self._index.pop(request_id, None)
