"""SPS(B): verify steps per second as a function of the step's batch tokens B.

DSpark's scheduler (engine/spec/admission.py) needs SPS at every B between the plain decode
batch and the batch with every draft. The table is profiled at start-up on the verify path at
a few token counts (`ModelRunner.time_verify_step`) and interpolated linearly in step time
between them (flat beyond the ends' slope); every executed step then re-measures its own B
(`observe`: exponential moving average of its step time), so the table follows the machine's
load. Measured points keep their own token counts: real curves are step-shaped (CUDA-graph
buckets, tile sizes), and profiling at every bucket edge keeps those steps.

Pure module: no torch import.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping


def nondecreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): a profile
    of step times by batch tokens with the timing noise that makes a bigger batch look faster
    averaged out."""
    blocks: list[list[float]] = []   # [sum, count] per pooled block
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


class StepRateTable:
    """Args:
        step_seconds: batch tokens -> seconds of one verify step (at least one entry).
        smoothing: weight of a new observation in the moving average (0: never re-measure).
    """

    def __init__(self, step_seconds: Mapping[int, float], smoothing: float = 0.1):
        if not step_seconds:
            raise ValueError("a step-rate table needs at least one measured token count")
        self.smoothing = smoothing
        self._seconds: dict[int, float] = {int(b): float(s) for b, s in step_seconds.items()}
        self._keys = sorted(self._seconds)

    @classmethod
    def from_steps_per_second(cls, sps: Mapping[int, float], smoothing: float = 0.0
                              ) -> "StepRateTable":
        """A table from {B: steps per second} (DSpark's JSON profile shape)."""
        return cls({b: 1.0 / rate for b, rate in sps.items()}, smoothing)

    def seconds(self, num_tokens: int) -> float:
        """Interpolated step time at `num_tokens` (linear between measured points; beyond the
        last, extended along the last segment's slope, never decreasing)."""
        keys, table = self._keys, self._seconds
        if num_tokens in table:
            return table[num_tokens]
        index = bisect.bisect_left(keys, num_tokens)
        if len(keys) == 1:
            return table[keys[0]]
        if index == 0:
            return table[keys[0]]
        if index == len(keys):
            low, high = keys[-2], keys[-1]
            slope = max((table[high] - table[low]) / (high - low), 0.0)
            return table[high] + slope * (num_tokens - high)
        low, high = keys[index - 1], keys[index]
        weight = (num_tokens - low) / (high - low)
        return table[low] * (1.0 - weight) + table[high] * weight

    def __call__(self, num_tokens: int) -> float:
        """Steps per second at `num_tokens` batch tokens."""
        return 1.0 / max(self.seconds(num_tokens), 1e-9)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Re-measure: fold one executed step's time into the entry of its token count (a new
        entry when it had none)."""
        if self.smoothing <= 0.0 or num_tokens <= 0 or seconds <= 0.0:
            return
        if num_tokens not in self._seconds:
            self._seconds[num_tokens] = self.seconds(num_tokens)
            bisect.insort(self._keys, num_tokens)
        old = self._seconds[num_tokens]
        self._seconds[num_tokens] = old + self.smoothing * (seconds - old)

    def as_steps_per_second(self) -> dict[int, float]:
        """{B: steps per second} of the measured points."""
        return {b: 1.0 / s for b, s in sorted(self._seconds.items())}
