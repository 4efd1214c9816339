"""Expert parallelism on N GPUs of one host (issue 35): all-to-all dispatch/combine time, decode
tokens/s with DP=EP=N against N independent one-GPU engines, and EPLB's balancedness.

    python3 benchmarks/bench_ep_gpu.py [--gpus N] [--layers 4] [--json PATH]   # CUDA, NCCL
    python3 benchmarks/bench_ep_gpu.py --cpu --gpus 2 --json PATH              # smoke, gloo

One launcher spawns N ranks (torch.multiprocessing, spawn); each joins a process group (NCCL
on CUDA with GPU = rank, gloo on CPU) and sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (NVLink multicast off; also in the
parent's environment, which the children inherit). Rank 0 prints and writes the JSON (rewritten
after each stage, so a cut-short run keeps what it has). Stages:

1. link: a plain `all_to_all_single` of a large buffer (256 MiB per rank on CUDA); bandwidth =
   bytes each rank sends to the other ranks / time (N=1: a local copy, no link).
2. dispatch/combine: `ExpertParallelMoE.dispatch` / `.combine` (engine/moe/expert_parallel.py,
   the engine's own code: split-size exchange with its host sync, rows and slots out; rows
   back, reordered, weighted and summed in float32) on T tokens per rank x hidden H (bf16)
   x top-k, uniformly random distinct experts of 256 (no replicas): T = 128 (decode) and
   4,096 (prefill), H = 2048 and 7168, k = 6 and 8. Per call: milliseconds (max over ranks,
   median of repeats) and GB/s = bytes each rank sends to other ranks / time (`_moved_GBps`:
   all rows, those staying on the rank too; the only rate at N=1). Our payload is
   one row per (token, k) pair; DeepEP sends a token once per destination rank (FP8 dispatch,
   bf16 combine); its published intranode anchor, ~153 (dispatch) / ~158 (combine) GB/s per
   rank at EP8 on H800 NVLink, is printed beside ours: an anchor, not our hardware.
3. decode: DeepSeek-V2-Lite's shapes with random weights (benchmarks/gpu_deepseek.py's builder,
   the same seed on every rank; `--layers` keeps the first layers), B requests per rank
   (`--batch`, default 128) of `--prompt` tokens, `--new-tokens` greedy new tokens, timed once
   every request has its first token (as gpu_decode.py). First each rank runs its own plain
   `EngineCore` (N independent one-GPU engines, CUDA graphs, the same total work); then the
   experts are split over the ranks (`enable_expert_parallel`, `--redundant` extra slots,
   default N) and each rank runs an engine in lockstep: every step the ranks agree (all_reduce)
   whether anyone has work, a rank without any runs the idle MoE pass. With N > 1 the EP
   engine runs eager and without async scheduling (the split sizes are host syncs, as the
   engine's DP workers do); with N = 1 it keeps CUDA graphs (the one-GPU EP code path vs the
   plain engine); with N > 1 the independent engines also run eager and blocking
   (`independent_eager`), which separates the graphs' gain from the exchange's cost. Total
   tokens/s = tokens of all ranks / the slowest rank's time.
4. EPLB: the loads the EP run counted (summed over ranks) -> balancedness (max / mean rank
   load, 1.0 = even, mean over MoE layers) of the initial placement and of
   `rebalance_experts`' placement; then the weights really move (`ExpertParallel.rebalance`,
   timed) and the EP decode runs again.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepinfer.engine.dp_executor import CHILD_ENV, free_port  # noqa: E402
from gpu_deepseek import V2_LITE, build_models  # noqa: E402
from gpu_decode import _random_prompts, write_model_dir  # noqa: E402

# gpu_decode / gpu_deepseek put the checkout first on sys.path after deepinfer moved it last:
# its kernels/ would shadow HF's `kernels` distribution, which transformers imports
sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) != ROOT] + [str(ROOT)]

DEEPEP_ANCHOR = {"source": "DeepEP README, intranode normal kernels, EP8, H800 NVLink "
                           "(~160 GB/s): dispatch FP8, combine bf16",
                 "dispatch_GBps": 153.0, "combine_GBps": 158.0}
NUM_EXPERTS = 256
TINY_V2 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=32, qk_rope_head_dim=16,
               qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024,
               initializer_range=0.1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=None,
                        help="ranks (default: torch.cuda.device_count(); 2 with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, tiny sizes (smoke)")
    parser.add_argument("--layers", type=int, default=4, help="V2-Lite layers kept (27: all)")
    parser.add_argument("--batch", type=int, default=128, help="decode requests per rank")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--redundant", type=int, default=None,
                        help="redundant expert slots per MoE layer (default: N, or what "
                        "makes the slots split evenly over the ranks)")
    parser.add_argument("--repeats", type=int, default=20, help="timed dispatch/combine calls")
    parser.add_argument("--skip", default="", help="comma list of stages to skip: "
                        "link,a2a,decode")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.gpus is None:
        args.gpus = 2 if args.cpu else max(torch.cuda.device_count(), 1)
    if args.cpu:   # tiny sizes: the smoke mode checks the code runs and the numbers are sane
        args.layers, args.batch = min(args.layers, 3), min(args.batch, 4)
        args.prompt, args.new_tokens = min(args.prompt, 8), min(args.new_tokens, 6)
        args.repeats = min(args.repeats, 3)
    return args


class Rank:
    """This process's place: rank, world, device; timing and reductions over the group."""

    def __init__(self, rank: int, world: int, cpu: bool, port: int):
        self.rank, self.world = rank, world
        if cpu:
            self.device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        else:
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=300),
                                **({} if cpu else {"device_id": self.device}))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def reduce(self, value: float, op=dist.ReduceOp.MAX) -> float:
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return float(tensor.item())

    def timed(self, fn, repeats: int) -> float:
        """Median over repeats of the slowest rank's seconds for fn() (3 warm-up calls; the
        ranks start each call together)."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            dist.barrier()
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(self.reduce(time.perf_counter() - start))
        return statistics.median(times)


def link_bandwidth(me: Rank, cpu: bool) -> dict:
    """Plain all_to_all_single of a large bf16 buffer: GB/s each rank sends to the others."""
    numel = (1 << 20 if cpu else 128 << 20) // me.world * me.world   # 2 MiB / 256 MiB
    src = torch.randn(numel, device=me.device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = me.timed(lambda: dist.all_to_all_single(dst, src), 3 if cpu else 10)
    remote = numel * 2 * (me.world - 1) / me.world
    return {"buffer_MiB": numel * 2 / 2 ** 20, "ms": 1e3 * seconds,
            "remote_GBps": remote / seconds / 1e9, "total_GBps": numel * 2 / seconds / 1e9}


def dispatch_combine(me: Rank, tokens: int, hidden: int, top_k: int, repeats: int) -> dict:
    """`ExpertParallelMoE.dispatch` / `.combine` at one size (module doc, stage 2)."""
    from deepinfer.engine.moe.expert_parallel import EPGroup, ExpertParallelMoE

    ep = EPGroup(me.rank, me.world, dist.group.WORLD)
    experts = NUM_EXPERTS // me.world * me.world   # 256 on 1, 2, 4, 8 ranks
    module = SimpleNamespace(gate_weight=torch.empty(experts, 1, device=me.device),
                             routing=SimpleNamespace(num_experts=experts, top_k=top_k))
    layer = ExpertParallelMoE(module, ep, torch.arange(experts),
                              torch.zeros(experts, dtype=torch.int64, device=me.device), 1)
    gen = torch.Generator(device=me.device).manual_seed(1000 + me.rank)
    x = torch.randn(tokens, hidden, device=me.device, generator=gen).to(torch.bfloat16)
    weights, ids = torch.rand(tokens, experts, device=me.device, generator=gen).topk(top_k)
    physical = layer.log2phy[ids.reshape(-1), 0]
    received, _, route = layer.dispatch(x, physical, top_k)
    dispatch_s = me.timed(lambda: layer.dispatch(x, physical, top_k), repeats)
    combine_s = me.timed(lambda: layer.combine(received, route, weights, x.dtype), repeats)
    out = layer.combine(received, route, weights, x.dtype)   # y = x: sum_k w_k x exactly
    expected = (weights.sum(-1, keepdim=True) * x.float()).to(x.dtype)
    error = (out.float() - expected.float()).abs().max().item()
    dest = physical // layer.per_rank
    remote_rows = me.reduce(int((dest != me.rank).sum()), dist.ReduceOp.SUM) / me.world
    remote_bytes = remote_rows * hidden * 2
    moved_bytes = tokens * top_k * hidden * 2   # with the rows that stay on this rank
    return {"tokens": tokens, "hidden": hidden, "top_k": top_k,
            "dispatch_ms": 1e3 * dispatch_s, "combine_ms": 1e3 * combine_s,
            "remote_MB_per_rank": remote_bytes / 1e6,
            "dispatch_GBps": remote_bytes / dispatch_s / 1e9,
            "combine_GBps": remote_bytes / combine_s / 1e9,
            "dispatch_moved_GBps": moved_bytes / dispatch_s / 1e9,
            "combine_moved_GBps": moved_bytes / combine_s / 1e9,
            "max_abs_error_vs_local": me.reduce(error)}


def build_v2_lite(args, me: Rank):
    """(hf_config, deepinfer model, model dir) of V2-Lite's shapes (tiny on CPU), random."""
    from transformers import DeepseekV2Config

    shape = {**V2_LITE, **(TINY_V2 if args.cpu else {}), "num_hidden_layers": args.layers}
    hf_config = DeepseekV2Config(**shape)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    _, model = build_models(hf_config, with_hf=False, device=str(me.device), dtype=dtype)
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix=f"ep-bench-r{me.rank}-")),
                                hf_config)
    return hf_config, model, model_dir


