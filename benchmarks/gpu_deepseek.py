"""deepinfer's DeepSeek path on one GPU: decode and prefill throughput against the roofline and
HF transformers, on DeepSeek-V2-Lite's shapes with random bf16 weights built on the device.

Shapes (DeepSeek-V2-Lite): 27 layers, hidden 2048, 16 heads, kv_lora 512, rope 64, nope 128,
v 128, no q_lora; layer 0 dense (intermediate 10944), the rest 64 routed experts top-6 (softmax,
greedy) + 2 shared, moe_intermediate 1408; vocab 102400. `--layers N` keeps the first N layers.

One process, in order (JSON rewritten after each stage, so a cut-short run keeps what it has):
1. ceilings: device copy bandwidth (bytes read + written, 4 GiB) and the bf16 and FP8
   (`torch._scaled_mm`, e4m3, per-tensor scales) matmul rates at 8192^3;
2. the models: HF `DeepseekV2ForCausalLM` initialised in memory on the device, its weights
   copied into deepinfer's model (same weights on both sides);
3. the Triton fused MoE alone (routing + experts of one layer, a CUDA graph of 10 layers'
   worth, replayed): microseconds per layer and the bandwidth its distinct experts' bytes imply;
4. routing statistics: each MoE layer's top-k ids over 2,048 prompt tokens, and from them the
   expected number of distinct experts a batch of B tokens touches per layer (Monte Carlo);
5. HF `generate` (greedy) at batch 1 and 8, 128-token prompts: decode tokens/s from the time for
   N new tokens minus the time for 1 (N = 32: HF is slow and the rate is flat in N);
6. deepinfer's `EngineCore` (CUDA graphs for decode, async scheduling): decode tokens/s at batch
   1, 8, 64, 256 (128-token prompts, 128 new tokens; timed once every request has its first
   token), then, in a second engine without graphs and a 4k context, prefill tokens/s of
   PREFILL_PROMPTS 2,048-token prompts, timed PREFILL_RUNS times (median) after a warm-up of
   the same prompts (the prefill step's shapes compile and tune outside the timed region,
   whatever ran before).

Rooflines. Decode step bytes = every weight except the routed experts and the embedding table
(only B rows of it are read; the LM head is included) + per MoE layer the expected distinct
experts x one expert's bytes + the KV read (B x mean context x layers x 576 x 2 bytes); step time
= max(bytes / copy bandwidth, FLOPs / matmul rate); roofline tok/s = B / step time. Prefill =
FLOPs / bf16 matmul rate, FLOPs = 2 x active parameters per token (non-expert, shared, top-6
experts; LM head once per prompt) x tokens + causal MLA attention (expanded: 2 x (192 + 128) x
heads x L^2 / 2 per layer).

7. with `--fp8-experts` (after the bf16 decode and prefill runs): the routed experts quantized
   to FP8 (e4m3, 128x128 block scales; linears stay bf16), decode again against the roofline
   with the experts' bytes halved, then the prefill again (JSON `prefill_fp8_experts`, same
   warm-up and roofline);
8. with `--moe-sweep`: the routed experts alone at batch 1, 64, 256 under candidate tiles;
9. with `--variants A,B`: after the decode runs, the committed `KernelConfig` and each variant
   (`gpu_decode.variant_fields`, e.g. `mla_absorb_triton_max_tokens=0`) decode at --batches,
   alternating, `--variant-rounds` times in the same engine (graphs recaptured; JSON
   `variants`): the A/B behind a kernel decision; `--fp8-variants A,B` the same on the FP8
   engine at --fp8-batches (`variants_fp8_experts`); `--prefill-variants A,B` each variant's
   prefill timed beside the committed one's, same engine, alternating (bf16, and FP8 with
   --fp8-experts; `prefill*.variants`).

Run: python3 benchmarks/gpu_deepseek.py [--layers 27] [--json PATH] [--skip-hf] [--moe-sweep]
    [--batches 1,8,64,256] [--fp8-batches 1,8,64,256] [--hf-batches 1,8] [--variants A,B]
    [--fp8-variants A,B] [--prefill-variants A,B]
(the batch lists pick the decode runs; fewer make a shorter device call)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import _random_prompts, _run_requests, _timed, write_model_dir  # noqa: E402

V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
               moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
               num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6,
               n_shared_experts=2, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512,
               q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
               routed_scaling_factor=1.0, max_position_embeddings=8192, rms_norm_eps=1e-6,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
               initializer_range=0.02)
PROMPT_TOKENS, NEW_TOKENS, PREFILL_TOKENS, HF_NEW_TOKENS = 128, 128, 2048, 32
PREFILL_PROMPTS = 4   # one 8,192-token step (the engine's max_num_batched_tokens)
# timed prefills after the warm-up, the median reported: one timed step read 0.43-0.54 of the
# roofline on the H200 for the same kernels (2026-12-05)
PREFILL_RUNS = 5
DECODE_BATCHES, HF_BATCHES = (1, 8, 64, 256), (1, 8)
LATENT = 512 + 64


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes/s, read + write), bf16 and FP8 matmul rates (FLOP/s)."""
    numel = 1 << 31
    src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bandwidth = 2 * numel * 2 / _timed(lambda: dst.copy_(src), 20)
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = {"copy_bandwidth_Bps": bandwidth,
           "matmul_flops": 2 * n ** 3 / _timed(lambda: a @ b, 20)}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).T  # column-major B
        one = torch.ones((), device="cuda")
        out["fp8_matmul_flops"] = 2 * n ** 3 / _timed(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                     out_dtype=torch.bfloat16), 20)
    except (RuntimeError, AttributeError) as exc:   # no FP8 GEMM on this device / torch
        out["fp8_matmul_error"] = str(exc)[:200]
    return out


