"""cuBLAS against cuBLASLt for the decode-sized linears of Llama-3-8B, on one GPU.

For each (row bucket 1..256, linear) the two front ends of torch's bf16 `F.linear`
(`torch.backends.cuda.preferred_blas_library`) are timed inside a CUDA graph of one linear per
layer, each on its own weight (so no weight is read from L2): microseconds per linear and the
weight bytes over that time. With --write-configs the choice per shape is written to
`kernels/configs/blas_library_<device name>.json` (cuBLASLt where it was at least 2% faster),
which `kernels/blas_choice.py` reads.

Run: python3 benchmarks/blas_sweep.py [--write-configs] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MARGIN = 0.98   # cuBLASLt is chosen where it takes < 98% of cuBLAS's time


def graph_us(fn, replays: int = 20) -> float:
    """Median replay time in microseconds of a CUDA graph of fn() (CUDA events, after 3
    warm-up replays; fn runs once eagerly first, so kernels compile outside the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[3:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-configs", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from deepinfer.kernels.backends import write_device_config
    from deepinfer.kernels.blas_choice import CONFIG_KIND, preferring

    entries = []
    for name, (out_features, in_features) in SHAPES.items():
        copies = 2 if name == "lm_head" else 32
        weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
                   for _ in range(copies)]
        for rows in ROWS:
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            times = {}
            for library in ("cublas", "cublaslt"):
                with preferring(library):
                    times[library] = graph_us(lambda: [F.linear(x, w) for w in weights]) / copies
            choice = "cublaslt" if times["cublaslt"] < MARGIN * times["cublas"] else "cublas"
            entries.append({"shape": name, "rows": rows, "out_features": out_features,
                            "in_features": in_features, "cublas_us": round(times["cublas"], 2),
                            "cublaslt_us": round(times["cublaslt"], 2), "library": choice})
            tb_s = out_features * in_features * 2 / (min(times.values()) * 1e6)
            print(f"{name:8s} rows {rows:3d}: cuBLAS {times['cublas']:7.1f} us, cuBLASLt "
                  f"{times['cublaslt']:7.1f} us -> {choice} ({tb_s:.2f} TB/s)", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.write_configs:
        path = write_device_config(CONFIG_KIND, entries,
                                   "benchmarks/blas_sweep.py --write-configs")
        print(f"wrote {path}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "entries": entries}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
