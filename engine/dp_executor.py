"""`MultiProcExecutor`: the `Executor` (engine/executor.py) over one worker process per rank,
for attention data parallelism and expert parallelism.

Each rank (spawned with torch.multiprocessing's "spawn" context, supervised here):
- joins the process group (`torch.distributed`, gloo on CPU, NCCL on CUDA with GPU = local
  rank; rendezvous tcp://master_addr:master_port; collectives time out after rank_timeout_s);
- loads the model itself, keeps its slice of the routed experts (EP,
  engine/moe/expert_parallel.py), builds its own KV cache and `ModelRunner` (an in-process
  `UniProcExecutor`);
- per step receives its own `SchedulerOutput` (the DP scheduler's `per_rank[rank]`,
  engine/dp_scheduler.py) over a pipe, runs it — or, with nothing scheduled, an idle pass
  through the MoE collectives — counts expert loads, runs EPLB every eplb_interval_steps, and
  sends back its `ModelRunnerOutput`.

Several nodes (engine/dp_rpc.py, engine/dp_node.py): this executor runs on node 0 with its
ranks [0, L0); the ranks of the other nodes (spawned there by `deepinfer serve --headless`)
connect to it over TCP and are driven through those connections exactly like the local pipes.

Supervision: the executor waits on the ranks' connections and the local processes' sentinels
together; a rank that exits (a remote one: its connection closes), reports an error, or does
not answer within rank_timeout_s raises `EngineDeadError` naming the rank (a failed collective
leaves the ranks out of step, so no retry), and `shutdown()` ends the workers (the other
nodes' launchers stop when their ranks do). A rank of another node that does not connect
within rendezvous_timeout_s fails the start the same way. Steps run blocking (the core's async
scheduling is off with this executor). The KV store bridge is not supported here.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.dp_scheduler import DPSchedulerOutput, merge_runner_outputs
from deepinfer.engine.errors import EngineDeadError
from deepinfer.engine.executor import UniProcExecutor
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# NVLink multicast / symmetric memory stay off in every rank (the lent machines' rule)
STARTUP_TIMEOUT_S = 1800.0   # loading a large checkpoint on every rank takes minutes
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class WorkerArgs:
    config: EngineConfig
    model_dir: str
    device: str            # "cpu" or "cuda"
    dtype: str             # torch dtype name
    eos_token_ids: frozenset[int]
    rank: int
    local_rank: int
    world: int
    master_port: int
    ep_backend: str = "all_to_all"   # resolved on node 0 (engine/moe/ep_backends.py)


def free_port(addr: str) -> int:
    with socket.socket() as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


class MultiProcExecutor:
    """One worker process per local rank (module doc).

    Args:
        config: the engine configuration (`config.parallel`: ranks, EP, EPLB, rendezvous).
        model_dir: the HF model directory every rank loads.
        device, dtype: as the core resolved them.
        eos_token_ids: masked while a request is below its min_tokens.
    Attributes:
        num_blocks_per_rank: each rank's KV cache blocks (each its own KV cache manager);
        num_blocks: their minimum; processes: the workers (rank order).
    """

    def __init__(self, config: EngineConfig, model_dir, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: frozenset[int]):
        from deepinfer.engine.dp_rpc import RankListener
        from deepinfer.engine.moe.ep_backends import resolve_ep_backend

        parallel = config.parallel
        self.timeout_s = parallel.rank_timeout_s
        port = parallel.master_port or free_port(parallel.master_addr)
        world, local = parallel.data_parallel_size, parallel.local_size
        ctx = mp.get_context("spawn")
        self.processes, self.conns, self.dead = [], [], False
        self.remote_pids: dict[int, int] = {}   # rank of another node -> its pid there
        ep_backend = (resolve_ep_backend(parallel.ep_backend, device.type)
                      if parallel.enable_expert_parallel else "all_to_all")
        listener = RankListener(parallel) if local < world else None

        def worker_args(rank: int, local_rank: int) -> WorkerArgs:
            return WorkerArgs(config, str(model_dir), device.type, str(dtype).split(".")[-1],
                              eos_token_ids, rank, local_rank, world, port, ep_backend)

        for rank in range(local):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=worker_main, args=(worker_args(rank, rank), child),
                                  daemon=True, name=f"deepinfer-rank{rank}")
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        try:
            if listener is not None:
                joined = listener.accept_ranks(list(range(local, world)),
                                               parallel.rendezvous_timeout_s, worker_args)
                self.conns += [joined[rank][0] for rank in range(local, world)]
                self.remote_pids = {rank: joined[rank][1] for rank in range(local, world)}
            ready = self._collect("start", STARTUP_TIMEOUT_S)
        except BaseException:
            self.dead = True
            self.shutdown()
            raise
        finally:
            if listener is not None:
                listener.close()
        self.num_blocks_per_rank = [r["num_blocks"] for r in ready]
        self.num_blocks = min(self.num_blocks_per_rank)
        self.block_bytes = ready[0]["block_bytes"]
        self.kv_cache_spec = ready[0]["kv_cache_spec"]
        logger.info("%d ranks up (%d here, pids %s; %d on other nodes), KV blocks per rank %s",
                    world, local, [p.pid for p in self.processes], world - local,
                    self.num_blocks_per_rank)

    def _collect(self, what: str, timeout_s: float | None = None) -> list:
        """Each rank's answer; EngineDeadError when a rank dies, fails or is late (after
        `timeout_s`, default rank_timeout_s)."""
        try:
            return self._answers(what, timeout_s or self.timeout_s)
        except EngineDeadError:
            self.dead = True   # the others may sit in a collective: shutdown kills them
            raise

    def _answers(self, what: str, timeout_s: float) -> list:
        answers: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(self.conns):
            pending = [r for r in range(len(self.conns)) if r not in answers]
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError(f"rank {pending[0]} did not finish {what} within "
                                      f"{timeout_s:.0f} s; the engine stops.")
            ready = wait([self.conns[r] for r in pending]
                         + [self.processes[r].sentinel for r in pending
                            if r < len(self.processes)], timeout=left)
            for rank in pending:
                conn = self.conns[rank]
                if conn in ready or conn.poll():
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        status, payload = "died", None
                    if status == "error":
                        self._raise_if_a_rank_died(what, grace_s=2.0)   # the likely cause
                        raise EngineDeadError(f"rank {rank} failed during {what}: {payload}")
                    if status == "ok":
                        answers[rank] = payload
                        continue
                    if rank >= len(self.processes):   # a rank of another node
                        self._raise_if_a_rank_died(what, grace_s=1.0)
                        raise EngineDeadError(
                            f"rank {rank} (pid {self.remote_pids.get(rank)} on another node) "
                            f"closed its connection during {what}: it died or its node "
                            "stopped; the engine stops (restart every node).")
                if rank >= len(self.processes):
                    continue
                process = self.processes[rank]
                if not process.is_alive():
                    process.join(1)
                    raise EngineDeadError(
                        f"rank {rank} (pid {process.pid}) exited with code {process.exitcode} "
                        f"during {what}; the engine stops (restart it).")
        return [answers[r] for r in range(len(self.conns))]

    def _raise_if_a_rank_died(self, what: str, grace_s: float) -> None:
        """A collective fails on the surviving ranks when a peer dies: name the dead one (a
        local process that exited, or a rank of another node whose connection closed)."""
        remote = self.conns[len(self.processes):]
        wait([p.sentinel for p in self.processes] + remote, timeout=grace_s)
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                process.join(1)
                raise EngineDeadError(
                    f"rank {rank} (pid {process.pid}) exited with code {process.exitcode} "
                    f"during {what}; the engine stops (restart it).")
        for rank, conn in enumerate(remote, start=len(self.processes)):
            try:
                if conn.poll():
                    conn.recv()   # a survivor's own error (it exits after): not the dead one
                    continue
            except (EOFError, OSError):
                raise EngineDeadError(
                    f"rank {rank} (pid {self.remote_pids.get(rank)} on another node) closed "
                    f"its connection during {what}: it died or its node stopped; the engine "
                    "stops (restart every node).") from None

    def _send(self, messages: list) -> None:
        for rank, (conn, message) in enumerate(zip(self.conns, messages)):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionError, EOFError, OSError):
                self.dead = True
                if rank >= len(self.processes):
                    raise EngineDeadError(f"rank {rank} (pid {self.remote_pids.get(rank)} on "
                                          "another node) is gone; the engine stops.") from None
                raise EngineDeadError(f"rank {rank} (pid {self.processes[rank].pid}) is gone "
                                      f"(exit code {self.processes[rank].exitcode}); the engine "
                                      "stops.") from None

    def warm_up(self, max_num_seqs: int, max_model_len: int) -> None:
        self._send([("warm_up", (max_num_seqs, max_model_len))] * len(self.conns))
        self._collect("warm-up")

    def execute(self, scheduler_output: SchedulerOutput, *, non_block: bool
                ) -> ModelRunnerOutput:
        per_rank = (scheduler_output.per_rank if isinstance(scheduler_output, DPSchedulerOutput)
                    else [scheduler_output] + [SchedulerOutput()] * (len(self.conns) - 1))
        self._send([("execute", out) for out in per_rank])
        return merge_runner_outputs(self._collect("a step"))

    def call(self, method: str) -> list:
        """Run `Worker.<method>()` on every rank (tests, stats); their results."""
        self._send([("call", method)] * len(self.conns))
        return self._collect(method)

    def abort(self) -> None:
        pass

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (OSError, ValueError):
                pass   # the other nodes' ranks see their connection close and stop
        for process in self.processes:
            process.join(0 if self.dead else 5)
            if process.is_alive():
                process.kill()
                process.join(5)
        for conn in self.conns:
            conn.close()
        self.conns = []

    def kv_block_header(self):
        raise RuntimeError("the KV store bridge is not supported with data parallelism.")

    def stage_kv_blocks(self, request_id, block_hashes, payloads) -> None:
        raise RuntimeError("the KV store bridge is not supported with data parallelism.")

    def drop_staged_kv_blocks(self, request_ids) -> None:
        pass

    def take_kv_reads(self) -> list:
        return []


class EPLBSchedule:
    """After each step of a rank with expert parallelism: the idle MoE pass when the rank had
    no tokens (several ranks only), the load window's step, the commit of a weight move in
    flight once every rank received its weights, and EPLB every eplb_interval_steps (which
    starts a move; all ranks run the same steps, so they rebalance and commit together)."""

    def __init__(self, ep, parallel):
        self.ep, self.parallel, self.num_steps = ep, parallel, 0

    def after_step(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.total_num_scheduled_tokens == 0 and self.ep.ep.world > 1:
            self.ep.run_idle_step()   # the other ranks' MoE collectives need this one
        self.ep.end_step()
        self.num_steps += 1
        if self.ep.pending_move is not None:   # this step ran while the weights moved
            stats = self.ep.pending_move.stats
            stats["tokens_during_move"] = (stats.get("tokens_during_move", 0)
                                           + scheduler_output.total_num_scheduled_tokens)
        self.ep.commit_if_moved(self.num_steps)
        if self.parallel.enable_eplb and self.num_steps % self.parallel.eplb_interval_steps == 0:
            self.ep.start_rebalance(self.num_steps)


class LocalEPExecutor(UniProcExecutor):
    """`UniProcExecutor` with the one-rank expert-parallel path: the model's experts behind
    their placement (replicas, EPLB moves) and the load counters, no collectives."""

    def __init__(self, config: EngineConfig, model, device, dtype, eos_token_ids,
                 structured_output=None):
        from deepinfer.engine.moe.expert_parallel import EPGroup, enable_expert_parallel

        from deepinfer.engine.moe.ep_backends import resolve_ep_backend

        parallel = config.parallel
        self.expert_parallel = enable_expert_parallel(
            model, EPGroup(), parallel.num_redundant_experts, parallel.eplb_window_steps,
            parallel.num_nodes, resolve_ep_backend(parallel.ep_backend, device.type))
        self.eplb = EPLBSchedule(self.expert_parallel, parallel)
        super().__init__(config, model, device, dtype, eos_token_ids, structured_output)

    def execute(self, scheduler_output: SchedulerOutput, *, non_block: bool):
        output = super().execute(scheduler_output, non_block=non_block)
        self.eplb.after_step(scheduler_output)
        return output


def build_executor(config: EngineConfig, model, model_dir, device: torch.device,
                   dtype: torch.dtype, eos_token_ids: frozenset[int], structured_output):
    """The engine's executor: `MultiProcExecutor` for data_parallel_size > 1, else the
    in-process one (`LocalEPExecutor` with enable_expert_parallel)."""
    parallel = config.parallel
    if parallel.data_parallel_size > 1:
        if model is not None:
            raise ValueError("with data_parallel_size > 1 every rank loads the model itself; "
                             "pass a model directory, not a built model.")
        return MultiProcExecutor(config, model_dir, device, dtype, eos_token_ids)
    if parallel.enable_expert_parallel:
        return LocalEPExecutor(config, model, device, dtype, eos_token_ids, structured_output)
    return UniProcExecutor(config, model, device, dtype, eos_token_ids, structured_output)


class Worker:
    """One rank's side (runs in the worker process)."""

    def __init__(self, args: WorkerArgs):
        from deepinfer.engine import loader
        from deepinfer.engine.moe.expert_parallel import EPGroup, enable_expert_parallel
        from deepinfer.engine.structured.manager import grammar_manager

        import torch.distributed as dist

        parallel = args.config.parallel
        if args.device == "cuda":
            torch.cuda.set_device(args.local_rank)
            device = torch.device("cuda", args.local_rank)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{parallel.master_addr}:{args.master_port}", rank=args.rank,
            world_size=args.world, timeout=timedelta(seconds=parallel.rank_timeout_s))
        self.args, self.parallel = args, parallel
        dtype = getattr(torch, args.dtype)
        model = loader.load_model(args.model_dir, dtype, device)
        self.ep = None
        if parallel.enable_expert_parallel:
            # EPLB's background weight moves get a group of their own (module doc of
            # engine/moe/weight_moves.py)
            move_group = dist.new_group(list(range(args.world))) if args.world > 1 else None
            if move_group is not None:   # a first collective with every rank: NCCL then
                # allows the later batched point-to-point calls that involve only some ranks
                dist.all_reduce(torch.zeros(1, device=device), group=move_group)
            self.ep = enable_expert_parallel(
                model, EPGroup(args.rank, args.world, dist.group.WORLD, move_group),
                parallel.num_redundant_experts, parallel.eplb_window_steps,
                _eplb_nodes(parallel, args.world), args.ep_backend)
        tokenizer = loader.load_tokenizer(args.model_dir)
        structured = grammar_manager(tokenizer, model.vocab_size, args.eos_token_ids,
                                     args.config.model.structured_outputs_backend)
        config = args.config
        if self.ep is not None and args.world > 1:   # host syncs (split sizes) in every layer
            config = config.replace(model={"enforce_eager": True})
        self.executor = UniProcExecutor(config, model, device, dtype, args.eos_token_ids,
                                        structured)
        self.schedule = None if self.ep is None else EPLBSchedule(self.ep, parallel)

    def info(self) -> dict:
        return {"num_blocks": self.executor.num_blocks, "block_bytes": self.executor.block_bytes,
                "kv_cache_spec": self.executor.kv_cache_spec}

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.executor.execute(scheduler_output, non_block=False)
        if self.schedule is not None:
            self.schedule.after_step(scheduler_output)
        return output

    # ---- for tests and stats (Executor.call) ---------------------------------------------
    def expert_placement(self):
        return None if self.ep is None else self.ep.placement()

    def window_load(self):
        return None if self.ep is None else self.ep.loads.window_load().cpu()

    def num_rebalances(self) -> int:
        return 0 if self.ep is None else self.ep.num_rebalances

    def move_stats(self) -> list[dict]:
        """Per committed EPLB weight move: decision / commit step, bytes, seconds."""
        return [] if self.ep is None else self.ep.move_stats

    def experts_match_checkpoint(self) -> bool:
        """Whether every expert slot of this rank holds the checkpoint's weights of the
        logical expert its placement names (loads the checkpoint again: tests)."""
        from deepinfer.engine import loader
        from deepinfer.engine.moe.expert_parallel import decoder_moes
        from deepinfer.kernels.moe import dequantize_blocks

        if self.ep is None:
            return True
        full = loader.load_model(self.args.model_dir, getattr(torch, self.args.dtype), "cpu")
        per = self.ep.num_physical // self.args.world
        mine = slice(self.args.rank * per, (self.args.rank + 1) * per)
        for moe, reference in zip(self.ep.moes, decoder_moes(full)):
            experts = moe.expert_parallel.phys2log[mine]
            for name in ("w13", "w2"):   # FP8 experts: compared as the CPU model dequantized them
                held, scale = getattr(moe, name).data.cpu(), getattr(moe, f"{name}_scale")
                if scale is not None:
                    held = dequantize_blocks(held, scale.cpu(), reference.w13.dtype)
                if not torch.equal(held, getattr(reference, name).data[experts]):
                    return False
        return True


