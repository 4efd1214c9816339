"""The engine core in its own process (engine/core_client.py, core_proc.py, core_wire.py):
the batched per-step message, token-exact streams against the in-process engine, abort, stop
strings applied in the API process, refusals as the engine's own errors, and a dead core
process as `EngineDeadError` (never a hang)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import pytest

from tests.processes import child_pids, running

from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.errors import EngineDeadError, PromptTooLongError, QueueFullError
from deepinfer.engine.outputs import KVStoreStats, SchedulerStats, TokenLogprobs
from deepinfer.engine.sampling_params import SamplingParams, SamplingParamsError
from deepinfer.engine.structured.backend import GrammarError

PROMPTS = [[1, 17, 300, 42, 9], [5, 6, 7], [100, 200, 300, 400, 500, 600, 700], [8]]
NUM_BLOCKS = 256


def _config(model_dir, **frontend) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_waiting_requests=4))


def _start(model_dir):
    from deepinfer.engine.async_llm import AsyncLLM

    config = _config(model_dir).replace(frontend={"engine_process": True})
    engine = AsyncLLM(config)
    assert type(engine).__name__ == "MPAsyncLLM"
    return engine


@pytest.fixture(scope="module")
def mp_engine(tiny_llama_dir):
    engine = _start(tiny_llama_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    from deepinfer.engine.llm import LLM

    return LLM(config=_config(tiny_llama_dir))


async def _collect(engine, prompt, params, request_id=None):
    outputs = []
    async for out in engine.generate(prompt, params, request_id):
        outputs.append(out)
    return outputs


async def _idle(engine, timeout_s: float = 5.0) -> SchedulerStats:
    """The stats once the core runs nothing and every block is free (or the last seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.get_stats()
        if (stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
                and stats.num_free_kv_blocks == NUM_BLOCKS) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def test_wire_carries_a_step_of_many_requests_in_one_message():
    from deepinfer.engine.core_wire import (OUTPUT_DECODER, OUTPUT_ENCODER, EngineOutputs,
                                            WireOutput, error_from_wire, error_to_wire)

    logprobs = [TokenLogprobs(3, -0.25, 1, [(3, -0.25), (9, -1.5)])]
    message = EngineOutputs(
        outputs=[WireOutput(f"r{i}", [i, i + 1], logprobs if i == 0 else None,
                            "stop" if i == 2 else None, 7 if i == 2 else None, 4)
                 for i in range(3)] + [WireOutput("h", [5], None, "length", None, 0,
                                                  {"stored_blocks": 2})],
        stats=SchedulerStats(num_running_reqs=3, kv_store=KVStoreStats(
            hits=2, latency_buckets_s=(0.01, 0.1), load_latency_counts=(1, 2, 2))))
    decoded = OUTPUT_DECODER.decode(OUTPUT_ENCODER.encode(message))
    assert decoded == message
    assert decoded.outputs[0].new_logprobs[0].top == [(3, -0.25), (9, -1.5)]
    assert decoded.outputs[3].kv_transfer_params == {"stored_blocks": 2}
    for error in (QueueFullError("full"), PromptTooLongError("long"), GrammarError("bad"),
                  SamplingParamsError("top_p", "top_p"), ValueError("vocab")):
        rebuilt = error_from_wire(error_to_wire("r", error))
        assert type(rebuilt) is type(error) and str(rebuilt) == str(error)
        assert getattr(rebuilt, "param", None) == getattr(error, "param", None)


def test_wire_carries_images_and_per_rank_and_encoder_stats_to_metrics():
    """A request's images cross as plain data (equal after decoding, bytes intact); the step's
    stats keep their data-parallel `per_rank` and image-encoder parts, which /metrics shows."""
    from prometheus_client import generate_latest

    from deepinfer.engine.core_wire import (INPUT_DECODER, INPUT_ENCODER, OUTPUT_DECODER,
                                            OUTPUT_ENCODER, AddRequest, EngineInput,
                                            EngineOutputs)
    from deepinfer.engine.multimodal import ImageInput, pixel_hash
    from deepinfer.engine.outputs import MMEncoderStats
    from deepinfer.server.metrics import ServerMetrics

    pixels = bytes(range(256)) * 6          # [1, 3, 4, 32] float32: 1536 bytes
    image = ImageInput(pixel_hash(pixels, (1, 3, 4, 32)), pixels, (1, 3, 4, 32), b"\x01" * 128,
                       offset=3, length=10, num_embeds=8)
    add = AddRequest("img", [1, 2, 3], SamplingParams(max_tokens=2), None, [image])
    decoded = INPUT_DECODER.decode(INPUT_ENCODER.encode(EngineInput(adds=[add])))
    got = decoded.adds[0].mm_inputs[0]
    assert got == image and type(got) is ImageInput and got.pixel_shape == (1, 3, 4, 32)
    assert got.end == 13 and decoded.adds[0].params == add.params

    per_rank = [SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25),
                SchedulerStats(num_running_reqs=1, num_waiting_reqs=3, kv_cache_usage=0.5)]
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=4, per_rank=per_rank,
                           mm_encoder=MMEncoderStats(images_encoded=5, cache_hits=2,
                                                     encode_seconds=0.75))
    arrived = OUTPUT_DECODER.decode(OUTPUT_ENCODER.encode(EngineOutputs(stats=stats))).stats
    assert arrived == stats and type(arrived.per_rank[1]) is SchedulerStats
    text = generate_latest(ServerMetrics(lambda: arrived, "m", 64).registry).decode()
    assert 'deepinfer:dp_rank_num_requests_waiting{dp_rank="1",model_name="m"} 3.0' in text
    assert 'deepinfer:dp_rank_kv_cache_usage_perc{dp_rank="0",model_name="m"} 0.25' in text
    assert "deepinfer:mm_encoder_images_encoded_total" in text
    assert [line for line in text.splitlines()
            if line.startswith("deepinfer:mm_encoder_images_encoded_total")][0].endswith(" 5.0")


