"""`RealizedGain`: how far verify steps' measured throughput gain fell short of what varlen
admission predicted for them, per batch bucket; the gate's margin grows by that shortfall.

The admission (engine/spec/admission.py) prices a verify step with the step-rate table and the
drafter's confidences. Either can be wrong in a way the table's own re-measurement does not
undo: confidences that the shared counters carry from other traffic, a verify step that costs
more on the host than its key's window says (the step that drains the asynchronous pipeline,
the looks before it). On the H100 (2026-12-05, SmolLM2 bf16, free chat at batch 16 after a
pass of every workload) varlen verified 16-24 of ~130 steps and ran at 0.72-0.78x of
speculation off, each admitted step predicted to gain.

So each verify step is scored, in two parts, since predicted gain / realized gain = (expected
committed tokens / committed tokens) x (measured relative cost / priced relative cost):
- tokens: the admission's expected committed tokens (R + the admitted survival probabilities, R
  the step's decode rows) against those committed (R + accepted);
- time: the step's measured seconds over the plain step's as measured now, against the
  table's t(D) / t(0).
The shortfall of a batch bucket over its last `window` scored steps is log(sum of expected /
sum of committed) plus the median of log(measured / priced relative cost); once `min_steps`
were scored, the gate asks for `exp(max(shortfall, 0))` times its usual margin (never less than
the configured `spec_min_gain`), at most `MAX_RAISE` times it: a bucket's first few verify
steps can fall short for reasons that pass (a process's first replays of its verify graphs),
and a margin no prediction clears stops the steps that would score it again (H100, grounded
prompts at batch 1: four warm-up steps read a shortfall of log 1.68, the margin rose to 77 %,
and the bucket verified nothing more in two processes: 0.98x of speculation off where it reads
2.5x; the H100's free chat at batch 16 above needed a raise of ~1.3x).
- Tokens are summed: a step's accepted count is one draw of what the confidences predict in
  expectation, and on grounded text that draw is bimodal (all drafts or nearly none); a median
  of per-step gain ratios then read calibrated confidences as a shortfall (60 % of steps
  committing 6 tokens and 40 % committing 2, against 4.4 expected: the median of 5 steps is
  log(4.4 / 2) = 0.79 one time in three, a margin of 2.2x; on the emulated H100,
  benchmarks/emulated_device.py, batch 1 ended a run at 0.80, and at 0.04 with sums).
  Committed tokens do not stall.
- Time is a median: on a shared box steps stalled by another process (the 2-core CPU box, a
  test suite beside the benchmark: a run of 21 s where the others took 0.8-1.9) left a
  decayed mean at 1.71 for batch 1, and its gate shut for the rest of the process.
The margin is a function of past steps only, so admission stays independent of the drafts it
admits (DSpark Appendix A). Exploration steps (engine/spec/manager.py, within their own budget)
are scored too: they test the same prices and confidences, and they are what scores a bucket
whose gate the shortfall closed, so that its gate reopens when the predictions hold again.

Pure module: no torch import.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from deepinfer.engine.spec.step_rate import batch_bucket, median

MAX_RAISE = 1.5   # the most the shortfall multiplies the gate's margin (1 + spec_min_gain) by


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
        # bucket -> its last `window` scored steps: (expected committed tokens, committed
        # tokens, log(measured / priced relative cost))
        self._steps_scored: dict[int, deque[tuple[float, int, float]]] = {}
        self._steps: Counter[int] = Counter()     # bucket -> steps scored
        # bucket -> its shortfall, as of its last scored step (the gate reads it every step)
        self._shortfalls: dict[int, float] = {}

    def observe(self, base_tokens: int, expected: float, committed: int,
                priced_cost: float, measured_cost: float) -> None:
        """One verify step of `base_tokens` (B0) tokens: the committed tokens the admission
        expected and those committed, the step's cost relative to the plain step as the table
        priced it (t(D) / t(0)) and as measured (seconds / plain seconds). Steps with a
        non-positive value are ignored."""
        if min(expected, committed, priced_cost, measured_cost) <= 0.0:
            return
        bucket = batch_bucket(base_tokens)
        steps = self._steps_scored.setdefault(bucket, deque(maxlen=self.window))
        steps.append((expected, committed, math.log(measured_cost / priced_cost)))
        self._steps[bucket] += 1
        self._shortfalls[bucket] = _shortfall(steps) if len(steps) >= self.min_steps else 0.0

    def shortfall(self, base_tokens: int) -> float:
        """log(expected / committed tokens, summed) + median log(measured / priced cost) of
        B0's bucket's last `window` scored steps (0.0 before `min_steps`)."""
        return self._shortfalls.get(batch_bucket(base_tokens), 0.0)

    def min_gain(self, base_tokens: int, configured: float) -> float:
        """The gate's margin for B0's batch: (1 + configured) * min(exp(max(shortfall, 0)),
        MAX_RAISE) - 1."""
        raise_ = min(math.exp(max(self.shortfall(base_tokens), 0.0)), MAX_RAISE)
        return (1.0 + configured) * raise_ - 1.0

    def as_dict(self) -> dict[int, dict[str, float]]:
        """{batch bucket: {"shortfall": its shortfall over the steps held, "steps": n}}."""
        return {bucket: {"shortfall": round(_shortfall(steps), 4), "steps": self._steps[bucket]}
                for bucket, steps in sorted(self._steps_scored.items())}


def _shortfall(steps) -> float:
    expected = sum(step[0] for step in steps)
    committed = sum(step[1] for step in steps)
    return math.log(expected / committed) + median([step[2] for step in steps])