def hf_state_as_checkpoint(hf_model):
    """HF's in-memory state dict (fused `experts.gate_up_proj` [E, 2I, H] / `down_proj`
    [E, H, I]) as checkpoint names (`experts.e.gate_proj.weight`, ...), views, no copies."""
    for name, tensor in hf_model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[:-len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def build_models(hf_config, with_hf: bool, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16):
    """(HF model or None, deepinfer model) on `device` in `dtype` (default CUDA, bf16) with the
    same random weights (seed 0)."""
    from transformers import DeepseekV2ForCausalLM as HFDeepseek

    from deepinfer.engine.models.deepseek import DeepseekV2ForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf_model = HFDeepseek(hf_config).eval()
            ours = DeepseekV2ForCausalLM(hf_config, dtype)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        ours.load_weights(hf_state_as_checkpoint(hf_model))
    if not with_hf:
        del hf_model
        hf_model = None
    return hf_model, ours.eval()


def moe_modules(model):
    from deepinfer.engine.models.layers.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def model_costs(model, c) -> dict:
    moes = moe_modules(model)
    params = sum(p.numel() for p in model.parameters())
    routed = sum(m.w13.numel() + m.w2.numel() for m in moes)
    expert = moes[0].w13[0].numel() + moes[0].w2[0].numel()
    embed, head = model.embed_tokens.weight.numel(), model.lm_head.weight.numel()
    non_expert = params - routed - embed
    return {"non_expert_bytes": non_expert * 2, "expert_bytes": expert * 2,
            "moe_layers": len(moes), "top_k": c.num_experts_per_tok, "head_params": head,
            "active_params": non_expert + len(moes) * c.num_experts_per_tok * expert,
            "kv_bytes_per_token": c.num_hidden_layers * LATENT * 2,
            "attn_flops_per_ctx": c.num_hidden_layers * c.num_attention_heads * 2 * 2 * LATENT,
            "prefill_attn_flops_per_l2": c.num_hidden_layers * c.num_attention_heads * 2
            * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2,
            "total_GB": params * 2 / 1e9}


def decode_roofline(costs, ceilings, distinct: dict, batch: int, context: float) -> dict:
    step_bytes = (costs["non_expert_bytes"] + costs["moe_layers"] * distinct[batch]
                  * costs["expert_bytes"] + batch * context * costs["kv_bytes_per_token"])
    step_flops = batch * (2 * costs["active_params"] + context * costs["attn_flops_per_ctx"])
    step_s = max(step_bytes / ceilings["copy_bandwidth_Bps"],
                 step_flops / ceilings["matmul_flops"])
    return {"roofline_tok_s": batch / step_s, "step_GB": step_bytes / 1e9,
            "roofline_step_ms": 1e3 * step_s}


def prefill_roofline(costs, ceilings, length: int) -> float:
    flops = (2 * (costs["active_params"] - costs["head_params"]) * length
             + 2 * costs["head_params"] + costs["prefill_attn_flops_per_l2"] * length ** 2)
    return length * ceilings["matmul_flops"] / flops


@torch.inference_mode()
def routing_stats(core, model, vocab: int, batches=DECODE_BATCHES, trials: int = 200) -> dict:
    """Expected distinct experts per MoE layer for B random tokens, from the top-k ids the
    layers pick over 16 x 128 prompt tokens (eager prefill steps, recorded by forward hooks)."""
    from deepinfer.engine.moe.gating import select_experts

    picks = {i: [] for i, _ in enumerate(moe_modules(model))}

    def hook(index):
        def record(module, args, output):
            logits = args[0].float() @ module.gate_weight.T
            picks[index].append(select_experts(logits, module.routing,
                                               module.e_score_correction_bias)[1])
        return record

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(moe_modules(model))]
    try:
        _run_requests(core, _random_prompts(16, PROMPT_TOKENS, vocab, 5), 1)
    finally:
        for h in handles:
            h.remove()
    num_experts = moe_modules(model)[0].routing.num_experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for batch in batches:
        means = []
        for ids in picks.values():
            ids = torch.cat(ids)   # [N, top_k]
            rows = torch.randint(0, ids.shape[0], (trials, batch), device="cuda", generator=gen)
            hit = torch.zeros(trials, num_experts + 1, device="cuda")
            hit.scatter_(1, ids[rows].reshape(trials, -1), 1.0)
            means.append(hit.sum(1).mean().item())
        out[batch] = sum(means) / len(means)
    load = torch.bincount(torch.cat(next(iter(picks.values()))).reshape(-1), minlength=num_experts)
    out["layer1_load_max_over_mean"] = (load.max() / load.float().mean()).item()
    return out


