"""Faults injected inside an engine step, for the fault isolation tests (tests/engine/
test_step_faults.py, tests/server/test_server_step_faults.py)."""

POISON = 4242   # a prompt holding this token id fails the forward pass


class PoisonedForward:
    """Wraps a model's forward: raises when the flattened batch holds `POISON` or computes
    position `fail_position` (the step cannot tell which request it came from), or on every
    call while `always` is set."""

    def __init__(self, model, fail_position: int | None = None):
        self.forward, self.fail_position = model.forward, fail_position
        self.always, self.calls = False, 0

    def __call__(self, input_ids, positions, *args, **kwargs):
        self.calls += 1
        at_position = (self.fail_position is not None
                       and bool((positions == self.fail_position).any()))
        if self.always or at_position or bool((input_ids == POISON).any()):
            raise RuntimeError("injected fault in the forward pass")
        return self.forward(input_ids, positions, *args, **kwargs)
