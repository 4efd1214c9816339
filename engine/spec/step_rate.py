"""SPS(B): steps per second of plain and verify steps, by the step's batch tokens B.

DSpark's scheduler (engine/spec/admission.py) compares the step without drafts (plain: every
row one token, plus the step's prefill chunks) with the step that verifies k more draft tokens.
The two are different kernel paths, not one curve: the first draft row costs a jump (SmolLM2 on
the 2-core CPU box: 16 decode rows 51 ms, the same with one draft 58 ms), so the table keeps one
curve per kind of step.

Each curve starts from the start-up profile (engine/spec/profile.py) and is re-measured online
from the engine's own step times (`observe`, B counting the step's prefill tokens): per B the
median of the last `window` step times (robust to the odd step slowed by another process), the
start-up value counting as one observation until `window` real ones replaced it (a profile taken
while another process held the cores is gone after two steps at that B). Reads fit the medians
with a weighted non-decreasing least-squares fit (a bigger batch is not faster: what says
otherwise is timing noise), interpolate linearly between measured B (flat before the first,
along the last segment's slope after the last), and never let a verify step cost less than the
plain step of the same B. Real curves are step-shaped (CUDA-graph buckets, tile sizes): measured
points keep their own B, so the steps stay.

Load. On a shared machine every step slows down together when another process takes the cores,
but a B that is rarely run (the verify step, while nothing pays) keeps the times of the last
time it ran: the curves would compare times of different loads. So they hold times divided by a
load factor, the geometric moving average (weight `load_smoothing`; 1/2 prices a doubled load in
within a few steps, while the windows of measured B move only after half their size) of observed
/ predicted over the steps at a B whose window holds only this engine's steps (a start-up value,
say a verify point profiled during a burst of load, a probe's first measurements or an
interpolated B could be off by far more than the load: those steps only fill their window);
reads multiply it back. The admission
compares step times with each other, so the factor cancels there; what it buys is that a plain
curve re-measured under today's load and a verify point measured under yesterday's stay
comparable.

Pure module: no torch import.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Mapping


def nondecreasing(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The weighted least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    weights = weights or [1.0] * len(values)
    blocks: list[list[float]] = []   # [weighted sum, weight, count] per pooled block
    for value, weight in zip(values, weights):
        blocks.append([value * weight, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight_sum, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight_sum
            blocks[-1][2] += count
    return [total / weight for total, weight, count in blocks for _ in range(int(count))]


class _Curve:
    """Step seconds by batch tokens: a window of recent times per B, fitted on read."""

    def __init__(self, step_seconds: Mapping[int, float], window: int):
        self.window = window
        self._times: dict[int, deque[float]] = {
            int(b): deque([float(s)], maxlen=window) for b, s in step_seconds.items()}
        self._measured: dict[int, int] = {}   # B -> steps observed there (not start-up values)
        self._fitted: tuple[list[int], list[float]] | None = None

    def __bool__(self) -> bool:
        return bool(self._times)

    def __contains__(self, num_tokens: int) -> bool:
        return num_tokens in self._times

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._times.setdefault(num_tokens, deque(maxlen=self.window)).append(seconds)
        self._measured[num_tokens] = self._measured.get(num_tokens, 0) + 1
        self._fitted = None

    def measured(self, num_tokens: int) -> int:
        return self._measured.get(num_tokens, 0)

    def fitted(self) -> tuple[list[int], list[float]]:
        if self._fitted is None:
            keys = sorted(self._times)
            medians = [statistics.median(self._times[b]) for b in keys]
            weights = [float(len(self._times[b])) for b in keys]
            self._fitted = keys, nondecreasing(medians, weights)
        return self._fitted

    def seconds(self, num_tokens: int) -> float:
        keys, values = self.fitted()
        index = bisect.bisect_left(keys, num_tokens)
        if index < len(keys) and keys[index] == num_tokens:
            return values[index]
        if index == 0 or len(keys) == 1:
            return values[0] if index == 0 else values[-1]
        if index == len(keys):
            slope = max((values[-1] - values[-2]) / (keys[-1] - keys[-2]), 0.0)
            return values[-1] + slope * (num_tokens - keys[-1])
        low, high = keys[index - 1], keys[index]
        weight = (num_tokens - low) / (high - low)
        return values[index - 1] * (1.0 - weight) + values[index] * weight


class StepRateTable:
    """Args:
        step_seconds: batch tokens -> seconds of one verify step (at least one entry).
        plain_seconds: batch tokens -> seconds of one step without drafts (None or empty: plain
            steps cost what verify steps of the same B cost, until some are observed).
        window: recent step times kept per B and kind (0: never re-measure).
        load_smoothing: weight of one step in the load factor's moving average, in [0, 1]
            (0: no load factor).
    """

    def __init__(self, step_seconds: Mapping[int, float],
                 plain_seconds: Mapping[int, float] | None = None, window: int = 8,
                 load_smoothing: float = 0.5):
        if not step_seconds:
            raise ValueError("a step-rate table needs at least one measured token count")
        if window < 0:
            raise ValueError(f"window={window} must be >= 0 (0: never re-measure)")
        if not 0.0 <= load_smoothing <= 1.0:
            raise ValueError(f"load_smoothing={load_smoothing} must be in [0, 1]")
        self.window = window
        self.load_smoothing = load_smoothing
        self.load = 1.0     # observed / start-up-scale step times, moving geometric average
        self._verify = _Curve(step_seconds, max(window, 1))
        self._plain = _Curve(plain_seconds or {}, max(window, 1))

    @classmethod
    def from_steps_per_second(cls, sps: Mapping[int, float],
                              plain_sps: Mapping[int, float] | None = None, window: int = 0
                              ) -> "StepRateTable":
        """A table from {B: steps per second} (DSpark's JSON profile shape)."""
        return cls({b: 1.0 / rate for b, rate in sps.items()},
                   {b: 1.0 / rate for b, rate in (plain_sps or {}).items()}, window)

    def seconds(self, num_tokens: int, *, verify: bool = True) -> float:
        """Step time at `num_tokens` batch tokens, of a verify step (default) or a plain one, at
        the current load; a verify step never costs less than the plain step of the same B."""
        return self.load * self._unloaded(num_tokens, verify)

    def _unloaded(self, num_tokens: int, verify: bool) -> float:
        plain = self._plain.seconds(num_tokens) if self._plain else None
        if not verify and plain is not None:
            return plain
        verify_seconds = self._verify.seconds(num_tokens)
        return verify_seconds if plain is None else max(verify_seconds, plain)

    def __call__(self, num_tokens: int) -> float:
        """Verify steps per second at `num_tokens` batch tokens."""
        return 1.0 / max(self.seconds(num_tokens), 1e-9)

    def plain_rate(self, num_tokens: int) -> float:
        """Plain (draft-free) steps per second at `num_tokens` batch tokens."""
        return 1.0 / max(self.seconds(num_tokens, verify=False), 1e-9)

    def observe(self, num_tokens: int, seconds: float, *, verify: bool = True) -> None:
        """Re-measure: one executed step's time joins its B's window (a new point when it had
        none); `verify`: the step scored drafts."""
        if self.window <= 0 or num_tokens <= 0 or seconds <= 0.0:
            return
        curve = self._verify if verify else self._plain
        if curve.measured(num_tokens) >= self.window:   # only settled B move the load
            predicted = self._unloaded(int(num_tokens), verify)
            self.load *= (seconds / (self.load * predicted)) ** self.load_smoothing
        curve.observe(int(num_tokens), seconds / self.load)

    def measured(self, num_tokens: int, *, verify: bool = True) -> int:
        """How many executed steps of this kind were observed at exactly `num_tokens`."""
        return (self._verify if verify else self._plain).measured(num_tokens)

    def as_steps_per_second(self, *, verify: bool = True) -> dict[int, float]:
        """{B: steps per second} of the measured points (fitted), of one kind of step."""
        curve = self._verify if verify or not self._plain else self._plain
        keys, values = curve.fitted()
        return {b: 1.0 / max(self.seconds(b, verify=verify), 1e-9) for b in keys}