@torch.inference_mode()
def moe_micro(model, costs, distinct: dict, ceilings) -> dict:
    """One layer's routing + fused experts, 10 calls in a CUDA graph: us per call and the
    fraction of copy bandwidth that the distinct experts' bytes imply."""
    moe = moe_modules(model)[0]
    out = {}
    for batch in DECODE_BATCHES:
        x = torch.randn(batch, moe.gate_weight.shape[1], device="cuda", dtype=torch.bfloat16)
        moe(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                moe(x)
        seconds = _timed(graph.replay, 20) / 10
        moe_bytes = distinct[batch] * costs["expert_bytes"]
        out[batch] = {"us": 1e6 * seconds, "GBps": moe_bytes / seconds / 1e9,
                      "fraction_of_copy": moe_bytes / seconds / ceilings["copy_bandwidth_Bps"]}
        print(f"MoE layer b={batch}: {out[batch]}", flush=True)
    return out


SWEEP_TILES = {1: [(16, 32, 64, 128, 4, 4), (16, 64, 64, 128, 4, 3), (16, 32, 32, 256, 4, 3),
                    (16, 16, 32, 128, 2, 4)],
               64: [(16, 64, 64, 128, 4, 3), (16, 32, 64, 128, 4, 4), (32, 64, 128, 64, 4, 4),
                    (16, 128, 128, 64, 4, 3)],
               256: [(32, 64, 128, 64, 4, 4), (16, 64, 64, 128, 4, 3), (64, 64, 128, 64, 4, 3),
                     (32, 128, 128, 64, 8, 3)]}


@torch.inference_mode()
def moe_sweep(model, costs, distinct: dict) -> dict:
    """Routed experts alone (fixed routing, no router) at decode batch sizes under each
    candidate tile (block_m, block_n, down_block_n, block_k, warps, stages): us per call
    (10 calls in a CUDA graph)."""
    from deepinfer.kernels.moe import moe_experts
    from deepinfer.kernels.settings import KernelConfig, MoETile

    moe = moe_modules(model)[0]
    out = {}
    for batch, tiles in SWEEP_TILES.items():
        x = torch.randn(batch, moe.gate_weight.shape[1], device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.rand(batch, moe.routing.num_experts, device="cuda").topk(
            moe.routing.top_k, dim=-1)
        for tile in tiles:
            settings = KernelConfig(moe_tiles=(MoETile(1 << 30, *tile),))
            moe_experts(x, moe.w13, moe.w2, weights, ids, settings=settings)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    moe_experts(x, moe.w13, moe.w2, weights, ids, settings=settings)
            seconds = _timed(graph.replay, 10) / 10
            key = f"b{batch}_" + "_".join(map(str, tile))
            out[key] = {"us": 1e6 * seconds,
                        "GBps": distinct[batch] * costs["expert_bytes"] / seconds / 1e9}
            print(f"MoE sweep {key}: {out[key]}", flush=True)
    return out


@torch.inference_mode()
def hf_throughput(hf_model, vocab: int, batches=HF_BATCHES) -> dict:
    results = {}
    for batch in batches:
        ids = torch.tensor(_random_prompts(batch, PROMPT_TOKENS, vocab, batch), device="cuda")

        def generate(new_tokens: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        generate(2)
        elapsed = generate(HF_NEW_TOKENS) - generate(1)
        results[f"decode_b{batch}"] = batch * (HF_NEW_TOKENS - 1) / elapsed
        print(f"HF decode b={batch}: {results[f'decode_b{batch}']:.1f} tok/s", flush=True)
    return results


def fp8_decode(model, model_dir, costs, ceilings, distinct, context, results,
               batches=DECODE_BATCHES, variants: list[str] = (), rounds: int = 2) -> list:
    """The routed experts quantized to FP8 (`MoE.quantize_experts_fp8`: e4m3, 128x128 block
    scales; the rest stays bf16), a fresh engine (graphs hold the old weights), decode at
    `batches` against the roofline with the experts' bytes halved (+ their scales); then
    `variants` against the committed config at `batches` (`variant_rounds`,
    results["variants_fp8_experts"])."""
    for moe in moe_modules(model):
        moe.quantize_experts_fp8()
    _free()
    fp8_costs = {**costs, "expert_bytes": costs["expert_bytes"] / 2 * (1 + 4 / 128 ** 2 * 2)}
    core = build_engine(model_dir, model, max_model_len=512, enforce_eager=False)
    rows = []
    for batch in batches:
        seconds, tokens, steps = _run_requests(
            core, _random_prompts(batch, PROMPT_TOKENS, model.vocab_size, 2000 + batch),
            NEW_TOKENS)
        run = {"tok_s": tokens / seconds, "step_ms": 1e3 * seconds / max(steps, 1),
               **decode_roofline(fp8_costs, ceilings, distinct, batch, context)}
        run["fraction"] = run["tok_s"] / run["roofline_tok_s"]
        results[f"decode_fp8_experts_b{batch}"] = run
        rows.append((f"decode b={batch} FP8 experts", run["tok_s"], run["roofline_tok_s"], None))
        print(f"decode b={batch} FP8 experts: {run}", flush=True)
    if variants:
        results["variants_fp8_experts"] = variant_rounds(core, model.vocab_size, variants,
                                                         batches, rounds)
    return rows


def build_engine(model_dir: Path, model, *, max_model_len: int, enforce_eager: bool):
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.engine_core import EngineCore

    config = EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda", "dtype": "bfloat16",
               "max_model_len": max_model_len, "enforce_eager": enforce_eager},
        cache={"enable_prefix_caching": False, "gpu_memory_utilization": 0.5},
        scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 8192,
                   "max_waiting_requests": 4096},
        kv_transfer={"kv_store": "none"})
    start = time.perf_counter()
    core = EngineCore(config, model=model)
    print(f"engine ready in {time.perf_counter() - start:.1f} s (graphs: "
          f"{core.executor.runner.cuda_graphs is not None}, max_model_len {max_model_len})",
          flush=True)
    return core


