"""Several nodes: the control channel between node 0's engine core and the ranks of the other
nodes (the headless launcher those nodes run is engine/dp_node.py).

Layout (as torchrun: every node joins one rendezvous): node 0 runs the engine core, the API
server and its ranks [0, L0) (engine/dp_executor.py, over pipes); node n runs
`deepinfer serve --headless --node-rank n --nnodes N ...`, which spawns its ranks
[start_n, start_n + L_n); all ranks join one `torch.distributed` process group at
master_addr:master_port (the expert-parallel collectives), and each rank of another node opens
one TCP connection to node 0's engine core at master_addr:data_parallel_rpc_port for its
steps.

Control channel: `multiprocessing.connection` over TCP (Listener / Client with an authkey).
Why this one:
- a `Connection` has the same send / recv / poll as the local ranks' pipes and can be waited on
  by `multiprocessing.connection.wait` together with them and the local processes'
  sentinels, so one supervision loop covers local and remote ranks, with per-rank deadlines:
  a remote rank's process that dies closes its socket (EOF at once), a node that vanishes is
  caught by rank_timeout_s;
- a `torch.distributed` object collective on a gloo group was the other choice: the engine
  core would have to join the ranks' group (it is no rank: a second group with one more
  member, created by every rank), an object collective blocks with no per-peer deadline or
  poll, and a dead peer turns into a gloo timeout rather than an EOF naming the rank;
- ZeroMQ + msgspec (engine/core_wire.py) would need a typed schema for every `SchedulerOutput`
  / `ModelRunnerOutput` field (nested request data, sampling params, grammars), which the
  pipes carry as pickles today; the payloads are the same here, so pickling stays.
Pickles from the network run code when read: the Listener checks the HMAC challenge of the
shared `rpc_secret` before it reads any message (DEEPINFER_DP_RPC_SECRET, the same on every
node), and node 0 listens on master_addr only.

Handshake: a remote rank connects (retrying until rendezvous_timeout_s: node 0 may start
later), sends ("hello", rank, local_rank, pid); the core answers ("args", WorkerArgs) — the
core's config, model directory (the same path on every node), device and dtype — and from then
on the rank runs the same loop as a local one (`worker_main`).
"""


from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from deepinfer.engine.config import ParallelConfig
from deepinfer.engine.errors import EngineDeadError

HANDSHAKE_TIMEOUT_S = 30.0   # a connected peer must say hello within this


