"""The control channel between node 0's engine core and the other nodes' ranks
(engine/dp_rpc.py), in one process: the handshake, a peer with another secret, a rank that is
not expected, and the rendezvous deadline (a refused peer once killed the accept thread, and
closing the listener then hung)."""

import dataclasses
import multiprocessing
import threading
from multiprocessing.connection import Client

import pytest
import torch

from deepinfer.engine.config import ParallelConfig
from deepinfer.engine.dp_executor import free_port
from deepinfer.engine.dp_rpc import RankListener, connect_to_core
from deepinfer.engine.errors import EngineDeadError


def _parallel(**fields) -> ParallelConfig:
    return ParallelConfig(**{**dict(data_parallel_size=2, num_nodes=2, master_port=29400,
                                    data_parallel_rpc_port=free_port("127.0.0.1"),
                                    rpc_secret="k", rendezvous_timeout_s=5), **fields})


def test_a_remote_rank_gets_its_args_and_tensors_travel_by_value():
    parallel = _parallel()
    listener = RankListener(parallel)
    got = {}

    def remote_rank():
        got["conn"], got["args"] = connect_to_core(parallel, rank=1, local_rank=0)

    thread = threading.Thread(target=remote_rank)
    thread.start()
    try:
        joined = listener.accept_ranks([1], 5, lambda rank, local: ("args for", rank, local))
    finally:
        listener.close()
    thread.join(5)
    assert got["args"] == ("args for", 1, 0) and list(joined) == [1]
    core_side, _pid = joined[1]
    core_side.send(("ok", torch.arange(4)))   # no shared-memory handle: plain bytes
    status, tensor = got["conn"].recv()
    assert status == "ok" and torch.equal(tensor, torch.arange(4))
    got["conn"].close()
    core_side.close()


def test_a_peer_with_another_secret_is_refused_before_any_message():
    parallel = _parallel()
    listener = RankListener(parallel)
    try:
        with pytest.raises(multiprocessing.AuthenticationError):
            Client(listener.address, authkey=b"wrong")
        with pytest.raises(EngineDeadError, match=r"ranks \[1\] did not join .*refused"):
            listener.accept_ranks([1], 1.0, lambda rank, local: None)
    finally:
        listener.close()


def test_an_unexpected_rank_is_named():
    parallel = _parallel()
    listener = RankListener(parallel)
    thread = threading.Thread(target=_try_connect, args=(parallel, 7), daemon=True)
    thread.start()
    try:
        with pytest.raises(EngineDeadError, match="a node announced rank 7, and the ranks "
                                                  r"expected from other nodes are \[1\]"):
            listener.accept_ranks([1], 5, lambda rank, local: None)
    finally:
        listener.close()


def _try_connect(parallel, rank):
    try:
        connect_to_core(dataclasses.replace(parallel, rendezvous_timeout_s=2), rank=rank,
                        local_rank=0)
    except (TimeoutError, EOFError, OSError):
        pass


def test_a_rank_without_node_0_gives_up_after_the_rendezvous_timeout():
    parallel = _parallel(rendezvous_timeout_s=0.5)
    with pytest.raises(TimeoutError, match="did not listen within"):
        connect_to_core(parallel, rank=1, local_rank=0)