def engine_prefill(core, vocab: int, num_prompts: int) -> float:
    prompts = _random_prompts(num_prompts, PREFILL_TOKENS, vocab, 7)
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for prompt in prompts:
        core.add_request(core.make_request(prompt, params))
    while core.has_unfinished_requests():
        core.step()
    torch.cuda.synchronize()
    return num_prompts * PREFILL_TOKENS / (time.perf_counter() - start)


def prefill_run(model_dir: Path, model, vocab: int, costs, ceilings,
                variants: list[str] = ()) -> dict:
    """Prefill tok/s of PREFILL_PROMPTS prompts of PREFILL_TOKENS in a fresh eager engine,
    timed PREFILL_RUNS times after a warm-up prefill of the same prompts (the median
    reported, every run listed), against the prefill roofline. `variants` (`gpu_decode.
    variant_fields` labels): each also timed PREFILL_RUNS times in the same engine, runs
    alternating with the committed config's ("variants": {label: {"tok_s": median,
    "runs_tok_s"}}, "committed" included)."""
    from gpu_decode import kernel_settings, variant_fields

    _free()   # the decode engine before it
    core = build_engine(model_dir, model, max_model_len=PREFILL_TOKENS + 64, enforce_eager=True)
    labels = ["committed", *variants]
    runs: dict[str, list[float]] = {label: [] for label in labels}
    for label in labels:   # warm-up: the exact timed shapes compile
        with kernel_settings(core, variant_fields(label) if variants and label != "committed"
                             else {}, recapture=False):
            engine_prefill(core, vocab, PREFILL_PROMPTS)
    for _ in range(PREFILL_RUNS):
        for label in labels:
            with kernel_settings(core, variant_fields(label) if label != "committed" else {},
                                 recapture=False):
                runs[label].append(engine_prefill(core, vocab, PREFILL_PROMPTS))
    core = None
    _free()
    roof = prefill_roofline(costs, ceilings, PREFILL_TOKENS)
    tok_s = statistics.median(runs["committed"])
    result = {"tok_s": tok_s, "roofline_tok_s": roof, "fraction": tok_s / roof,
              "prompts": PREFILL_PROMPTS,
              "runs_tok_s": [round(r, 1) for r in runs["committed"]]}
    if variants:
        result["variants"] = {label: {"tok_s": statistics.median(r),
                                      "runs_tok_s": [round(x, 1) for x in r]}
                              for label, r in runs.items()}
        print(f"prefill variants: {json.dumps(result['variants'])}", flush=True)
    return result


