"""`RealizedGain`: how far verify steps' measured throughput gain fell short of what varlen
admission predicted for them, per batch bucket; the gate's margin grows by that shortfall.

The admission (engine/spec/admission.py) prices a verify step with the step-rate table and the
drafter's confidences. Either can be wrong in a way the table's own re-measurement does not
undo: confidences that the shared counters carry from other traffic, a verify step that costs
more on the host than its key's window says (the step that drains the asynchronous pipeline,
the looks before it). On the H100 (2026-12-05, SmolLM2 bf16, free chat at batch 16 after a
pass of every workload) varlen verified 16-24 of ~130 steps and ran at 0.72-0.78x of
speculation off, each admitted step predicted to gain.

So each verify step is scored: predicted gain = Theta(verified) / Theta(plain) from the
admission's own prices and survival probabilities; realized gain = ((R + accepted) / measured
seconds) / (R / plain seconds now), R the step's decode rows. The shortfall of a batch bucket is
the median of log(predicted / realized) over its last `window` scored steps; once `min_steps`
were scored, the gate asks for `exp(max(shortfall, 0))` times its usual margin (never less than
the configured `spec_min_gain`). A median, not a mean: on a shared box steps stalled by another
process (the 2-core CPU box, a test suite beside the benchmark: a run of 21 s where the others
took 0.8-1.9) left a decayed mean at 1.71 for batch 1, and its gate shut for the rest of the
process. The margin is a function
of past steps only, so admission stays independent of the drafts it admits (DSpark Appendix A).
Exploration steps (engine/spec/manager.py, within their own budget) are scored too: they test
the same prices and confidences, and they are what scores a bucket whose gate the shortfall
closed, so that its gate reopens when the predictions hold again.

Pure module: no torch import.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from deepinfer.engine.spec.step_rate import batch_bucket, median


class RealizedGain:
    """Args:
        window: scored steps per batch bucket whose median is its shortfall.
        min_steps: scored steps of a bucket before its shortfall moves the gate.
    """

    def __init__(self, window: int = 5, min_steps: int = 3):
        if window < 1 or not 1 <= min_steps <= window:
            raise ValueError(f"window={window} must be >= 1 and min_steps={min_steps} in "
                             "[1, window]")
        self.window = window
        self.min_steps = min_steps
        self._logs: dict[int, deque[float]] = {}   # bucket -> last `window` log(pred / real)
        self._steps: Counter[int] = Counter()     # bucket -> steps scored

    def observe(self, base_tokens: int, predicted: float, realized: float) -> None:
        """One verify step of `base_tokens` (B0) tokens: its predicted and its realized
        throughput gain over the plain step (both > 0; others are ignored)."""
        if predicted <= 0.0 or realized <= 0.0:
            return
        bucket = batch_bucket(base_tokens)
        self._logs.setdefault(bucket, deque(maxlen=self.window)).append(
            math.log(predicted / realized))
        self._steps[bucket] += 1

    def shortfall(self, base_tokens: int) -> float:
        """The median log(predicted / realized) of B0's bucket's last `window` scored steps
        (0.0 before `min_steps`)."""
        logs = self._logs.get(batch_bucket(base_tokens), ())
        return median(logs) if len(logs) >= self.min_steps else 0.0

    def min_gain(self, base_tokens: int, configured: float) -> float:
        """The gate's margin for B0's batch: (1 + configured) * exp(max(shortfall, 0)) - 1."""
        return (1.0 + configured) * math.exp(max(self.shortfall(base_tokens), 0.0)) - 1.0

    def as_dict(self) -> dict[int, dict[str, float]]:
        """{batch bucket: {"shortfall": median log(predicted / realized), "steps": n}}."""
        return {bucket: {"shortfall": round(median(logs), 4), "steps": self._steps[bucket]}
                for bucket, logs in sorted(self._logs.items())}