def _eplb_nodes(parallel, world: int) -> int:
    """Nodes for EPLB's hierarchical policy, which assumes the same ranks on every node: the
    nodes when node 0 (whose config every rank runs with) holds world / num_nodes ranks, else 1
    (uneven nodes: the global policy)."""
    return parallel.num_nodes if parallel.local_size * parallel.num_nodes == world else 1


def worker_main(args: WorkerArgs, conn) -> None:
    """A rank's process: build the `Worker`, then answer the executor until "stop"."""
    os.environ.update(CHILD_ENV)
    try:
        worker = Worker(args)
        conn.send(("ok", worker.info()))
    except BaseException:   # noqa: BLE001 - reported to the executor, which stops the engine
        conn.send(("error", traceback.format_exc(limit=8)))
        return
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return   # the engine is gone
        if kind == "stop":
            break
        try:
            if kind == "execute":
                result = worker.execute(payload)
            elif kind == "warm_up":
                result = worker.executor.warm_up(*payload)
            else:
                result = getattr(worker, payload)()
            conn.send(("ok", result))
        except BaseException:   # noqa: BLE001
            conn.send(("error", traceback.format_exc(limit=8)))
            return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    # a clean stop skips the interpreter's teardown of torch (1-4 s per rank on a busy CPU
    # box; `shutdown()` waits for it): the OS releases what the process holds
    logging.shutdown()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
