"""Expert parallelism, EPLB and attention data parallelism on CPU (gloo), on a tiny random
DeepSeek-V3 (tests/engine/deepseek_configs.py: 8 routed experts, top-2, noaux_tc routing with 4
groups, a dense first layer, shared experts), float32, greedy.

Every configuration must give the tokens of the plain one-process engine: one process with the
EP code path (redundant experts, a rebalance mid-generation); 2 ranks and 4 ranks with attention
DP + EP (redundant experts, rebalances mid-generation, the expert weights moving in the
background while steps run), the 4 ranks as two "nodes" on this machine (this process and a
`deepinfer serve --headless` launcher). The multi-process tests spawn once per world size and
check several things each (requests spread over the ranks, all ranks agree on the placement,
the load counters saw the tokens, a killed rank ends the engine in bounded time, local or on
the other node); a node that never joins fails the start in bounded time.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from deepinfer.engine.dp_executor import free_port
from deepinfer.engine.errors import EngineDeadError
from deepinfer.engine.llm import LLM
from deepinfer.engine.loader import load_model
from deepinfer.engine.moe.expert_parallel import EPGroup, enable_expert_parallel
from deepinfer.engine.moe.gating import select_experts
from deepinfer.engine.moe.weight_moves import plan_sources
from deepinfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(300 + 7 * n, 300 + 8 * n)) for n in (3, 11, 6, 17, 1)]
BASE = dict(dtype="float32", device="cpu", block_size=4, num_blocks=64, max_num_seqs=4,
            max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def reference_tokens(tiny_v3):
    llm = LLM(str(tiny_v3), **BASE)
    try:
        return _tokens(llm.generate(PROMPTS, GREEDY))
    finally:
        llm.engine_core.close()


def _tokens(outputs):
    return [out.outputs[0].token_ids for out in outputs]


def test_load_counters_equal_the_routing_decisions(tiny_v3):
    model = load_model(tiny_v3, torch.float32, "cpu")
    ep = enable_expert_parallel(model, EPGroup(), num_redundant=4, window_steps=3)
    gen = torch.Generator().manual_seed(0)
    history = []
    with torch.inference_mode():
        for step in range(5):
            expected = torch.zeros(len(ep.moes), 8, dtype=torch.int64)
            for i, moe in enumerate(ep.moes):
                hidden = torch.randn(7 + step, 64, generator=gen)
                _, ids = select_experts(hidden @ moe.gate_weight.T, moe.routing,
                                        moe.e_score_correction_bias)
                expected[i] = torch.bincount(ids.flatten(), minlength=8)
                moe(hidden)
            assert torch.equal(ep.loads.step_load, expected)
            ep.end_step()
            history.append(expected)
            assert torch.equal(ep.loads.window_load(), sum(history[-3:]))
    assert not bool(ep.loads.step_load.any())


def test_weight_move_sources_prefer_the_slot_then_the_rank_then_the_first_holder():
    old = torch.tensor([0, 1, 2, 3, 4, 5])           # 2 ranks x 3 slots
    new = torch.tensor([0, 4, 2, 1, 3, 4])
    # slot 0 and 2 keep theirs; 1 (expert 4) is on rank 1 only; 3 and 4 (experts 1, 3): 3 is
    # on rank 1 (slot 3), 1 only on rank 0; slot 5 (expert 4) is on its own rank (slot 4)
    assert plan_sources(old, new, world=2).tolist() == [0, 4, 2, 1, 3, 4]
    with pytest.raises(ValueError, match="every logical expert"):
        plan_sources(old, torch.tensor([0, 1, 2, 3, 4, 6]), world=2)


def _check_moves(moves: list[list[dict]]) -> None:
    """Every rank committed the same moves at the same step boundaries, each after at least one
    step that ran (with tokens) while the weights were in flight."""
    assert len(moves[0]) >= 1 and all(len(m) == len(moves[0]) for m in moves)
    for per_rank in zip(*moves):
        steps = {(m["decision_step"], m["commit_step"]) for m in per_rank}
        assert len(steps) == 1
        decision, commit = steps.pop()
        assert commit > decision
    assert sum(m["tokens_during_move"] for m in moves_of(moves, 0)) > 0
    assert sum(m["bytes_received"] for rank in moves for m in rank) > 0   # weights did move


def moves_of(moves: list[list[dict]], index: int) -> list[dict]:
    return [rank[index] for rank in moves]


def test_one_process_ep_with_replicas_and_rebalances_gives_the_same_tokens(
        tiny_v3, reference_tokens):
    llm = LLM(str(tiny_v3), **BASE, enable_expert_parallel=True, num_redundant_experts=4,
              enable_eplb=True, eplb_interval_steps=3, eplb_window_steps=4)
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference_tokens
        ep = llm.engine_core.executor.expert_parallel
        assert ep.num_rebalances >= 3
        initial = torch.arange(12) % 8
        assert any(not torch.equal(layer, initial) for layer in ep.placement())
        # one rank: each move commits at its decision (nothing to wait for)
        assert all(m["commit_step"] == m["decision_step"] for m in ep.move_stats)
    finally:
        llm.engine_core.close()


def _generate_on_core(core, prompts, params):
    """Queue every prompt, then step until all finish; (tokens in prompt order, the DP rank
    each request was placed on)."""
    requests = [core.make_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    for request in requests:
        core.add_request(request)
    ranks = [core.scheduler.rank_of(r.request_id) for r in requests]
    finished = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    return [finished[r.request_id] for r in requests], ranks


def test_two_ranks_dp_ep_match_one_process_and_a_dead_rank_stops_the_engine(
        tiny_v3, reference_tokens):
    llm = LLM(str(tiny_v3), **BASE, data_parallel_size=2, enable_expert_parallel=True,
              num_redundant_experts=2, enable_eplb=True, eplb_interval_steps=4,
              rank_timeout_s=60)
    core = llm.engine_core
    try:
        tokens, ranks = _generate_on_core(core, PROMPTS, GREEDY)
        assert tokens == reference_tokens
        assert ranks == [0, 1, 0, 1, 0]   # the least loaded (then the lowest) rank
        placements = core.executor.call("expert_placement")
        assert torch.equal(placements[0], placements[1])             # one placement
        assert min(core.executor.call("num_rebalances")) >= 2
        _check_moves(core.executor.call("move_stats"))
        assert core.executor.call("experts_match_checkpoint") == [True, True]
        stats = core.get_stats()
        assert len(stats.per_rank) == 2 and stats.num_running_reqs == 0
        # kill rank 1 in the middle of a generation: an error naming it, no hang
        for i, prompt in enumerate(PROMPTS[:2]):
            core.add_request(core.make_request(prompt, GREEDY, f"late{i}"))
        core.step()
        os.kill(core.executor.processes[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            for _ in range(100):
                core.step()
        assert time.monotonic() - start < 30
    finally:
        core.close()
    assert not any(p.is_alive() for p in core.executor.processes)


def _headless_node(node_rank: int, ports: tuple[int, int], secret: str,
                   rendezvous_timeout_s: float = 60) -> subprocess.Popen:
    """`deepinfer serve --headless` for node `node_rank` of 2 (2 ranks each) on this machine."""
    master_port, rpc_port = ports
    command = [sys.executable, "-m", "deepinfer.server.cli", "serve", "--headless",
               "--data-parallel-size", "4", "--nnodes", "2", "--node-rank", str(node_rank),
               "--master-addr", "127.0.0.1", "--master-port", str(master_port),
               "--data-parallel-rpc-port", str(rpc_port), "--device", "cpu"]
    env = {**os.environ, "DEEPINFER_DP_RPC_SECRET": secret,
           "DEEPINFER_RENDEZVOUS_TIMEOUT_S": str(rendezvous_timeout_s)}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_two_nodes_of_two_ranks_match_one_process_and_a_dead_remote_rank_stops_them(
        tiny_v3, reference_tokens):
    """Two "nodes" on localhost: this process is node 0 (engine core + ranks 0, 1), a
    `deepinfer serve --headless` launcher is node 1 (ranks 2, 3); gloo, EP over the 4 ranks,
    redundant experts, EPLB moves in flight during generation."""
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    node1 = _headless_node(1, ports, secret="s3cret")
    try:
        llm = LLM(str(tiny_v3), **BASE, data_parallel_size=4, num_nodes=2,
                  master_port=ports[0], data_parallel_rpc_port=ports[1], rpc_secret="s3cret",
                  enable_expert_parallel=True, num_redundant_experts=4, enable_eplb=True,
                  eplb_interval_steps=5, rendezvous_timeout_s=60, rank_timeout_s=60)
        core = llm.engine_core
        executor = core.executor
        assert len(executor.processes) == 2 and sorted(executor.remote_pids) == [2, 3]
        tokens, ranks = _generate_on_core(core, PROMPTS, GREEDY)
        assert tokens == reference_tokens
        assert sorted(set(ranks)) == [0, 1, 2, 3]
        assert min(executor.call("num_rebalances")) >= 1
        _check_moves(executor.call("move_stats"))
        assert executor.call("experts_match_checkpoint") == [True] * 4
        placements = executor.call("expert_placement")
        assert all(torch.equal(placements[0], other) for other in placements[1:])
        # every forwarded token (prompt + all but the last sampled one) chose top-2 experts in
        # each of the 2 MoE layers, counted once on the rank that routed it
        forwarded = sum(len(p) + GREEDY.max_tokens - 1 for p in PROMPTS)
        loads = executor.call("window_load")
        assert sum(int(load.sum()) for load in loads) == forwarded * 2 * 2
        # kill rank 3 (node 1) in the middle of a generation: an error naming it, no hang
        for i, prompt in enumerate(PROMPTS[:4]):
            core.add_request(core.make_request(prompt, GREEDY, f"late{i}"))
        core.step()
        os.kill(executor.remote_pids[3], signal.SIGKILL)
        start = time.monotonic()
        # the dead rank is named, or (a race) a peer whose collective lost rank 3's
        # connection fails first and is named with that cause
        with pytest.raises(EngineDeadError,
                           match=r"rank 3|rank \d failed during a step: (?s:.*)(Connection reset|"
                                 r"Connection closed|Read error|Write error)"):
            for _ in range(100):
                core.step()
        assert time.monotonic() - start < 30
        core.close()
        assert node1.wait(timeout=30) != 0   # node 1's launcher stops with its ranks
        assert not any(p.is_alive() for p in executor.processes)
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.wait()


def test_a_node_that_never_joins_fails_the_start_in_bounded_time(tiny_v3):
    start = time.monotonic()
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    with pytest.raises(EngineDeadError, match=r"ranks \[2, 3\] did not join the rendezvous"):
        LLM(str(tiny_v3), **BASE, data_parallel_size=4, num_nodes=2, master_port=ports[0],
            data_parallel_rpc_port=ports[1], rpc_secret="s3cret", enable_expert_parallel=True,
            rendezvous_timeout_s=3)
    assert time.monotonic() - start < 20


def test_deep_ep_backend_on_cpu_is_refused_before_serving(tiny_v3):
    from deepinfer.engine.config import ConfigError

    with pytest.raises(ConfigError, match="ep_backend=deep_ep runs DeepEP's CUDA kernels"):
        LLM(str(tiny_v3), **BASE, enable_expert_parallel=True, ep_backend="deep_ep")


def test_a_headless_node_without_node_0_exits_with_the_reason_in_bounded_time():
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    start = time.monotonic()
    node1 = _headless_node(1, ports, secret="s3cret", rendezvous_timeout_s=2)
    output, _ = node1.communicate(timeout=60)
    assert node1.returncode == 1
    assert "did not listen within 2 s" in output and "rank 2" in output
    assert time.monotonic() - start < 60
