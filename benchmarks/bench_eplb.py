"""EPLB balance and speed: `engine.moe.eplb.rebalance_experts` against DeepSeek's greedy policy.

    python benchmarks/bench_eplb.py [--layers 61] [--skip-greedy] [--throughput]

Loads (per layer, per logical expert):
- recorded: routing counts from tiny random DeepSeek models run through the engine (the
  one-process expert-parallel path counts every routing choice, `ExpertLoadRecorder`): a V3-shaped
  router (256 experts, top-8, noaux_tc over 8 groups keeping 4, random e_score_correction_bias
  in [0, 0.5) as HF's bias would be after training) and a V2-Lite-shaped one (64 experts, top-6,
  greedy softmax); 4 MoE layers each, tiled to --layers. No real MoE checkpoint is available
  here: the skew comes from the random bias and the random router, not from real activations.
- synthetic: Zipf(s) expert popularity (s = 0.8, 1.2), randomly permuted per layer, Poisson
  counts; and all tokens on one expert.
Placements, per load and size:
- none: no EPLB, logical expert e on rank e // (E / ranks) (no replicas);
- greedy: DeepSeek's EPLB as published (replicate greedily, then greedy packing; loop by loop,
  written out below), global policy;
- ours global / ours hier.: `rebalance_experts` with 1 group (global) and with 8 groups over
  the nodes (hierarchical, the V3 deployment shape).
- lower bound: the best max / mean any placement reaches with the replica budget
  (`lower_bound`: a rank's share, the heaviest replica under the min-max replica counts, and the
  slots-per-rank pigeonhole terms); the last column is ours-global's gap to it (worst layer).
Balancedness = max / mean rank load (1.0 = perfect). Sizes: V3 256 experts + 32 redundant on 32
ranks (4 nodes), + 64 redundant on 64 ranks (8 nodes; 288 slots do not split over 64 ranks);
V2-Lite 64 experts + 16 redundant on 8 ranks (2 nodes). Time: median of 5 calls of
`rebalance_experts` on 256 experts x --layers layers (one thread).
--throughput: tokens/s of the tiny V3 model with data_parallel_size=2 + EP vs one process (CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.engine.moe.eplb import (balancedness, rebalance_experts,  # noqa: E402
                                       replicate_experts)

TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
            num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
            first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, max_position_embeddings=1024, initializer_range=0.1,
            tie_word_embeddings=False, n_shared_experts=1, num_nextn_predict_layers=0)


def greedy_reference(weight: torch.Tensor, num_replicas: int, num_gpus: int) -> torch.Tensor:
    """DeepSeek's global policy loop by loop: per-layer balancedness [layers]."""
    layers, num_log = weight.shape
    result = []
    for row in weight.tolist():
        count = [1] * num_log
        phy = list(range(num_log))
        for _ in range(num_log, num_replicas):
            e = max(range(num_log), key=lambda i: row[i] / count[i])
            phy.append(e)
            count[e] += 1
        items = [row[e] / count[e] for e in phy]
        per = num_replicas // num_gpus
        loads, sizes = [0.0] * num_gpus, [0] * num_gpus
        for i in sorted(range(len(items)), key=lambda i: -items[i]):
            g = min((g for g in range(num_gpus) if sizes[g] < per), key=loads.__getitem__)
            loads[g] += items[i]
            sizes[g] += 1
        result.append(max(loads) / (sum(loads) / num_gpus))
    return torch.tensor(result)


def lower_bound(weight: torch.Tensor, num_replicas: int, num_gpus: int) -> torch.Tensor:
    """The best max / mean rank load any placement can reach with this replica budget, per
    layer [layers] float32 (each expert's load split evenly over its replicas, as ours does):

    - mean: a rank's share (1.0);
    - replica bound: the heaviest replica, min over replica counts r (sum r = num_replicas,
      r_i >= 1) of max_i load_i / r_i; the greedy of `replicate_experts` attains that min
      (give the next replica to the highest load per replica), so r* comes from it;
    - slot bound, for those counts r*: each rank holds exactly P = num_replicas / num_gpus
      replicas, so among the j * num_gpus + 1 heaviest replicas some rank holds j + 1
      (pigeonhole; its load >= the j + 1 lightest of them), and the rank holding the heaviest
      replica also holds P - 1 others (>= the P - 1 lightest replicas).
    The first two hold for every placement; the slot term for the replica counts r* that both
    ours and DeepSeek's policy pick (another r could trade a higher replica bound for it)."""
    weight = weight.float()
    phy2log, _, count = replicate_experts(weight, num_replicas)
    replica = (weight / count).gather(1, phy2log).sort(dim=-1, descending=True).values
    per = num_replicas // num_gpus
    mean = weight.sum(-1) / num_gpus
    bound = torch.maximum(mean, replica[:, 0])
    for j in range(1, per):
        top = replica[:, :j * num_gpus + 1]
        bound = torch.maximum(bound, top[:, -(j + 1):].sum(-1))
    if per > 1:
        bound = torch.maximum(bound, replica[:, 0] + replica[:, -(per - 1):].sum(-1))
    return bound / mean.clamp_min(1e-12)