def test_streams_equal_the_in_process_engine_token_for_token(mp_engine, offline):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    stopping = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [offline.generate([p], params)[0] for p, params in
                [(PROMPTS[0], greedy), (PROMPTS[1], seeded), (PROMPTS[2], greedy)]]
    reference = offline.generate([PROMPTS[3]], stopping)[0]
    stop = reference.text[8:11]          # a stop string inside the text: cut in the API process
    stopping = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    expected_stop = offline.generate([PROMPTS[3]], stopping)[0]

    async def run():
        return await asyncio.gather(
            _collect(mp_engine, PROMPTS[0], greedy), _collect(mp_engine, PROMPTS[1], seeded),
            _collect(mp_engine, PROMPTS[2], greedy), _collect(mp_engine, PROMPTS[3], stopping))

    streams = asyncio.run(run())
    for outputs, want in zip(streams, expected + [expected_stop]):
        last = outputs[-1]
        assert last.finished and [o.finished for o in outputs[:-1]] == [False] * (len(outputs) - 1)
        assert [t for o in outputs for t in o.new_token_ids] == last.token_ids == want.token_ids
        assert "".join(o.new_text for o in outputs) == last.text == want.text
        assert (last.finish_reason, last.stop_reason) == (want.finish_reason, want.stop_reason)
    got, want = streams[0][-1].logprobs, expected[0].logprobs   # batched apart: float noise
    assert [(g.token_id, g.rank, [t for t, _ in g.top]) for g in got] == \
        [(w.token_id, w.rank, [t for t, _ in w.top]) for w in want]
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert expected_stop.stop_reason == stop
    stats = asyncio.run(_idle(mp_engine))   # the stop-string request was aborted in the core
    assert stats.num_running_reqs == 0 and stats.num_free_kv_blocks == NUM_BLOCKS


def test_abort_frees_the_request_in_the_core(mp_engine, offline):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = offline.generate([PROMPTS[1]], greedy)[0].token_ids

    async def run():
        async def leave_after_two():
            stream = mp_engine.generate(PROMPTS[0], SamplingParams(max_tokens=400,
                                                                   ignore_eos=True))
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.aclose()

        _, outputs = await asyncio.gather(leave_after_two(),
                                          _collect(mp_engine, PROMPTS[1], greedy, "same-id"))
        again = await _collect(mp_engine, PROMPTS[1], greedy, "same-id")   # id reusable
        return outputs, again, await _idle(mp_engine)

    outputs, again, stats = asyncio.run(run())
    assert outputs[-1].token_ids == again[-1].token_ids == want
    assert stats.num_running_reqs == 0 and stats.num_free_kv_blocks == NUM_BLOCKS


