"""A GPU's step timing emulated on the CPU, for work on the speculative decoder's policy
(engine/spec/) without device time: `bench_spec.py --emulate-device h100`.

The engine runs for real on the CPU (the model's tokens, the scheduler, the drafter, the
admission and every host cost as this machine pays it), with async scheduling on as on CUDA,
but the clock that the engine, the speculative decoder and the benchmark read is virtual:

- the real time of each `executor.execute` call (the CPU forward) is taken out of it, and the
  host's launch cost on the GPU (`DeviceModel.launch_s`) put in;
- each step then occupies an emulated device for `DeviceModel.device_s` seconds, after the
  step before it (one stream); a blocking step's caller waits for it (the clock jumps to its
  end), a non-blocking step's future does so when the core resolves it, so plain steps overlap
  the host exactly as far as the device's time covers it;
- the start-up profile of the verify path (engine/spec/profile.time_step) reads the model's
  blocking step: launch plus device time.

Everything else the host does (scheduling, drafting, admission, detokenizing) costs its real
time on this machine. The model of SmolLM2-135M in bf16 on one H100 (`H100_SMOLLM2`) is fitted
to bench_spec.py's own H100 runs. What it does not emulate: the GPU host's own speed (this
box's host work is taken as is), CUDA graph padding, and device-side variance.

Not part of the product: a test double for the device, installed into one process by
`install` (it replaces module attributes, as tests' monkeypatching does).
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceModel:
    """Seconds a step costs on the emulated device, by its token count.

    launch_base_s, launch_per_token_s: the host's input building and graph launch for a step.
    device_base_s, device_per_token_s: the device's time for a step (a chain of small kernels
        at these sizes: nearly flat in tokens).
    """
    launch_base_s: float
    launch_per_token_s: float
    device_base_s: float
    device_per_token_s: float
    verify_s: float = 0.0

    def launch_s(self, num_tokens: int) -> float:
        return self.launch_base_s + self.launch_per_token_s * num_tokens

    def device_s(self, num_tokens: int, num_drafts: int = 0) -> float:
        return (self.device_base_s + self.device_per_token_s * num_tokens
                + (self.verify_s if num_drafts else 0.0))


# fitted to bench_spec.py's own H100 runs (results/bench_spec-gpu-h100-2026-12-05-s49-128.json:
# off 1.25 ms a step on grounded b1 and 1.06 on chat b16, fixed length 2.34 and 2.78 ms a verify
# step) with this box's host work in them (the emulator at 0.92 ms + 2.9 us a token and no
# verify term read 0.98 / 0.98 and 1.41 / 1.93)
H100_SMOLLM2 = DeviceModel(launch_base_s=0.15e-3, launch_per_token_s=1e-6,
                           device_base_s=1.07e-3, device_per_token_s=2.9e-6, verify_s=0.8e-3)
DEVICES = {"h100": H100_SMOLLM2}


class VirtualClock:
    """Real `time.perf_counter` with the emulated device's time in place of the CPU forward's:
    now() = real now + offset; `exclude` takes real seconds out, `wait_until` jumps ahead."""

    def __init__(self) -> None:
        self.real = time.perf_counter
        self.offset = 0.0

    def __call__(self) -> float:
        return self.real() + self.offset

    def exclude(self, seconds: float) -> None:
        self.offset -= seconds

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def wait_until(self, moment: float) -> None:
        now = self()
        if moment > now:
            self.offset += moment - now


class _Future:
    """A non-blocking step's output, ready when the emulated device finishes it."""

    def __init__(self, inner: Any, done: float, clock: VirtualClock) -> None:
        self.inner, self.done, self.clock = inner, done, clock

    def result(self) -> Any:
        self.clock.wait_until(self.done)
        return self.inner.result()


class EmulatedExecutor:
    """Wraps an engine's executor: its steps cost the emulated device's time (module
    docstring); every other attribute is the wrapped executor's."""

    def __init__(self, inner: Any, clock: VirtualClock, model: DeviceModel) -> None:
        self.inner, self.clock, self.model = inner, clock, model
        self.busy_until = 0.0   # when the emulated device finishes the last step launched

    def execute(self, scheduler_output: Any, *, non_block: bool) -> Any:
        start = self.clock.real()
        output = self.inner.execute(scheduler_output, non_block=non_block)
        self.clock.exclude(self.clock.real() - start)
        tokens = scheduler_output.total_num_scheduled_tokens
        drafts = sum(map(len, scheduler_output.scheduled_spec_decode_tokens.values()))
        self.clock.advance(self.model.launch_s(tokens))
        begin = max(self.clock(), self.busy_until)
        self.busy_until = begin + self.model.device_s(tokens, drafts)
        if non_block:
            return _Future(output, self.busy_until, self.clock)
        self.clock.wait_until(self.busy_until)
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _time_shim(clock: VirtualClock) -> types.ModuleType:
    """A stand-in for the `time` module whose perf_counter is `clock`."""
    shim = types.ModuleType("time")
    shim.__dict__.update({k: v for k, v in vars(time).items() if not k.startswith("__")})
    shim.perf_counter = clock
    return shim


def install(model: DeviceModel, *clock_readers: types.ModuleType) -> VirtualClock:
    """Emulate `model` in this process: the engine core, the speculative decoder and each of
    `clock_readers` (modules that `import time`) read the virtual clock, and the verify path's
    start-up profile reads the model. Call before building the engines; then wrap each
    engine's executor with `emulate(llm, ...)`."""
    from deepinfer.engine import engine_core
    from deepinfer.engine.spec import manager, profile

    clock = VirtualClock()
    shim = _time_shim(clock)
    for module in (engine_core, manager, *clock_readers):
        module.time = shim

    def time_step(runner: Any, num_rows: int, num_drafts: int, context_len: int) -> float:
        tokens = num_rows + num_drafts
        return model.launch_s(tokens) + model.device_s(tokens, num_drafts)

    profile.time_step = time_step
    return clock


def emulate(llm: Any, clock: VirtualClock, model: DeviceModel) -> None:
    """`llm`'s steps run on the emulated device (after `install`)."""
    core = llm.engine_core
    core.executor = EmulatedExecutor(core.executor, clock, model)
