"""How much of an EPLB expert weight move overlaps with the steps that run meanwhile (CPU, gloo).

    python benchmarks/bench_eplb_move.py [--ranks 2] [--layers 6] [--hidden 1024] [--inter 256]

Each rank holds `--layers` MoE layers of 8 expert slots ([8, 2 * inter, hidden] + [8, hidden,
inter] float32, as `ExpertParallel` keeps them) and moves to a placement that swaps half of its
slots with the next rank (engine/moe/weight_moves.py `start_move`: the bytes below cross the
process group). A "step" is a fixed matmul loop (`--step-ms` on an idle core). Per rank:
- sync: post the move and wait at once (what a blocking move costs the step loop);
- async: post the move, run steps, and at each step boundary agree (all-reduce MIN) whether all
  ranks' transfers finished; commit then (the engine's path). Reports the steps that ran during
  the move, the time blocked in the commit's wait, and the steps' slowdown while the transfer
  runs beside them (gloo's transport threads and the unpacking share the cores) against the
  same number of steps run right after the commit;
overlap = 1 - (async blocked + extra step time during the move) / sync blocked; medians of
--trials (sync, async) pairs after one warm-up move.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.engine.moe.weight_moves import start_move  # noqa: E402

SLOTS = 8


def _layers(args, rank: int) -> list:
    gen = torch.Generator().manual_seed(rank)
    return [SimpleNamespace(w13=torch.randn(SLOTS, 2 * args.inter, args.hidden, generator=gen),
                            w2=torch.randn(SLOTS, args.hidden, args.inter, generator=gen),
                            w13_scale=None, w2_scale=None) for _ in range(args.layers)]


def _placements(world: int, layers: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Old: slot p holds expert p; new: each rank's second half swapped with the next rank's."""
    old = torch.arange(world * SLOTS)
    new = old.clone().view(world, SLOTS)
    half = SLOTS // 2
    new[:, half:] = torch.roll(new[:, half:], shifts=1, dims=0)
    return [old] * layers, new.flatten().expand(layers, -1).clone()


def _step(a: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        a = torch.tanh(a @ a)


def _sync_move(args, rank: int, old, new, group) -> dict:
    moes = _layers(args, rank)
    dist.barrier()
    move = start_move(moes, old, new, rank, args.ranks, group, 0)
    start = time.perf_counter()
    move.commit(moes, lambda moe, phys2log: None, in_place=False)
    return {"sync_blocked_s": time.perf_counter() - start,
            "bytes": move.stats["bytes_sent"] + move.stats["bytes_received"]}


def _async_move(args, rank: int, old, new, group, a: torch.Tensor, reps: int) -> dict:
    moes = _layers(args, rank)
    dist.barrier()
    move = start_move(moes, old, new, rank, args.ranks, group, 0)
    step_times = []
    while True:
        start = time.perf_counter()
        _step(a, reps)
        step_times.append(time.perf_counter() - start)
        done = torch.tensor([int(move.locally_done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            break
    start = time.perf_counter()
    move.commit(moes, lambda moe, phys2log: None, in_place=False)
    blocked_s = time.perf_counter() - start
    # the same number of steps right after, with no move beside them (the A/B baseline)
    dist.barrier()
    baseline_s = 0.0
    for _ in step_times:
        start = time.perf_counter()
        _step(a, reps)
        baseline_s += time.perf_counter() - start
        dist.all_reduce(torch.zeros(1))   # the same per-step collective as during the move
    return {"async_blocked_s": blocked_s, "steps": len(step_times),
            "step_extra_s": sum(step_times) - baseline_s, "transfer_s": move.stats["transfer_s"]}


def _rank(rank: int, args, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=120))
    move_group = dist.new_group(list(range(args.ranks)))
    old, new = _placements(args.ranks, args.layers)
    a = torch.randn(256, 256) * 0.01
    start = time.perf_counter()
    _step(a, 100)
    reps = max(1, int(100 * args.step_ms / 1e3 / (time.perf_counter() - start)))
    idle = []
    for _ in range(5):
        start = time.perf_counter()
        _step(a, reps)
        idle.append(time.perf_counter() - start)
    step_s = statistics.median(idle)
    _sync_move(args, rank, old, new, move_group)   # warm: connections, allocator
    trials = [(_sync_move(args, rank, old, new, move_group),
               _async_move(args, rank, old, new, move_group, a, reps))
              for _ in range(args.trials)]
    out = {"step_s": step_s, "bytes": trials[0][0]["bytes"]}
    for key in ("sync_blocked_s",):
        out[key] = statistics.median(t[0][key] for t in trials)
    for key in ("async_blocked_s", "steps", "step_extra_s", "transfer_s"):
        out[key] = statistics.median(t[1][key] for t in trials)
    results[rank] = out
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    from deepinfer.engine.dp_executor import free_port

    results = mp.Manager().dict()
    mp.spawn(_rank, args=(args, free_port("127.0.0.1"), results), nprocs=args.ranks)
    for rank in range(args.ranks):
        r = results[rank]
        hidden_cost = r["async_blocked_s"] + max(0.0, r["step_extra_s"])
        overlap = 1 - hidden_cost / r["sync_blocked_s"]
        print(f"rank {rank}: {r['bytes'] / 2**20:.0f} MiB moved; sync blocks "
              f"{r['sync_blocked_s'] * 1e3:.0f} ms; async: {r['steps']} steps of "
              f"{r['step_s'] * 1e3:.0f} ms ran during the {r['transfer_s'] * 1e3:.0f} ms "
              f"transfer, {r['step_extra_s'] * 1e3:+.0f} ms slower in all, commit blocked "
              f"{r['async_blocked_s'] * 1e3:.1f} ms -> overlap {overlap * 100:.0f}%")


if __name__ == "__main__":
    main()
