"""One engine core process, two API-server clients (`--api-server-count 2`'s core side,
engine/core_proc.py routing): each client gets exactly its own requests' tokens (equal to
the in-process engine's), grammar-compile tickets that collide between clients are answered
to the right one, an abort from one client frees the request, and the core stops only once
both clients said they are done."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time

import pytest

from deepinfer.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.structured.backend import GrammarError

PROMPTS = [[1, 17, 300, 42, 9], [5, 6, 7], [100, 200, 300, 400, 500, 600, 700], [8]]
NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def config(tiny_llama_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_waiting_requests=8))


async def _collect(engine, prompt, params):
    return [out async for out in engine.generate(prompt, params)]


def test_two_clients_of_one_core_get_their_own_outputs_and_stop_it_together(config):
    from deepinfer.engine.core_client import MPAsyncLLM, core_config, start_core_process
    from deepinfer.engine.core_wire import CoreEndpoints
    from deepinfer.engine.llm import LLM

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    offline = LLM(config=config)
    want = [o.token_ids for o in offline.generate(PROMPTS, greedy)]
    config = core_config(config)
    endpoints = CoreEndpoints(tempfile.mkdtemp(prefix="deepinfer-core-test-"), 2)
    core = start_core_process(config, endpoints)
    endpoints = CoreEndpoints(endpoints.ipc_dir, 2, core.pid)
    clients = [MPAsyncLLM(config, endpoints=endpoints, client_index=i) for i in range(2)]
    try:
        async def run():
            streams = await asyncio.gather(*(
                _collect(clients[i % 2], prompt, greedy) for i, prompt in enumerate(PROMPTS)))
            # both clients' first compile is ticket 0 of their own: each gets its own answer
            results = await asyncio.gather(
                clients[0].compile_grammar({"schema_type": "regex", "schema": "[ab]{3}"}),
                clients[1].compile_grammar({"schema_type": "regex", "schema": "(unclosed"}),
                return_exceptions=True)
            stream = clients[1].generate(PROMPTS[0], SamplingParams(max_tokens=400,
                                                                    ignore_eos=True))
            await anext(stream)
            await stream.aclose()     # a client leaving mid-stream: aborted in the core
            deadline = time.monotonic() + 5
            while (clients[0].get_stats().num_free_kv_blocks != NUM_BLOCKS
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.05)
            return streams, results

        streams, results = asyncio.run(run())
        assert [s[-1].token_ids for s in streams] == want
        assert all(s[-1].finished and sum(len(o.new_token_ids) for o in s) == 16
                   for s in streams)
        assert results[0] is None and isinstance(results[1], GrammarError)
        stats = clients[0].get_stats()
        assert stats.num_running_reqs == 0 and stats.num_free_kv_blocks == NUM_BLOCKS
        clients[0].shutdown()
        core.join(1.0)
        assert core.is_alive()          # the other client still uses it
        clients[1].check_health()
        clients[1].shutdown()
        core.join(20)
        assert core.exitcode == 0
    finally:
        for client in clients:
            client.shutdown()
        if core.is_alive():
            core.kill()
        shutil.rmtree(endpoints.ipc_dir, ignore_errors=True)
