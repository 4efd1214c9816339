"""`deepinfer serve --headless`: a node other than node 0 runs only its ranks, which join node
0's engine core over the control channel (engine/dp_rpc.py: layout, why that channel, the
handshake) and the ranks' process group.
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import wait

from deepinfer.engine.config import EngineConfig, ParallelConfig
from deepinfer.engine.dp_executor import worker_main
from deepinfer.engine.dp_rpc import connect_to_core


def remote_rank_main(parallel: ParallelConfig, rank: int, local_rank: int) -> None:
    """A rank process of a headless node: the handshake, then `worker_main`."""
    try:
        conn, args = connect_to_core(parallel, rank, local_rank)
    except Exception as exc:   # noqa: BLE001 - the launcher reports the exit code
        print(f"deepinfer: rank {rank}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    worker_main(args, conn)   # returns only when the rank failed or the engine core is gone
    sys.exit(1)


def run_headless(config: EngineConfig) -> int:
    """`deepinfer serve --headless`: spawn this node's ranks (remote_rank_main), supervise
    them until they all exit. A rank that exits with an error ends the others (their
    collectives cannot go on) and sets the exit code; SIGTERM / SIGINT end them all.
    Returns the exit code (0 when every rank stopped cleanly, at the engine core's shutdown).
    """
    import torch.multiprocessing as mp

    parallel = config.parallel
    start, local = parallel.start_rank, parallel.local_size
    ctx = mp.get_context("spawn")
    processes = [ctx.Process(target=remote_rank_main, args=(parallel, start + i, i),
                             name=f"deepinfer-rank{start + i}") for i in range(local)]
    for process in processes:
        process.start()
    print(f"deepinfer: node {parallel.node_rank}: ranks {start}..{start + local - 1} (pids "
          f"{[p.pid for p in processes]}) joining {parallel.master_addr}:"
          f"{parallel.data_parallel_rpc_port}", flush=True)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    code = 0
    alive = list(processes)
    while alive:
        wait([p.sentinel for p in alive], timeout=0.5)
        for process in [p for p in alive if not p.is_alive()]:
            alive.remove(process)
            process.join()
            if process.exitcode and not code:
                code = 1
                print(f"deepinfer: {process.name} exited with code {process.exitcode}; "
                      "stopping this node's ranks", file=sys.stderr, flush=True)
        if (code or stopping) and alive:
            for process in alive:
                process.terminate()
            for process in alive:
                process.join(5)
                if process.is_alive():
                    process.kill()
            code = code or 128 + stopping[0]
            break
    return code
