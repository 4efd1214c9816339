"""MLA and FP8 GEMM kernel timings on one CUDA device (DeepSeek-V2-Lite / V3 shapes).

Measures, each with `triton.testing.do_bench` (median, L2 flushed between runs):
- copy bandwidth (a 1 GiB device-to-device copy: read + write bytes / time);
- MLA decode at batch 1 / 64 / 256 with 2,048-token contexts, 64-token blocks, in CUDA graphs
  (as the engine's decode runs): the Triton latent attention alone (bytes of latent cache read
  / time, as a fraction of the copy bandwidth) with a few `KernelConfig` variants, and the
  whole Triton op (W_UK / W_UV GEMMs included);
- MLA prefill of one 2,048-token prompt: Triton expanded vs Triton absorbed vs torch (SDPA),
  as TFLOP/s of the expanded form's attention FLOPs;
- FP8 block-scaled GEMM vs bf16 `torch.matmul` on V2-Lite's linear shapes at 1 / 64 rows (CUDA
  graphs, weight bytes / time) and 2,048 rows (TFLOP/s).

Usage: python benchmarks/bench_mla.py [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random

import torch
import triton
from triton.testing import do_bench

from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.fp8 import fp8_block_linear, quantize_block_fp8
from deepinfer.kernels.mla_attention import mla_attention
from deepinfer.kernels.mla_decode_triton import latent_attention
from deepinfer.kernels.settings import KernelConfig

FP8_GEMM = KernelConfig(fp8_block_gemm=True)   # the Triton FP8 GEMM (off by default)

LORA, ROPE, NOPE, VDIM = 512, 64, 128, 128


def graph_us(calls, replays: int = 20) -> float:
    """Microseconds per call of `calls` (closures over distinct buffers, so that together they
    exceed the L2 cache) captured in one CUDA graph: kernel time without launch overhead, as
    the engine's decode graphs run them."""
    for fn in calls:   # compile + allocate outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / len(calls)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * src.numel() / (ms * 1e-3)


def paged_batch(query_lens, seq_lens, block_size=64, seed=0):
    """(latent cache, metadata) with shuffled block tables, random bf16 latents."""
    blocks = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(blocks)))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in blocks:
        tables.append(ids[at:at + n])
        at += n
    width = max(blocks)
    cache = torch.randn(sum(blocks), block_size, LORA + ROPE, device="cuda",
                        dtype=torch.bfloat16)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device="cuda"),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device="cuda"),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return cache, metadata


def weights(heads):
    w_uk = torch.randn(heads, NOPE, LORA, device="cuda", dtype=torch.bfloat16) * LORA ** -0.5
    w_uv = torch.randn(heads, VDIM, LORA, device="cuda", dtype=torch.bfloat16) * LORA ** -0.5
    return w_uk, w_uv


