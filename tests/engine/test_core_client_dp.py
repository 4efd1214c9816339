"""Attention DP + EP behind the engine core process: the core (a non-daemonic child of the API
process) spawns one worker per rank. A tiny random DeepSeek-V3 (8 routed experts, top-2, as
tests/engine/test_expert_parallel.py), float32, greedy, data_parallel_size=2 with expert
parallelism through `MPAsyncLLM` must give the in-process `AsyncLLM`'s tokens; per-rank stats
come over the wire; `shutdown()` leaves no process behind (core and both ranks gone, reaped);
a core killed outright fails the engine with `EngineDeadError`, and its ranks exit.

One spawn (core + 2 ranks) for the whole file: both teardown paths run on it in turn (the core
killed first, then `shutdown()` of the dead engine must still reap everything)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from tests.processes import child_pids, running

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.errors import EngineDeadError
from deepinfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(300 + 7 * n, 300 + 8 * n)) for n in (3, 11, 6)]


def _config(model_dir, **parallel) -> EngineConfig:
    return EngineConfig().replace(
        model={"model": str(model_dir), "dtype": "float32", "device": "cpu"},
        cache={"block_size": 4, "num_blocks": 64},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 24},
        parallel=parallel)


async def _tokens(engine) -> list[list[int]]:
    async def one(i, prompt):
        tokens = []
        async for out in engine.generate(prompt, GREEDY, f"r{i}"):
            tokens += out.new_token_ids
        return tokens
    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_dp2_ep_through_the_engine_process_matches_in_process(tiny_v3):
    from deepinfer.engine.async_llm import AsyncLLM

    in_process = AsyncLLM(_config(tiny_v3, enable_expert_parallel=True))
    try:
        assert type(in_process) is AsyncLLM
        reference = asyncio.run(_tokens(in_process))
    finally:
        in_process.shutdown()

    engine = AsyncLLM(_config(tiny_v3, data_parallel_size=2, enable_expert_parallel=True,
                              rank_timeout_s=60).replace(frontend={"engine_process": True}))
    core = engine._proc.pid
    try:
        assert type(engine).__name__ == "MPAsyncLLM" and not engine._proc.daemon
        ranks = child_pids(core)
        assert len(ranks) == 2, ranks
        assert asyncio.run(_tokens(engine)) == reference
        per_rank = engine.get_stats().per_rank       # came over the wire each step
        assert per_rank is not None and len(per_rank) == 2
        assert sum(s.num_kv_blocks for s in per_rank) == engine.get_stats().num_kv_blocks

        # the core killed outright: the engine fails fast, the ranks exit on their pipes
        os.kill(core, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async def after():
                async with asyncio.timeout(10):
                    async for _ in engine.generate(PROMPTS[0], GREEDY):
                        pass
            asyncio.run(after())
        assert not _wait_gone(ranks, 15), "a rank outlived its engine core"
    finally:
        engine.shutdown()
    assert not Path(f"/proc/{core}").exists()        # reaped: no zombie left
    assert not engine._proc.is_alive()
