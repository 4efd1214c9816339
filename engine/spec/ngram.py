"""N-gram (prompt lookup) drafter with counter-calibrated confidences.

Drafts: the longest suffix of the request's tokens (prompt + output) of n in [min_n, max_n]
tokens that also occurs earlier in them; the tokens that followed its most recent earlier
occurrence are the drafts (up to gamma). This is vLLM's n-gram proposer's rule (longest match
first, `vllm/v1/spec_decode/ngram_proposer.py`), written here in plain Python; it pays off on
input-grounded generation (repeat, fix or rewrite a given text or code).

Confidence (DSpark's c_j, engine/spec/drafter.py): online Beta-Bernoulli counters of the
conditional acceptance at draft position j, bucketed by (match length, greedy or sampled). The
posterior mean is calibrated on the served traffic by construction. The key is fixed before any
draft is read (the match length is a property of the context), so c_j never depends on draft j.

Pure module: no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.engine.spec.drafter import (BetaCounter, DraftProposal, DraftRequest,
                                           observed_positions)


def longest_suffix_match(token_ids: Sequence[int], min_n: int, max_n: int) -> tuple[int, int]:
    """(match length n, start of the continuation) of the longest suffix of `token_ids` with
    min_n <= n <= max_n that also ends at an earlier position e (tokens[e-n+1..e] ==
    tokens[-n:]); among equally long matches the most recent. (0, -1) when none.

    Cost: one pass over the occurrences of the last token, each extended by at most max_n
    comparisons: O(L + occurrences * max_n) per call.
    """
    length = len(token_ids)
    if length < 2:
        return 0, -1
    last = token_ids[-1]
    best_n, best_start = 0, -1
    for end in range(length - 2, -1, -1):       # most recent first
        if token_ids[end] != last:
            continue
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


class NgramDrafter:
    """Args:
        num_speculative_tokens: gamma, the most drafts per request.
        min_n, max_n: shortest and longest suffix matched (vLLM's prompt_lookup_min / _max).
        prior: Beta prior (accepted, rejected) of every counter before it has observations.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4,
                 prior: tuple[float, float] = (1.0, 1.0)):
        self.gamma = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self.prior = prior
        self._counters: dict[tuple[int, bool, int], BetaCounter] = {}
        self._last_key: dict[str, tuple[int, bool]] = {}   # request id -> bucket of its drafts

    def counter(self, match_len: int, greedy: bool, position: int) -> BetaCounter:
        """The counter of draft `position` (0-based) after a match of `match_len` tokens."""
        key = (match_len, greedy, position)
        if key not in self._counters:
            self._counters[key] = BetaCounter(*self.prior)
        return self._counters[key]

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, DraftProposal]:
        proposals = {}
        for request in requests:
            limit = min(self.gamma, request.max_drafts)
            if limit <= 0:
                continue
            match_len, start = longest_suffix_match(request.token_ids, self.min_n, self.max_n)
            if match_len == 0:
                continue
            drafts = list(request.token_ids[start:start + limit])
            if not drafts:
                continue
            self._last_key[request.request_id] = (match_len, request.greedy)
            proposals[request.request_id] = DraftProposal(drafts, [
                self.counter(match_len, request.greedy, j).mean for j in range(len(drafts))])
        return proposals

    def observe(self, request_id: str, num_verified: int, num_accepted: int) -> None:
        key = self._last_key.pop(request_id, None)
        if key is None:
            return
        for position, accepted in observed_positions(num_verified, num_accepted):
            self.counter(*key, position).add(accepted)

    def forget(self, request_id: str) -> None:
        self._last_key.pop(request_id, None)