def build_engine(args, me: Rank, model_dir: Path, model, *, lockstep: bool):
    """A rank's EngineCore over `model`; lockstep (EP over several ranks, whose split sizes
    are host syncs): eager and blocking steps, as the engine's DP workers run."""
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.engine_core import EngineCore

    blocks = args.batch * (-(-(args.prompt + args.new_tokens + 16) // 16)) + 16
    config = EngineConfig().with_fields(
        model=str(model_dir), device=str(me.device),
        dtype="float32" if args.cpu else "bfloat16",
        max_model_len=args.prompt + args.new_tokens + 16, enforce_eager=lockstep or args.cpu,
        enable_prefix_caching=False, num_blocks=blocks, block_size=16,
        max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.prompt),
        max_waiting_requests=max(4096, args.batch), kv_store="none")
    if lockstep:
        config = config.with_fields(async_scheduling=False)
    start = time.perf_counter()
    core = EngineCore(config, model=model)
    return core, time.perf_counter() - start


class Lockstep:
    """Steps the rank's engine; with EP over several ranks every step is collective: the
    ranks agree whether anyone has work and a rank without any runs the idle MoE pass."""

    def __init__(self, me: Rank, core, ep):
        self.me, self.core, self.ep = me, core, ep
        self.collective = ep is not None and me.world > 1

    def anyone(self, mine: bool) -> bool:
        return bool(self.me.reduce(int(mine))) if self.collective else mine

    def run(self, prompts, new_tokens: int) -> tuple[float, int, int, list]:
        """(seconds after every rank's requests have their first token, tokens this rank made
        in that window, steps, each request's token ids in prompt order)."""
        from deepinfer.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        requests = [self.core.make_request(prompt, params) for prompt in prompts]
        for request in requests:
            self.core.add_request(request)
        tokens = {r.request_id: [] for r in requests}
        total = 0
        while self.anyone(any(not t for t in tokens.values())):
            total += self._collect(self._one_step(), tokens)
        dist.barrier()
        self.me.sync()
        start, before, steps = time.perf_counter(), total, 0
        while self.anyone(self.core.has_unfinished_requests()):
            total += self._collect(self._one_step(), tokens)
            steps += 1
        self.me.sync()
        seconds = time.perf_counter() - start
        return seconds, total - before, steps, [tokens[r.request_id] for r in requests]

    @staticmethod
    def _collect(outputs, tokens: dict) -> int:
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        return sum(len(out.new_token_ids) for out in outputs)

    def _one_step(self) -> list:
        if self.core.has_unfinished_requests():
            outputs = self.core.step()
        else:
            outputs = []
            if self.collective:
                self.ep.run_idle_step()
        if self.ep is not None:
            self.ep.end_step()
        return outputs


def decode_run(args, me: Rank, core, ep, vocab: int, reference: list | None = None
               ) -> tuple[dict, list]:
    """One timed decode workload (module doc, stage 3) -> (results, this rank's token ids per
    request). With `reference` (the independent engines' ids): the share of requests, over all
    ranks, whose greedy tokens are the same (float32 on CPU: all; bf16: rounding may differ)."""
    prompts = _random_prompts(args.batch, args.prompt, vocab, 1000 + me.rank)
    seconds, tokens, steps, ids = Lockstep(me, core, ep).run(prompts, args.new_tokens)
    slowest = me.reduce(seconds)
    all_tokens = me.reduce(tokens, dist.ReduceOp.SUM)
    out = {"tok_s": all_tokens / slowest, "tok_s_per_rank": all_tokens / slowest / me.world,
           "step_ms": 1e3 * slowest / max(steps, 1), "tokens": int(all_tokens), "steps": steps}
    if reference is not None:
        same = sum(a == b for a, b in zip(ids, reference))
        out["same_tokens_as_independent"] = me.reduce(same, dist.ReduceOp.SUM) / (
            len(ids) * me.world)
    return out, ids


def eplb_balance(me: Rank, ep) -> dict:
    """Balancedness (max / mean rank load, mean over layers) of the run's own routing: the
    current placement and `rebalance_experts`' (module doc, stage 4)."""
    from deepinfer.engine.moe.eplb import balancedness, rebalance_experts

    load = ep.loads.window_load()
    if me.world > 1:
        dist.all_reduce(load)
    load = load.cpu()
    placement = ep.placement()
    count = torch.stack([torch.bincount(p, minlength=ep.num_experts) for p in placement])
    before = balancedness(load, placement, count, me.world)
    groups = ep.num_groups if ep.num_experts % max(ep.num_groups, 1) == 0 else 1
    phy2log, _, new_count = rebalance_experts(load, ep.num_physical, groups, 1, me.world)
    after = balancedness(load, phy2log, new_count, me.world)
    return {"routed_pairs": int(load.sum()), "before_mean": before.mean().item(),
            "before_worst_layer": before.max().item(), "eplb_mean": after.mean().item(),
            "eplb_worst_layer": after.max().item()}


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_stages(args, me: Rank, results: dict, save) -> None:
    from deepinfer.engine.moe.expert_parallel import EPGroup, enable_expert_parallel

    start = time.perf_counter()
    hf_config, model, model_dir = build_v2_lite(args, me)
    experts = hf_config.n_routed_experts
    redundant = args.redundant if args.redundant is not None else (-experts) % me.world or me.world
    results["decode_setup"] = {"layers": args.layers, "batch_per_rank": args.batch,
                               "prompt": args.prompt, "new_tokens": args.new_tokens,
                               "redundant": redundant,
                               "model_build_s": time.perf_counter() - start}
    vocab, reference = hf_config.vocab_size, None
    # N independent engines as deployed (CUDA graphs, async scheduling); with N > 1 on CUDA
    # also eager and blocking, the EP engine's mode, to tell graphs from the exchange's cost
    for name, lockstep in (("independent", False), ("independent_eager", True)):
        if lockstep and (me.world == 1 or args.cpu):
            continue
        core, ready_s = build_engine(args, me, model_dir, model, lockstep=lockstep)
        run, ids = decode_run(args, me, core, None, vocab, reference)
        reference = reference or ids
        results[name] = {**run, "engine_ready_s": ready_s}
        _show(me, name, results[name])
        save()
        core.close()
        core = None
        free()
    ep = enable_expert_parallel(model, EPGroup(me.rank, me.world, dist.group.WORLD),
                                redundant, window_steps=1 << 16)
    free()
    core, ready_s = build_engine(args, me, model_dir, model, lockstep=me.world > 1)
    ep.loads.window.zero_()   # the warm-up's forwards are no routing of the workload
    ep.loads.step_load.zero_()
    run, _ = decode_run(args, me, core, ep, vocab, reference)
    results["dp_ep"] = {**run, "engine_ready_s": ready_s, "eager": me.world > 1}
    _show(me, "DP=EP", results["dp_ep"])
    results["eplb"] = eplb_balance(me, ep)
    _show(me, "EPLB balancedness", results["eplb"])
    save()
    dist.barrier()
    me.sync()
    moved = time.perf_counter()
    ep.rebalance()
    me.sync()
    results["eplb"]["rebalance_s"] = me.reduce(time.perf_counter() - moved)
    results["dp_ep_after_eplb"], _ = decode_run(args, me, core, ep, vocab, reference)
    _show(me, "DP=EP after EPLB", results["dp_ep_after_eplb"])
    results["dp_ep_vs_independent"] = results["dp_ep"]["tok_s"] / results["independent"]["tok_s"]
    save()
    core.close()


def _show(me: Rank, name: str, values) -> None:
    if me.rank == 0:
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in values.items()}
        print(f"{name}: {json.dumps(shown)}", flush=True)