class PickleConnection:
    """A TCP `Connection` that pickles with the standard pickler: the multiprocessing one that
    `Connection.send` uses would pass tensors as shared-memory handles of this machine (torch
    registers such reductions), meaningless on another node. Same send / recv / poll / fileno
    (so `multiprocessing.connection.wait` takes it) / close."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, obj) -> None:
        self.conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()


class RankListener:
    """Node 0's side of the control channel: accept the other nodes' ranks (module doc)."""

    def __init__(self, parallel: ParallelConfig):
        self.address = (parallel.master_addr, parallel.data_parallel_rpc_port)
        self.authkey = parallel.rpc_secret.encode()
        try:
            self.listener = Listener(self.address, authkey=self.authkey, backlog=64)
        except OSError as exc:
            raise EngineDeadError(
                f"cannot listen for the other nodes' ranks on {self.address[0]}:"
                f"{self.address[1]} ({exc}); pick a free --data-parallel-rpc-port on an "
                "address of this node (--master-addr).") from None
        self.accepted: list[PickleConnection] = []
        self.failures: list[str] = []
        self.closed = threading.Event()
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._accept_loop, name="rank-listener",
                                       daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                conn = self.listener.accept()    # runs the HMAC challenge
            except (OSError, EOFError, AuthenticationError) as exc:   # e.g. another key
                if self.closed.is_set():
                    return
                with self.ready:
                    self.failures.append(str(exc) or type(exc).__name__)
                    self.ready.notify_all()
                continue
            if self.closed.is_set():
                conn.close()
                return
            with self.ready:
                self.accepted.append(PickleConnection(conn))
                self.ready.notify_all()

    def accept_ranks(self, ranks: list[int], timeout_s: float, make_args) -> dict:
        """Wait until every rank in `ranks` connected and said hello; answer each with
        `make_args(rank, local_rank)`. Returns {rank: (connection, pid)}.

        Raises:
            EngineDeadError: ranks still missing after `timeout_s` (named, with the command
                the other nodes run), or a rank that connects twice.
        """
        deadline = time.monotonic() + timeout_s
        joined: dict[int, tuple[PickleConnection, int]] = {}
        taken = 0
        while len(joined) < len(ranks):
            with self.ready:
                left = deadline - time.monotonic()
                if len(self.accepted) == taken and left > 0:
                    self.ready.wait(min(left, 1.0))
                fresh, taken = self.accepted[taken:], len(self.accepted)
            for conn in fresh:
                rank, local_rank, pid = self._hello(conn, ranks, joined)
                conn.send(("args", make_args(rank, local_rank)))
                joined[rank] = (conn, pid)
            if len(joined) < len(ranks) and time.monotonic() >= deadline:
                missing = [r for r in ranks if r not in joined]
                refused = f"; refused: {self.failures[-1]}" if self.failures else ""
                raise EngineDeadError(
                    f"ranks {missing} did not join the rendezvous at {self.address[0]}:"
                    f"{self.address[1]} within {timeout_s:.0f} s{refused}; start `deepinfer "
                    "serve --headless --node-rank N --nnodes ... --master-addr "
                    f"{self.address[0]} --data-parallel-rpc-port {self.address[1]}` on every "
                    "other node (same DEEPINFER_DP_RPC_SECRET), or raise "
                    "DEEPINFER_RENDEZVOUS_TIMEOUT_S.")
        return joined

    @staticmethod
    def _hello(conn: PickleConnection, ranks: list[int], joined: dict) -> tuple[int, int, int]:
        if not conn.poll(HANDSHAKE_TIMEOUT_S):
            raise EngineDeadError("a node connected for the rendezvous and said nothing within "
                                  f"{HANDSHAKE_TIMEOUT_S:.0f} s; the engine stops.")
        kind, rank, local_rank, pid = conn.recv()
        if kind != "hello" or rank not in ranks or rank in joined:
            raise EngineDeadError(
                f"a node announced rank {rank}, and the ranks expected from other nodes are "
                f"{ranks} (joined: {sorted(joined)}); check --data-parallel-size, --nnodes, "
                "--node-rank and --data-parallel-start-rank on every node.")
        return rank, local_rank, pid

    def close(self) -> None:
        """Stop accepting (the accept thread is woken by one last connection of our own)."""
        if self.closed.is_set():
            return
        self.closed.set()
        try:   # wake the accept with a bare connection (no handshake to block on)
            socket.create_connection(self.address, timeout=2).close()
        except OSError:
            pass
        self.thread.join(5)
        self.listener.close()


def connect_to_core(parallel: ParallelConfig, rank: int, local_rank: int) -> tuple:
    """A remote rank's side of the handshake: connect (retrying until rendezvous_timeout_s),
    say hello, get the `WorkerArgs`. Returns (connection, args).

    Raises:
        TimeoutError: node 0 did not listen (or answer) in time.
        multiprocessing.AuthenticationError: node 0 has another rpc_secret.
    """
    address = (parallel.master_addr, parallel.data_parallel_rpc_port)
    deadline = time.monotonic() + parallel.rendezvous_timeout_s
    while True:
        try:
            conn = PickleConnection(Client(address, authkey=parallel.rpc_secret.encode()))
            break
        except (ConnectionRefusedError, ConnectionResetError, TimeoutError, OSError) as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"rank {rank}: the engine core at {address[0]}:{address[1]} did not "
                    f"listen within {parallel.rendezvous_timeout_s:.0f} s ({exc}); start "
                    "node 0 (`deepinfer serve`) or check --master-addr / "
                    "--data-parallel-rpc-port.") from None
            time.sleep(0.2)
    conn.send(("hello", rank, local_rank, os.getpid()))
    if not conn.poll(max(1.0, deadline - time.monotonic())):
        raise TimeoutError(f"rank {rank}: the engine core accepted the connection and sent "
                           "no configuration in time.")
    kind, args = conn.recv()
    return conn, args
