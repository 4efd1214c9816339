"""benchmarks/emulated_device.py: the virtual clock takes each step's CPU forward out and puts
the emulated device's time in; a blocking step's caller waits for it, a non-blocking step's
future when it is resolved, so host work done meanwhile overlaps the device. No model."""

import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MS = 1e-3


def load_emulator():
    spec = importlib.util.spec_from_file_location("emulated_device",
                                                  BENCHMARKS / "emulated_device.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


class SlowExecutor:
    """A CPU forward of `forward_s` seconds; its output resolves to `"out"`."""

    def __init__(self, forward_s):
        self.forward_s = forward_s
        self.block_size = 16   # any other attribute passes through

    def execute(self, scheduler_output, *, non_block):
        time.sleep(self.forward_s)
        return SimpleNamespace(result=lambda: "out") if non_block else "out"


def step(tokens, drafts=0):
    return SimpleNamespace(total_num_scheduled_tokens=tokens,
                           scheduled_spec_decode_tokens={"r": [0] * drafts} if drafts else {})


def test_steps_cost_the_emulated_device_not_the_cpu_forward():
    emu = load_emulator()
    model = emu.DeviceModel(launch_base_s=0.1 * MS, launch_per_token_s=0.0,
                            device_base_s=1.0 * MS, device_per_token_s=0.0, verify_s=0.5 * MS)
    clock = emu.VirtualClock()
    executor = emu.EmulatedExecutor(SlowExecutor(0.02), clock, model)
    assert executor.block_size == 16
    start = clock()
    assert executor.execute(step(1, drafts=2), non_block=False) == "out"
    # launch + device (+ verify), never the 20 ms forward; real host time around it is small
    assert clock() - start == pytest.approx(1.6 * MS, abs=0.5 * MS)
    start = clock()
    future = executor.execute(step(1), non_block=True)
    assert clock() - start == pytest.approx(0.1 * MS, abs=0.5 * MS)   # the launch only
    assert future.result() == "out"
    assert clock() - start == pytest.approx(1.1 * MS, abs=0.5 * MS)   # waited for the device
    # two steps launched back to back queue on the one device
    start = clock()
    first = executor.execute(step(1), non_block=True)
    second = executor.execute(step(1), non_block=True)
    first.result(), second.result()
    assert clock() - start == pytest.approx(2.1 * MS, abs=0.5 * MS)


def test_the_profile_reads_the_model_and_the_engine_the_virtual_clock():
    emu = load_emulator()
    from deepinfer.engine import engine_core
    from deepinfer.engine.spec import manager, profile

    saved = engine_core.time, manager.time, profile.time_step
    try:
        clock = emu.install(emu.H100_SMOLLM2)
        assert engine_core.time.perf_counter is clock and manager.time.perf_counter is clock
        assert engine_core.time.monotonic is time.monotonic
        model = emu.H100_SMOLLM2
        assert profile.time_step(None, 16, 80, 128) == pytest.approx(
            model.launch_s(96) + model.device_s(96, 80))
    finally:
        engine_core.time, manager.time, profile.time_step = saved