def bench_decode(copy_bw, heads, batches, variants, results, context=2048):
    """Latent attention alone and the whole Triton op, in CUDA graphs over enough distinct
    caches to exceed the L2 cache (~100 MB of latents per graph)."""
    w_uk, w_uv = weights(heads)
    for batch in batches:
        cache_bytes = batch * context * (LORA + ROPE) * 2
        copies = max(1, min(48, -(-100_000_000 // cache_bytes)))
        sets = []
        for c in range(copies):
            cache, metadata = paged_batch([1] * batch, [context] * batch, seed=c)
            sets.append((cache, metadata, *(torch.randn(batch, heads, d, device="cuda",
                                                        dtype=torch.bfloat16)
                                            for d in (NOPE, ROPE, LORA))))
        for name, settings in variants.items():
            us = graph_us([lambda a=a, s=settings: latent_attention(
                a[4], a[3], a[0], a[1], 0.1, max_q_len=1, settings=s) for a in sets])
            row = {"kind": "mla_decode_latent_graph", "heads": heads, "batch": batch,
                   "context": context, "variant": name, "us": us,
                   "GB/s": cache_bytes / (us * 1e-6) / 1e9,
                   "fraction_of_copy": cache_bytes / (us * 1e-6) / copy_bw}
            results.append(row)
            print(json.dumps(row), flush=True)
        us = graph_us([lambda a=a: mla_attention(a[2], a[3], a[0], a[1], w_uk, w_uv, 0.1,
                                                 backend="triton") for a in sets])
        row = {"kind": "mla_decode_op_graph", "heads": heads, "batch": batch, "us": us,
               "fraction_of_copy": cache_bytes / (us * 1e-6) / copy_bw}
        results.append(row)
        print(json.dumps(row), flush=True)


def bench_prefill(results, heads=16, tokens=2048):
    w_uk, w_uv = weights(heads)
    cache, metadata = paged_batch([tokens], [tokens])
    q_nope = torch.randn(tokens, heads, NOPE, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(tokens, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    # causal attention FLOPs of the expanded form: 2 * (Dn + R + Dv) per (query, key, head) / 2
    flops = 2 * (NOPE + ROPE + VDIM) * heads * tokens * tokens / 2
    for name, backend, settings in (("triton_expanded", "triton",
                                     KernelConfig(mla_prefill="expanded")),
                                    ("triton_absorbed", "triton",
                                     KernelConfig(mla_prefill="absorbed")),
                                    ("torch_sdpa", "torch", KernelConfig())):
        ms = do_bench(lambda b=backend, s=settings: mla_attention(
            q_nope, q_pe, cache, metadata, w_uk, w_uv, 0.1, backend=b, settings=s),
            warmup=3, rep=20)
        row = {"kind": "mla_prefill", "tokens": tokens, "heads": heads, "variant": name,
               "ms": ms, "TFLOP/s_expanded_equiv": flops / (ms * 1e-3) / 1e12}
        results.append(row)
        print(json.dumps(row), flush=True)


def bench_fp8(copy_bw, results):
    """Skinny rows (1, 64) in CUDA graphs over 16 weight copies (past L2); 2,048 rows plain."""
    shapes = {"q_proj": (3072, 2048), "o_proj": (2048, 2048), "dense_down": (2048, 10944)}
    for name, (n, k) in shapes.items():
        copies = []
        for _ in range(16):
            w = torch.randn(n, k, device="cuda") * k ** -0.5
            copies.append((*quantize_block_fp8(w, (128, 128)), w.bfloat16()))
        for rows in (1, 64, 2048):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            if rows <= 64:
                ms8 = graph_us([lambda c=c: fp8_block_linear(x, c[0], c[1],
                                                             block_size=(128, 128),
                                                             settings=FP8_GEMM)
                                for c in copies]) * 1e-3
                ms16 = graph_us([lambda c=c: x @ c[2].T for c in copies]) * 1e-3
            else:
                codes, scale, w_bf16 = copies[0]
                ms8 = do_bench(lambda: fp8_block_linear(x, codes, scale, block_size=(128, 128),
                                                        settings=FP8_GEMM),
                               warmup=5, rep=30)
                ms16 = do_bench(lambda: x @ w_bf16.T, warmup=5, rep=30)
            row = {"kind": "fp8_gemm", "shape": name, "rows": rows, "n": n, "k": k,
                   "fp8_us": ms8 * 1e3, "bf16_us": ms16 * 1e3,
                   "fp8_weight_GB/s": n * k / (ms8 * 1e-3) / 1e9,
                   "fp8_fraction_of_copy": n * k / (ms8 * 1e-3) / copy_bw,
                   "fp8_TFLOP/s": 2 * rows * n * k / (ms8 * 1e-3) / 1e12,
                   "bf16_TFLOP/s": 2 * rows * n * k / (ms16 * 1e-3) / 1e12}
            results.append(row)
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer variants")
    args = parser.parse_args()
    results = []
    copy_bw = copy_bandwidth()
    results.append({"kind": "copy", "GB/s": copy_bw / 1e9,
                    "device": torch.cuda.get_device_name()})
    print(json.dumps(results[-1]), flush=True)
    variants = {"default": KernelConfig()}
    if not args.quick:
        variants.update({"block_n64": KernelConfig(mla_decode_block_n=64),
                         "waves4": KernelConfig(mla_decode_waves=4)})
    bench_decode(copy_bw, 16, (1, 64, 256), variants, results)
    bench_decode(copy_bw, 128, (1, 64), {"default": KernelConfig()}, results)
    bench_prefill(results)
    bench_fp8(copy_bw, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
