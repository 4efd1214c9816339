"""Fault isolation: one request that makes a step fail must not kill the engine.

A step that raises (building its inputs, the forward pass, sampling) cannot always be pinned on
one request. `EngineCore` undoes it (nothing of it was applied) and hands its requests here as
suspects; the scheduler then runs the first suspect alone (`Scheduler.isolated_request_id`)
until it has computed, alone, as far as the failed step was to take it (cleared) or a step fails
with it alone (the culprit: finished with an error, its blocks freed). A step of one request
that fails names its culprit at once.

Failures that are no request's fault (the device is gone) fail every step: after
`max_failed_steps_in_a_row` failed steps with no successful one between them the engine stops
(`EngineDeadError`), loudly, instead of erroring requests one by one forever.

Pure module: no torch import. Only the step loop calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Container

from deepinfer.engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS_IN_A_ROW = 4


class FaultIsolation:
    """Suspects of failed steps, run one at a time (see the module doc).

    Args:
        max_failed_steps_in_a_row: failed steps with no successful one between them after
            which the engine gives up (>= 2: one failed batch, then a suspect alone).
    """

    def __init__(self, max_failed_steps_in_a_row: int = MAX_FAILED_STEPS_IN_A_ROW):
        if max_failed_steps_in_a_row < 2:
            raise ValueError(f"max_failed_steps_in_a_row={max_failed_steps_in_a_row} must be "
                             ">= 2 (a failed batch, then one suspect alone).")
        self.max_failed_steps_in_a_row = max_failed_steps_in_a_row
        # request id -> computed tokens the failed step was to reach; first = the one alone
        self.suspects: dict[str, int] = {}
        self.failed_steps_in_a_row = 0
        self.num_failed_steps = 0       # counters, for logs and tests
        self.num_failed_requests = 0

    @property
    def isolating(self) -> bool:
        return bool(self.suspects)

    def current(self, unfinished: Container[str]) -> str | None:
        """The suspect to run alone next (suspects finished meanwhile are dropped), or None."""
        for request_id in [r for r in self.suspects if r not in unfinished]:
            del self.suspects[request_id]
        return next(iter(self.suspects), None)

    def skip_current(self) -> None:
        """The current suspect could not be scheduled alone (no KV blocks while the others
        hold theirs): it goes back among the others; if it fails there again it is a suspect
        again, and the failed-steps bound still holds."""
        request_id = next(iter(self.suspects), None)
        if request_id is not None:
            del self.suspects[request_id]

    def step_succeeded(self, num_computed_tokens: dict[str, int]) -> None:
        """A step's results arrived (request id -> its computed tokens after the step): the
        failure streak ends; a suspect that got as far as its failed step is cleared."""
        if not num_computed_tokens:
            return
        self.failed_steps_in_a_row = 0
        for request_id, num_tokens in num_computed_tokens.items():
            if self.suspects.get(request_id, num_tokens + 1) <= num_tokens:
                del self.suspects[request_id]

    def step_failed(self, num_computed_tokens: dict[str, int], error: Exception) -> str | None:
        """A step (already undone) of these requests (id -> the computed tokens it was to
        reach) raised `error`. Returns the request to finish with an error when it ran alone,
        else None (they all become suspects).

        Raises:
            EngineDeadError: `max_failed_steps_in_a_row` steps failed in a row.
        """
        self.failed_steps_in_a_row += 1
        self.num_failed_steps += 1
        request_ids = list(num_computed_tokens)
        logger.error("an engine step of %d request(s) failed (%d in a row)", len(request_ids),
                     self.failed_steps_in_a_row, exc_info=error)
        if self.failed_steps_in_a_row >= self.max_failed_steps_in_a_row:
            raise EngineDeadError(
                f"{self.failed_steps_in_a_row} engine steps failed in a row, also with single "
                f"requests (last: {type(error).__name__}: {str(error)[:200]}); the device or "
                "the model is broken, not one request. Restart the server; the log has the "
                "tracebacks.") from error
        if len(request_ids) == 1:
            culprit = request_ids[0]
            self.suspects.pop(culprit, None)
            self.num_failed_requests += 1
            return culprit
        for request_id, num_tokens in num_computed_tokens.items():
            self.suspects[request_id] = max(self.suspects.get(request_id, 0), num_tokens)
        return None