def no_eplb(weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    return (weight.view(weight.shape[0], num_gpus, -1).sum(-1).max(-1).values
            / (weight.sum(-1) / num_gpus))


def record_routing(num_experts: int, top_k: int, v3: bool, layers: int) -> torch.Tensor:
    """[layers, num_experts] routing counts of a tiny random model over 32 prompts x 64 tokens
    plus 16 generated tokens each (module doc), tiled to `layers`."""
    from transformers import DeepseekV2Config, DeepseekV3Config, AutoModelForCausalLM

    from deepinfer.engine.llm import LLM
    from deepinfer.engine.loader import load_tokenizer, resolve_model_dir
    from deepinfer.engine.sampling_params import SamplingParams

    tokenizer = load_tokenizer(resolve_model_dir(None, None))
    common = dict(TINY, vocab_size=len(tokenizer), n_routed_experts=num_experts,
                  num_experts_per_tok=top_k, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    if v3:
        config = DeepseekV3Config(**common, n_group=8, topk_group=4, q_lora_rank=32,
                                  routed_scaling_factor=2.5, norm_topk_prob=True)
    else:
        config = DeepseekV2Config(**common, q_lora_rank=None, topk_method="greedy")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=gen) * 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        llm = LLM(tmp, dtype="float32", device="cpu", enable_expert_parallel=True,
                  eplb_window_steps=100000, eplb_interval_steps=10**9, max_num_seqs=32,
                  max_num_batched_tokens=2048)
        prompts = [torch.randint(100, 40000, (64,), generator=gen).tolist() for _ in range(32)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        load = llm.engine_core.executor.expert_parallel.loads.window_load().float()
        llm.engine_core.close()
    reps = -(-layers // load.shape[0])
    return load.repeat(reps, 1)[:layers]


def zipf(layers: int, experts: int, s: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1).float() ** s
    rows = [base[torch.randperm(experts, generator=gen)] for _ in range(layers)]
    return torch.poisson(torch.stack(rows) * 4096 * 8 / base.sum(), generator=gen)


def one_hot(layers: int, experts: int) -> torch.Tensor:
    weight = torch.zeros(layers, experts)
    weight[:, 3] = 4096.0
    return weight


def report(name: str, weight: torch.Tensor, replicas: int, gpus: int, nodes: int,
           skip_greedy: bool) -> None:
    def mean_max(b):
        return f"{b.mean():.3f}/{b.max():.3f}"

    before = no_eplb(weight, gpus)
    ours_global = balancedness(weight, *rebalance_experts(weight, replicas, 1, 1, gpus)[::2],
                               gpus)
    p2l, _, cnt = rebalance_experts(weight, replicas, 8, nodes, gpus)
    ours_hier = balancedness(weight, p2l, cnt, gpus)
    greedy = "-" if skip_greedy else mean_max(greedy_reference(weight, replicas, gpus))
    bound = lower_bound(weight, replicas, gpus)
    gap = (ours_global / bound - 1).max()   # the worst layer's distance from its own bound
    print(f"| {name} | {weight.shape[1]}+{replicas - weight.shape[1]} on {gpus} ({nodes} "
          f"nodes) | {mean_max(before)} | {greedy} | {mean_max(ours_global)} | "
          f"{mean_max(ours_hier)} | {mean_max(bound)} | {gap * 100:.2f}% |", flush=True)


def time_rebalance(layers: int) -> None:
    torch.set_num_threads(1)
    weight = zipf(layers, 256, 1.0, seed=7)
    for replicas, groups, nodes, gpus in ((288, 8, 4, 32), (288, 1, 1, 32), (320, 8, 8, 64),
                                          (320, 1, 1, 64)):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            rebalance_experts(weight, replicas, groups, nodes, gpus)
            times.append(time.perf_counter() - start)
        policy = "hierarchical" if groups > 1 else "global"
        print(f"rebalance_experts 256 experts x {layers} layers, {replicas} slots on {gpus} "
              f"ranks, {policy}: {statistics.median(times) * 1e3:.1f} ms (median of 5)")


def throughput() -> None:
    """Tokens/s, tiny V3, 1 process vs data_parallel_size=2 + EP (CPU, gloo)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from deepinfer.engine.llm import LLM
    from deepinfer.engine.loader import load_tokenizer, resolve_model_dir
    from deepinfer.engine.sampling_params import SamplingParams

    tokenizer = load_tokenizer(resolve_model_dir(None, None))
    config = DeepseekV3Config(**dict(TINY, n_routed_experts=16, num_experts_per_tok=4),
                              vocab_size=len(tokenizer), n_group=4, topk_group=2,
                              q_lora_rank=32, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [list(range(1000 + i, 1032 + i)) for i in range(16)]
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for options in ({}, {"data_parallel_size": 2, "enable_expert_parallel": True}):
            llm = LLM(tmp, dtype="float32", device="cpu", **options)
            llm.generate(prompts[:2], params)   # warm
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            llm.engine_core.close()
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"tiny V3 {options or 'one process'}: {n / elapsed:.1f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--skip-greedy", action="store_true",
                        help="leave out DeepSeek's loop-by-loop policy (slow in Python)")
    parser.add_argument("--throughput", action="store_true")
    args = parser.parse_args()
    layers = args.layers
    print("| load | slots on ranks | none (mean/max) | DeepSeek greedy | ours global | "
          "ours hierarchical | lower bound | ours global over bound (worst layer) |\n"
          "|---|---|---|---|---|---|---|---|")
    loads_v3 = {"recorded tiny V3 router": record_routing(256, 8, True, layers),
                "Zipf s=0.8": zipf(layers, 256, 0.8, 1), "Zipf s=1.2": zipf(layers, 256, 1.2, 2),
                "all on one expert": one_hot(layers, 256)}
    for name, weight in loads_v3.items():
        for replicas, gpus, nodes in ((288, 32, 4), (320, 64, 8)):
            report(name, weight, replicas, gpus, nodes, args.skip_greedy)
    loads_v2 = {"recorded tiny V2-Lite router": record_routing(64, 6, False, 27),
                "Zipf s=1.0 (V2-Lite)": zipf(27, 64, 1.0, 3)}
    for name, weight in loads_v2.items():
        report(name, weight, 80, 8, 2, args.skip_greedy)
    time_rebalance(layers)
    if args.throughput:
        throughput()


if __name__ == "__main__":
    main()
