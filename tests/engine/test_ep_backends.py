"""Expert-parallel backend selection (engine/moe/ep_backends.py). DeepEP cannot be installed
here (it builds against NVSHMEM and needs GPUs): a stand-in `deep_ep` module in sys.modules
exercises only the selection logic; the DeepEP adapter itself is untested."""

import sys
import types

import pytest

from deepinfer.engine.config import ConfigError, ParallelConfig
from deepinfer.engine.moe.ep_backends import resolve_ep_backend


@pytest.fixture
def deep_ep_installed(monkeypatch):
    fake = types.ModuleType("deep_ep")
    fake.Buffer = object   # only its presence matters to the selection
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    return fake


@pytest.fixture
def deep_ep_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)   # `import deep_ep` raises ImportError


def test_auto_picks_deep_ep_only_on_cuda_when_importable(deep_ep_installed):
    assert resolve_ep_backend("auto", "cuda") == "deep_ep"
    assert resolve_ep_backend("auto", "cpu") == "all_to_all"
    assert resolve_ep_backend("all_to_all", "cuda") == "all_to_all"
    assert resolve_ep_backend("deep_ep", "cuda") == "deep_ep"


def test_auto_falls_back_to_all_to_all_without_the_library(deep_ep_missing):
    assert resolve_ep_backend("auto", "cuda") == "all_to_all"
    assert resolve_ep_backend("auto", "cpu") == "all_to_all"


def test_asking_for_deep_ep_where_it_cannot_run_is_a_config_error(deep_ep_missing):
    with pytest.raises(ConfigError, match="needs the `deep_ep` package") as info:
        resolve_ep_backend("deep_ep", "cuda")
    assert info.value.field == "ep_backend" and "--ep-backend all_to_all" in str(info.value)
    with pytest.raises(ConfigError, match="device is cpu"):
        resolve_ep_backend("deep_ep", "cpu")


def test_ep_backend_field_is_checked():
    assert ParallelConfig().ep_backend == "auto"
    with pytest.raises(ConfigError, match="ep_backend='nccl' is not supported"):
        ParallelConfig(ep_backend="nccl")


def test_several_nodes_need_fixed_ports_and_a_secret():
    nodes = dict(data_parallel_size=4, num_nodes=2, master_port=29500)
    with pytest.raises(ConfigError, match="data_parallel_rpc_port must be"):
        ParallelConfig(**nodes, rpc_secret="k")
    with pytest.raises(ConfigError, match="DEEPINFER_DP_RPC_SECRET"):
        ParallelConfig(**nodes, data_parallel_rpc_port=29501)
    node1 = ParallelConfig(**nodes, data_parallel_rpc_port=29501, rpc_secret="k", node_rank=1)
    assert (node1.local_size, node1.start_rank) == (2, 2)
    uneven = ParallelConfig(**nodes, data_parallel_rpc_port=29501, rpc_secret="k", node_rank=1,
                            data_parallel_size_local=3, data_parallel_start_rank=1)
    assert (uneven.local_size, uneven.start_rank) == (3, 1)
    with pytest.raises(ConfigError, match=r"ranks \[3, 6\) must lie in \[0, "):
        ParallelConfig(**nodes, data_parallel_rpc_port=29501, rpc_secret="k", node_rank=1,
                       data_parallel_size_local=3)
    with pytest.raises(ConfigError, match="node 0 .* starts at rank 0"):
        ParallelConfig(**nodes, data_parallel_rpc_port=29501, rpc_secret="k",
                       data_parallel_start_rank=2)


def test_headless_flags_map_to_the_parallel_config():
    from deepinfer.server.cli import build_engine_config, build_parser, main

    args = build_parser().parse_args([
        "serve", "--headless", "--data-parallel-size", "8", "--nnodes", "2", "--node-rank", "1",
        "--data-parallel-address", "10.0.0.1", "--master-port", "29500",
        "--data-parallel-rpc-port", "29501", "--data-parallel-size-local", "4",
        "--data-parallel-start-rank", "4", "--ep-backend", "all_to_all"])
    parallel = build_engine_config(args, environ={"DEEPINFER_DP_RPC_SECRET": "k"}).parallel
    assert args.headless and parallel.master_addr == "10.0.0.1"
    assert (parallel.num_nodes, parallel.node_rank, parallel.master_port,
            parallel.data_parallel_rpc_port) == (2, 1, 29500, 29501)
    assert (parallel.local_size, parallel.start_rank, parallel.rpc_secret,
            parallel.ep_backend) == (4, 4, "k", "all_to_all")
    # node 0 never runs headless, and other nodes only so
    assert main(["serve", "--headless"]) == 2