def rank_main(rank: int, world: int, args, port: int) -> None:
    os.environ.update(CHILD_ENV)
    me = Rank(rank, world, args.cpu, port)
    skip = set(filter(None, args.skip.split(",")))
    results: dict = {"ranks": world, "backend": dist.get_backend(), "torch": torch.__version__,
                     "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
                     "env": {k: os.environ.get(k) for k in CHILD_ENV},
                     "deepep_anchor": DEEPEP_ANCHOR}

    def save():
        if rank == 0 and args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))

    try:
        if "link" not in skip:
            results["link"] = link_bandwidth(me, args.cpu)
            _show(me, "all_to_all_single", results["link"])
            save()
        if "a2a" not in skip:
            sizes = ((16, 64), (32, 64)) if args.cpu else ((128, 4096), (2048, 7168))
            results["dispatch_combine"] = rows = []
            for tokens in sizes[0]:
                for hidden in sizes[1]:
                    for top_k in (6, 8):
                        repeats = args.repeats if tokens <= 128 else max(3, args.repeats // 4)
                        rows.append(dispatch_combine(me, tokens, hidden, top_k, repeats))
                        _show(me, "dispatch/combine", rows[-1])
                        save()
            free()
        if "decode" not in skip:
            decode_stages(args, me, results, save)
        save()
        if rank == 0:
            print_table(results)
            if args.cpu:
                smoke_checks(results)
    finally:
        dist.destroy_process_group()


def smoke_checks(results: dict) -> None:
    """The smoke mode's correctness: combine(dispatch(x)) == sum_k w_k x up to bf16 rounding;
    the EP engine's float32 greedy tokens == the independent engines'; EPLB no worse."""
    errors = [r["max_abs_error_vs_local"] for r in results.get("dispatch_combine", [])]
    assert all(e <= 0.05 for e in errors), f"dispatch/combine differs from local: {errors}"
    if "dp_ep" in results:
        for key in ("dp_ep", "dp_ep_after_eplb"):
            assert results[key]["same_tokens_as_independent"] == 1.0, (key, results[key])
        assert results["eplb"]["eplb_mean"] <= results["eplb"]["before_mean"] + 1e-6
    print("smoke checks passed", flush=True)


def print_table(results: dict) -> None:
    rows = results.get("dispatch_combine", [])
    link = results.get("link", {})
    print(f"\nranks {results['ranks']} ({results['backend']}, {results['device']}); plain "
          f"all_to_all: {link.get('remote_GBps', float('nan')):.1f} GB/s remote per rank; "
          f"DeepEP anchor (H800, EP8): dispatch {DEEPEP_ANCHOR['dispatch_GBps']} / combine "
          f"{DEEPEP_ANCHOR['combine_GBps']} GB/s")
    print("| tokens/rank | hidden | top-k | dispatch ms | combine ms | dispatch GB/s | "
          "combine GB/s | moved GB/s d/c |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['hidden']} | {r['top_k']} | {r['dispatch_ms']:.3f} | "
              f"{r['combine_ms']:.3f} | {r['dispatch_GBps']:.1f} | {r['combine_GBps']:.1f} | "
              f"{r['dispatch_moved_GBps']:.1f}/{r['combine_moved_GBps']:.1f} |")
    if "dp_ep" in results:
        eager = results.get("independent_eager", {}).get("tok_s")
        print(f"decode tok/s: {results['ranks']} independent engines "
              f"{results['independent']['tok_s']:.1f}"
              + (f" (eager {eager:.1f})" if eager else "")
              + f", DP=EP {results['dp_ep']['tok_s']:.1f} "
              f"(x{results['dp_ep_vs_independent']:.2f}), after EPLB "
              f"{results['dp_ep_after_eplb']['tok_s']:.1f}; balancedness "
              f"{results['eplb']['before_mean']:.3f} -> {results['eplb']['eplb_mean']:.3f}",
              flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the smoke mode", file=sys.stderr)
        return 2
    if not args.cpu and args.gpus > torch.cuda.device_count():
        print(f"--gpus {args.gpus} but {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    os.environ.update(CHILD_ENV)   # inherited by the spawned ranks (set there again too)
    port = free_port("127.0.0.1")
    print(f"bench_ep_gpu: {args.gpus} ranks on {'cpu/gloo' if args.cpu else 'cuda/nccl'}; "
          f"{vars(args)}", flush=True)
    mp.spawn(rank_main, args=(args.gpus, args, port), nprocs=args.gpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
