"""`RealizedGain`: how far verify steps' measured throughput gain fell short of what varlen
admission predicted for them, per batch bucket; the gate's margin grows by that shortfall.

The admission (engine/spec/admission.py) prices a verify step with the step-rate table and the
drafter's confidences. Either can be wrong in a way the table's own re-measurement does not
undo: confidences that the shared counters carry from other traffic, a verify step that costs
more on the host than its key's window says (the step that drains the asynchronous pipeline,
the looks before it). On the H100 (2026-12-05, SmolLM2 bf16, free chat at batch 16 after a
pass of every workload) varlen verified 16-24 of ~130 steps and ran at 0.72-0.78x of
speculation off, each admitted step predicted to gain.

So each admitted verify step (not an exploration: those are priced by their own budget) is
scored: predicted gain = Theta(admitted) / Theta(plain) from the admission's own prices and
survival probabilities; realized gain = ((R + accepted) / measured seconds) / (R / plain
seconds now), R the step's decode rows. The shortfall of a batch bucket is the decayed mean of
log(predicted / realized) over its steps; once `min_steps` were scored, the gate asks for
`exp(max(shortfall, 0))` times its usual margin (never less than the configured
`spec_min_gain`). The margin is a function of past steps only, so admission stays independent
of the drafts it admits (DSpark Appendix A). A bucket whose gate closed is scored again only
when a prediction clears the raised margin; then a step that realizes its prediction lowers
the shortfall (grounded traffic after chat reopens the gate of its own batch bucket).

Pure module: no torch import.
"""

from __future__ import annotations

import math

from deepinfer.engine.spec.step_rate import batch_bucket


class RealizedGain:
    """Args:
        decay: weight kept by the past at each new scored step, in [0, 1).
        min_steps: scored steps of a bucket before its shortfall moves the gate.
    """

    def __init__(self, decay: float = 0.8, min_steps: int = 3):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} must be in [0, 1)")
        self.decay = decay
        self.min_steps = min_steps
        # batch bucket -> [decayed sum of log(predicted / realized), decayed weight, steps]
        self._buckets: dict[int, list[float]] = {}

    def observe(self, base_tokens: int, predicted: float, realized: float) -> None:
        """One admitted verify step of `base_tokens` (B0) tokens: its predicted and its
        realized throughput gain over the plain step (both > 0; others are ignored)."""
        if predicted <= 0.0 or realized <= 0.0:
            return
        entry = self._buckets.setdefault(batch_bucket(base_tokens), [0.0, 0.0, 0])
        entry[0] = self.decay * entry[0] + math.log(predicted / realized)
        entry[1] = self.decay * entry[1] + 1.0
        entry[2] += 1

    def shortfall(self, base_tokens: int) -> float:
        """The decayed mean log(predicted / realized) of B0's bucket (0.0 before `min_steps`
        scored steps)."""
        entry = self._buckets.get(batch_bucket(base_tokens))
        if entry is None or entry[2] < self.min_steps:
            return 0.0
        return entry[0] / entry[1]

    def min_gain(self, base_tokens: int, configured: float) -> float:
        """The gate's margin for B0's batch: (1 + configured) * exp(max(shortfall, 0)) - 1."""
        return (1.0 + configured) * math.exp(max(self.shortfall(base_tokens), 0.0)) - 1.0

    def as_dict(self) -> dict[int, dict[str, float]]:
        """{batch bucket: {"shortfall": mean log(predicted / realized), "steps": n}}."""
        return {bucket: {"shortfall": round(s / w, 4), "steps": int(n)}
                for bucket, (s, w, n) in sorted(self._buckets.items())}
