"""A layer's 64-row decode GEMMs after its attention (o, gate_up, down, next qkv): four Gluon
kernels against the persistent layer kernel, on an H200.

Llama-3-8B shapes (hidden 4096, intermediate 14336, qkv 6144; o and down split twice, as
`kernels/configs` tuned them until run 22, which left o unsplit), LAYERS layers with distinct
weights (more bytes than L2 holds), each path captured in a CUDA graph with PDL as in the
engine. Prints microseconds per layer, the weight bytes per layer over that time as a
fraction of the copy bandwidth measured in the same run (the decode roofline's rate), and the
persistent kernel's time over the four kernels'. Runs alternate (A B A B) so that drift shows.

With --variants, the persistent kernel also runs with each of VARIANTS' synchronisation
settings (`linear_gluon_layer.VARIANT`).

With --trace, one eager chain of the persistent kernel stores each program's global timer at
its GEMMs' waits, K-loop ends and done counts (`linear_gluon_layer.launch(trace=...)`), and a
middle layer's timeline is printed: per GEMM, microseconds from the kernel's start to its first
program's wait ending, to the median and last K-loop end, and to its last done count.

Run: python3 benchmarks/gluon_layer_bench.py [--rows 64] [--variants a,b] [--trace]
     [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144
LAYERS = 8
# name: (`linear_gluon_layer.VARIANT` settings, o's K split)
VARIANTS = {"prefetch_first": (dict(PREFETCH_FIRST=True, EARLY=6), 2),
            "prefetch_after": (dict(PREFETCH_FIRST=False, EARLY=6), 2),
            "early2_first": (dict(PREFETCH_FIRST=True, EARLY=2), 2),
            "o_split1": ({}, 1)}


def layer_weights(device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """LAYERS (o, gate_up, down, qkv) weights of random bf16."""
    def weight(rows, cols):
        return torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * cols ** -0.5

    return [(weight(HIDDEN, HIDDEN), weight(2 * INTERMEDIATE, HIDDEN),
             weight(HIDDEN, INTERMEDIATE), weight(QKV, HIDDEN)) for _ in range(LAYERS)]


def path_us(launch, rows: int, weights, o_split: int = 2) -> float:
    """Median graph replay microseconds per layer of `launch` over the layers."""
    from benchmarks.blas_sweep import graph_us
    from deepinfer.kernels import pdl

    device = weights[0][0].device
    attn_out = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    stream = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    options = pdl.launch_options(device)

    def run():
        for layer in weights:
            launch(attn_out, stream, *layer, 1e-5, 1e-5, o_split=o_split, down_split=2,
                   pdl_options=options)

    return graph_us(run) / len(weights)


def timeline(rows: int, weights, o_split: int = 2) -> list[dict]:
    """Per GEMM of a middle layer's persistent kernel: microseconds from the kernel's first
    program past the PDL wait to (first wait end, median K-loop end, last K-loop end, last
    done count)."""
    from deepinfer.kernels import linear_gluon_layer, pdl

    device = weights[0][0].device
    attn_out = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    stream = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    traces = [torch.zeros(256, 16, dtype=torch.int64, device=device) for _ in weights]
    for layer, trace in zip(weights, traces):
        linear_gluon_layer.launch(attn_out, stream, *layer, 1e-5, 1e-5, o_split=o_split,
                                  down_split=2, pdl_options=pdl.launch_options(device),
                                  trace=trace)
    torch.cuda.synchronize()
    stamps = traces[len(traces) // 2].cpu().double()
    start = stamps[:, 0][stamps[:, 0] > 0].min()
    rows_out = []
    for gemm, name in enumerate(("o", "gate_up", "down", "qkv")):
        waited, looped, done = (stamps[:, 3 * gemm + j] for j in (1, 2, 3))
        waited, looped, done = (v[v > 0] - start for v in (waited, looped, done))
        row = dict(gemm=name, first_wait_end_us=waited.min().item() / 1e3,
                   median_loop_end_us=looped.median().item() / 1e3,
                   last_loop_end_us=looped.max().item() / 1e3,
                   last_done_us=done.max().item() / 1e3)
        rows_out.append(row)
        print(f"{name:>8}: wait ends {row['first_wait_end_us']:7.2f}  K loops end median "
              f"{row['median_loop_end_us']:7.2f} last {row['last_loop_end_us']:7.2f}  last "
              f"done {row['last_done_us']:7.2f} us", flush=True)
    end = stamps[:, 13][stamps[:, 13] > 0].max() - start
    print(f"     end: {end.item() / 1e3:7.2f} us", flush=True)
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--variants", default="")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from benchmarks.gpu_decode import measure_ceilings
    from deepinfer.kernels import linear_gluon_layer

    copy_bandwidth = measure_ceilings()["copy_bandwidth_Bps"]
    weights = layer_weights(torch.device("cuda"))
    layer_bytes = sum(w.numel() * w.element_size() for w in weights[0])
    print(f"copy bandwidth {copy_bandwidth / 1e12:.3f} TB/s; {layer_bytes / 1e6:.1f} MB of "
          f"weights per layer; {args.rows} rows", flush=True)
    paths = {"four kernels": linear_gluon_layer.launch_separately,
             "persistent": linear_gluon_layer.launch}
    results = []

    def timed(label, launch, o_split=2):
        us = path_us(launch, args.rows, weights, o_split)
        fraction = layer_bytes / (us * 1e-6) / copy_bandwidth
        results.append(dict(path=label, us_per_layer=us, of_copy=fraction))
        print(f"{label:>17}: {us:8.2f} us per layer, {fraction:.3f} of the copy bandwidth",
              flush=True)

    trace = timeline(args.rows, weights) if args.trace else None
    for label in list(paths) * 2:
        timed(label, paths[label])
    committed = dict(linear_gluon_layer.VARIANT)
    for name in filter(None, args.variants.split(",")):
        settings, o_split = VARIANTS[name]
        linear_gluon_layer.VARIANT = {**committed, **settings}
        if args.trace:
            print(f"{name} timeline:")
            timeline(args.rows, weights, o_split)
        timed(name, linear_gluon_layer.launch, o_split)
    linear_gluon_layer.VARIANT = committed
    separate = [r["us_per_layer"] for r in results if r["path"] == "four kernels"]
    persistent = [r["us_per_layer"] for r in results if r["path"] == "persistent"]
    ratio = min(persistent) / min(separate)
    print(f"persistent / four kernels (best of two each): {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps(dict(copy_bandwidth_Bps=copy_bandwidth, rows=args.rows,
                                             layer_bytes=layer_bytes, runs=results,
                                             timeline=trace,
                                             persistent_over_separate=ratio), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