def test_a_lagging_consumer_gets_the_queued_steps_as_one_output(mp_engine, offline):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    want = offline.generate([PROMPTS[2]], params)[0]

    async def slow_reader():
        outputs = []
        async for out in mp_engine.generate(PROMPTS[2], params):
            outputs.append(out)
            await asyncio.sleep(0.05)     # a busy event loop: steps queue up meanwhile
        return outputs

    outputs = asyncio.run(slow_reader())
    assert len(outputs) < 40 and max(len(o.new_token_ids) for o in outputs) > 1
    assert [t for o in outputs for t in o.new_token_ids] == want.token_ids
    assert "".join(o.new_text for o in outputs) == outputs[-1].text == want.text
    assert [lp.token_id for o in outputs for lp in o.new_logprobs] == want.token_ids
    assert [o.num_output_tokens for o in outputs] == list(
        itertools.accumulate(len(o.new_token_ids) for o in outputs))


def test_refusals_are_the_engine_s_own_errors(mp_engine):
    async def first(prompt, params):
        return await anext(mp_engine.generate(prompt, params))

    with pytest.raises(PromptTooLongError, match="max_model_len"):
        asyncio.run(first(PROMPTS[0], SamplingParams(max_tokens=100_000)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(first([10**7], SamplingParams(max_tokens=2)))
    with pytest.raises(GrammarError):
        asyncio.run(mp_engine.compile_grammar({"schema_type": "regex", "schema": "(unclosed"}))
    asyncio.run(mp_engine.compile_grammar({"schema_type": "regex", "schema": "[ab]{3}"}))
    assert mp_engine.mm_processor is None      # a text-only model: no images
    with pytest.raises(ValueError, match="text-only"):
        asyncio.run(mp_engine.generate(PROMPTS[0], SamplingParams(max_tokens=2),
                                       mm_inputs=[object()]).__anext__())
    mp_engine.check_health()


def test_a_killed_core_process_fails_streams_and_calls_with_engine_dead(mp_engine):
    """Last in the module: it kills the shared engine's core (the fixture's shutdown copes)."""
    engine = mp_engine

    async def run():
        stream = engine.generate(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            async with asyncio.timeout(10):     # the reader notices within READER_POLL_MS
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(PROMPTS[1], SamplingParams(max_tokens=2)))

    asyncio.run(run())
    with pytest.raises(EngineDeadError):
        engine.check_health()


ORPHAN_SCRIPT = """
import sys, time
from deepinfer.engine.async_llm import AsyncLLM
from deepinfer.engine.config import EngineConfig
if __name__ == "__main__":
    config = EngineConfig().replace(
        model={"model": sys.argv[1], "device": "cpu", "dtype": "float32"},
        cache={"block_size": 4, "num_blocks": 64}, frontend={"engine_process": True},
        parallel={"data_parallel_size": 2})   # the core spawns a worker per rank
    engine = AsyncLLM(config)
    print(engine._proc.pid, flush=True)
    time.sleep(600)
"""


def test_a_core_process_whose_api_server_died_exits(tiny_llama_dir, tmp_path):
    """An orphaned core frees its device memory: it exits within a poll of its parent's
    death (here the API server is SIGKILLed, so it could not send `shutdown`), and so do
    the rank workers it spawned (data_parallel_size=2: the core is not daemonic)."""
    import subprocess
    import sys

    script = tmp_path / "api_server.py"
    script.write_text(ORPHAN_SCRIPT)
    api = subprocess.Popen([sys.executable, str(script), str(tiny_llama_dir)],
                           stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(api.stdout.readline())
        ranks = child_pids(core_pid)
        assert len(ranks) == 2, ranks
        api.kill()
        api.wait(10)
        deadline = time.monotonic() + 15
        for pid in [core_pid, *ranks]:
            while running(pid):
                assert time.monotonic() < deadline, f"orphaned process {pid} is still running"
                time.sleep(0.1)
    finally:
        api.kill()
