"""Decode-shaped linears inside CUDA graphs: cuBLAS (F.linear) against the Triton skinny GEMM
(kernels/linear_triton.py) over a grid of tile configs; Llama-3-8B or DeepSeek-V2-Lite shapes
(`--model`), bf16. Writes the tuned-config file the engine reads
(`kernels/configs/skinny_linear_<device>.json`).

Why in graphs: a decode step replays its linears back to back inside one CUDA graph, where a
kernel's ramp and tail overlap its neighbours'; timing one call alone adds launch latency that
hides differences of a few microseconds. So each candidate is captured as a graph of calls over
distinct weight copies (>= 1 GB in all, so nothing is served from the 50 MB L2) and timed by
replay (median, CUDA events); time per call = replay / calls.

For each row bucket of the kernel (16: measured at 1 and 16 rows, summed; 64: at 64 rows) and
shape: every config is checked against F.linear (relative error < 1e-2), the best is kept, and
`triton_faster` is set when it beats cuBLAS by more than 1%: only those shapes run in Triton.

Run: python3 benchmarks/gemv_sweep.py [--model llama-3-8b|deepseek-v2-lite] [--json PATH]
     [--write-configs] [--shapes qkv,o,down] [--buckets 16,64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# the checkout root last, as `deepinfer` puts it: first, its kernels/ would shadow HF's `kernels`
# distribution for everything imported later (transformers, or a test session importing this)
sys.path.append(str(Path(__file__).resolve().parents[1]))

# name -> (out_features, in_features); the names are the config file's keys, unique over models
MODELS = {
    "llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                   "down": (4096, 14336), "lm_head": (128256, 4096)},
    # DeepSeek-V2-Lite: q_proj + kv_a_proj_with_mqa as one GEMM (3072 + 576 rows), o_proj, the
    # two shared experts' gate_up / down, layer 0's dense MLP, the LM head
    "deepseek-v2-lite": {"v2lite_q_kv_a": (3648, 2048), "v2lite_o": (2048, 2048),
                         "v2lite_shared_gate_up": (5632, 2048),
                         "v2lite_shared_down": (2048, 2816),
                         "v2lite_dense_gate_up": (21888, 2048),
                         "v2lite_dense_down": (2048, 10944),
                         "v2lite_lm_head": (102400, 2048)},
}
SHAPES = {name: shape for shapes in MODELS.values() for name, shape in shapes.items()}
BUCKETS = {16: (1, 16), 64: (64,)}
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K). Split 1: the configs the first sweep
# (isolated calls) ranked near the top for some shape. Split > 1 (run 10): more programs for
# the short weights, and at 64 rows wide N tiles that re-read fewer x rows per weight byte
# (run 10 swept qkv, o and down with the split-K configs plus the run-9 winners
# (64,128,4,6), (32,128,4,8), (64,256,4,3) / (64,128,4,4), (32,256,4,3), (128,128,8,4)).
CONFIGS = {
    16: [(16, 128, 4, 6, 1), (16, 256, 4, 4, 1), (16, 512, 4, 3, 1), (16, 128, 4, 8, 1),
         (32, 128, 4, 5, 1), (32, 128, 4, 8, 1), (32, 256, 4, 4, 1), (32, 512, 8, 3, 1),
         (64, 128, 4, 4, 1), (64, 256, 4, 3, 1), (64, 256, 8, 3, 1), (64, 128, 8, 5, 1),
         (64, 128, 4, 6, 1), (128, 128, 8, 3, 1), (64, 64, 4, 8, 1), (128, 64, 4, 6, 1),
         (64, 128, 4, 6, 2), (32, 128, 4, 8, 2), (64, 256, 4, 3, 2), (128, 128, 8, 4, 4),
         # DeepSeek-V2-Lite's 2048-wide outputs: 16-64 tiles of N, so K splits fill the SMs
         (32, 128, 4, 4, 4), (64, 128, 4, 4, 4), (32, 128, 4, 4, 8), (16, 128, 4, 4, 8),
         (64, 128, 4, 3, 8), (16, 256, 4, 3, 4)],
    64: [(32, 128, 4, 4, 1), (32, 256, 4, 3, 1), (64, 64, 4, 6, 1), (64, 128, 4, 4, 1),
         (128, 64, 8, 4, 1), (128, 128, 8, 3, 1), (128, 64, 4, 5, 1), (256, 64, 8, 3, 1),
         (128, 128, 8, 4, 1), (64, 128, 4, 4, 2), (128, 64, 4, 4, 2), (128, 64, 4, 5, 4),
         (128, 128, 8, 3, 4), (256, 64, 8, 3, 4), (128, 64, 4, 6, 8),
         # run 15: two programs per SM (96 KiB of stages each) over 192-256 programs
         (64, 128, 4, 3, 4), (64, 64, 4, 6, 4), (32, 64, 4, 8, 1)],
}
# run 13: the same tile shapes with SWAP_AB (W x^T: the weight tile as the A operand of a
# Hopper wgmma from shared memory; without it, 16-row tiles run mma.sync with the weight
# tile moved through registers). (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)
SWAP_CONFIGS = {
    16: [(64, 128, 4, 6, 1), (64, 256, 4, 3, 1), (128, 128, 4, 4, 1), (128, 128, 8, 3, 1),
         (64, 128, 4, 8, 1), (32, 128, 4, 8, 1), (64, 128, 4, 4, 4), (64, 128, 4, 4, 8)],
    64: [(64, 128, 4, 4, 1), (128, 64, 8, 4, 1), (128, 128, 8, 3, 1), (64, 128, 4, 4, 2),
         (64, 64, 4, 6, 1), (64, 128, 4, 3, 4), (64, 64, 4, 6, 4)],
}


def candidate_configs(bucket: int, configs: dict = CONFIGS,
                      swap_configs: dict = SWAP_CONFIGS) -> list[dict]:
    """The bucket's launch configs for `linear_triton.linear`: `configs` as given, then
    `swap_configs` with SWAP_AB."""
    names = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K")
    return ([dict(zip(names, c)) for c in configs[bucket]]
            + [{**dict(zip(names, c)), "SWAP_AB": True} for c in swap_configs[bucket]])


def graph_us_per_call(fn, weights: list[torch.Tensor]) -> float:
    """Median replay time of a graph calling fn(w) for each w, per call, in microseconds."""
    import triton

    for w in weights:   # compile / pick kernels outside the capture
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    del graph
    return 1e3 * ms / len(weights)


def sweep_shape(name: str, bucket: int, out_features: int, in_features: int) -> dict:
    from deepinfer.kernels import linear_triton

    weight_bytes = out_features * in_features * 2
    copies = max(4, min(32, -(-(1 << 30) // weight_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(bucket)
    weights = [(torch.randn(out_features, in_features, device="cuda", generator=gen)
                * in_features ** -0.5).to(torch.bfloat16) for _ in range(copies)]
    xs = {m: torch.randn(m, in_features, device="cuda", generator=gen).to(torch.bfloat16)
          for m in BUCKETS[bucket]}
    cublas_us = sum(graph_us_per_call(lambda w, x=x: F.linear(x, w), weights)
                    for x in xs.values())
    results = []
    for config in candidate_configs(bucket):
        try:
            for x in xs.values():
                ref = F.linear(x.float(), weights[0].float())
                out = linear_triton.linear(x, weights[0], config=config).float()
                error = float((out - ref).norm() / ref.norm())
                if not error < 1e-2:
                    raise ValueError(f"relative error {error:.2e}")
            us = sum(graph_us_per_call(
                lambda w, x=x: linear_triton.linear(x, w, config=config), weights)
                for x in xs.values())
            results.append((config, us, None))
        except Exception as exc:  # shared memory exceeded, wrong result
            results.append((config, None, f"{type(exc).__name__}: {str(exc)[:80]}"))
    timed = [r for r in results if r[1] is not None]
    best_config, best_us = min(((c, u) for c, u, _ in timed), key=lambda r: r[1])
    rows_text = "+".join(str(m) for m in BUCKETS[bucket])
    print(f"{name:8s} rows {rows_text:5s}: cuBLAS {cublas_us:7.2f} us | triton best "
          f"{best_us:7.2f} us ({best_us / cublas_us:.3f}x) {best_config}", flush=True)
    del weights
    torch.cuda.empty_cache()
    return {"shape": name, "block_m": bucket, "rows_measured": list(BUCKETS[bucket]),
            "out_features": out_features, "in_features": in_features,
            "config": best_config, "triton_us": round(best_us, 2),
            "cublas_us": round(cublas_us, 2), "triton_faster": best_us < 0.99 * cublas_us,
            "all": [(c, None if u is None else round(u, 2), e) for c, u, e in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="all timings here")
    parser.add_argument("--write-configs", action="store_true",
                        help="write kernels/configs/skinny_linear_<device>.json")
    parser.add_argument("--model", choices=list(MODELS), default="llama-3-8b",
                        help="whose linears to sweep")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated subset of the model's shapes (default all of "
                             "them); with --write-configs the other shapes keep their entries")
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                        help="comma-separated row buckets; with --write-configs the other "
                             "buckets keep their entries")
    args = parser.parse_args()
    from deepinfer.kernels import linear_triton
    from deepinfer.kernels.backends import update_device_config

    names = args.shapes.split(",") if args.shapes else list(MODELS[args.model])
    entries = [sweep_shape(name, bucket, *SHAPES[name])
               for bucket in map(int, args.buckets.split(",")) for name in names]
    if args.json:
        args.json.write_text(json.dumps(entries, indent=1))
    if args.write_configs:
        keep = ("shape", "block_m", "out_features", "in_features", "config", "triton_us",
                "cublas_us", "triton_faster")
        path = update_device_config(
            linear_triton.CONFIG_KIND, [{k: e[k] for k in keep} for e in entries],
            "benchmarks/gemv_sweep.py --write-configs",
            key=lambda e: (e["block_m"], list(SHAPES).index(e["shape"])))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