def variant_rounds(core, vocab: int, labels: list[str], batches, rounds: int) -> dict:
    """Same-process A/B: the committed `KernelConfig` and each variant (`gpu_decode.
    variant_fields`: a name or FIELD=VALUE, joined by '+'; CUDA graphs recaptured) decode at
    `batches`, alternating, `rounds` times. Returns {"LABEL b=B": [tok/s per round]}."""
    from gpu_decode import kernel_settings, variant_fields

    runs: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label in ["committed", *labels]:
            with kernel_settings(core, {} if label == "committed" else variant_fields(label)):
                for batch in batches:
                    seconds, tokens, _ = _run_requests(
                        core, _random_prompts(batch, PROMPT_TOKENS, vocab, 1000 + batch),
                        NEW_TOKENS)
                    runs.setdefault(f"{label} b={batch}", []).append(round(tokens / seconds, 1))
                    print(f"variant {label} b={batch}: {tokens / seconds:.1f} tok/s", flush=True)
    return runs


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--fp8-experts", action="store_true",
                        help="after the bf16 decode runs, the same with FP8 routed experts")
    parser.add_argument("--moe-sweep", action="store_true",
                        help="last: time the routed experts under candidate tiles")
    batch_list = lambda text: tuple(int(b) for b in text.split(","))  # noqa: E731
    parser.add_argument("--batches", type=batch_list, default=DECODE_BATCHES,
                        help="decode batch sizes, comma-separated (default 1,8,64,256)")
    parser.add_argument("--fp8-batches", type=batch_list, default=DECODE_BATCHES,
                        help="decode batch sizes with FP8 experts (default 1,8,64,256)")
    parser.add_argument("--hf-batches", type=batch_list, default=HF_BATCHES,
                        help="HF generate batch sizes (default 1,8)")
    parser.add_argument("--variants", default="",
                        help="comma-separated KernelConfig variants (gpu_decode.variant_fields: "
                             "a name or FIELD=VALUE, joined by '+') decoded at --batches against "
                             "the committed config after the decode runs, same process")
    parser.add_argument("--variant-rounds", type=int, default=2)
    parser.add_argument("--fp8-variants", default="",
                        help="with --fp8-experts: KernelConfig variants (as --variants) decoded "
                             "at --fp8-batches against the committed config, FP8 engine")
    parser.add_argument("--prefill-variants", default="",
                        help="comma-separated KernelConfig variants (as --variants) whose prefill "
                             "is timed beside the committed config's, same engine, alternating "
                             "(bf16 prefill, and FP8 with --fp8-experts)")
    args = parser.parse_args()
    from transformers import DeepseekV2Config

    hf_config = DeepseekV2Config(**{**V2_LITE, "num_hidden_layers": args.layers})
    vocab = hf_config.vocab_size
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "layers": args.layers}

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))

    results["ceilings"] = ceilings = measure_ceilings()
    shown = {k: f"{v:.3g}" for k, v in ceilings.items() if isinstance(v, float)}
    print(f"ceilings: {json.dumps(shown)}", flush=True)
    start = time.perf_counter()
    hf_model, ours = build_models(hf_config, with_hf=not args.skip_hf)
    results["costs"] = costs = model_costs(ours, hf_config)
    print(f"models built in {time.perf_counter() - start:.1f} s; {costs['total_GB']:.1f} GB "
          f"each; non-expert {costs['non_expert_bytes'] / 1e9:.2f} GB", flush=True)
    save()
    hf = {}
    if hf_model is not None:
        results["hf"] = hf = hf_throughput(hf_model, vocab, args.hf_batches)
        hf_model = None
        _free()
        save()
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="v2-lite-random-")), hf_config)
    core = build_engine(model_dir, ours, max_model_len=512, enforce_eager=False)
    results["distinct_experts"] = distinct = routing_stats(
        core, ours, vocab, sorted(set(DECODE_BATCHES) | set(args.batches) | set(args.fp8_batches)))
    print(f"distinct experts per layer: {distinct}", flush=True)
    results["moe_layer"] = moe_micro(ours, costs, distinct, ceilings)
    save()
    context = PROMPT_TOKENS + NEW_TOKENS / 2
    rows = []
    for batch in args.batches:
        seconds, tokens, steps = _run_requests(
            core, _random_prompts(batch, PROMPT_TOKENS, vocab, 1000 + batch), NEW_TOKENS)
        run = {"tok_s": tokens / seconds, "step_ms": 1e3 * seconds / max(steps, 1),
               **decode_roofline(costs, ceilings, distinct, batch, context)}
        run["fraction"] = run["tok_s"] / run["roofline_tok_s"]
        results[f"decode_b{batch}"] = run
        rows.append((f"decode b={batch}", run["tok_s"], run["roofline_tok_s"],
                     hf.get(f"decode_b{batch}")))
        print(f"decode b={batch}: {run}", flush=True)
        save()
    if args.variants:
        results["variants"] = variant_rounds(core, vocab, args.variants.split(","), args.batches,
                                             args.variant_rounds)
        save()
    core = None
    _free()
    prefill_variants = [v for v in args.prefill_variants.split(",") if v]
    results["prefill"] = run = prefill_run(model_dir, ours, vocab, costs, ceilings,
                                           prefill_variants)
    rows.append((f"prefill {PREFILL_TOKENS}, bf16 experts", run["tok_s"], run["roofline_tok_s"],
                 None))
    save()
    if args.fp8_experts:
        rows += fp8_decode(ours, model_dir, costs, ceilings, distinct, context, results,
                           args.fp8_batches, [v for v in args.fp8_variants.split(",") if v],
                           args.variant_rounds)
        save()
        results["prefill_fp8_experts"] = run = prefill_run(model_dir, ours, vocab, costs,
                                                           ceilings, prefill_variants)
        rows.append((f"prefill {PREFILL_TOKENS}, FP8 experts", run["tok_s"],
                     run["roofline_tok_s"], None))
        save()
    print_rows(rows)
    if args.moe_sweep:
        results["moe_sweep"] = moe_sweep(ours, costs, distinct)
        save()
    return 0


def print_rows(rows) -> None:
    print("\n| measurement | deepinfer tok/s | roofline tok/s | fraction | HF tok/s | vs HF |\n"
          "|---|---|---|---|---|---|")
    for name, tok_s, roof, hf_tok_s in rows:
        ratio = f"{tok_s / hf_tok_s:.1f}x" if hf_tok_s else "-"
        hf_text = f"{hf_tok_s:.1f}" if hf_tok_s else "-"
        print(f"| {name} | {tok_s:.1f} | {roof:.1f} | {tok_s / roof:.2f} | {hf_text} | {ratio} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
