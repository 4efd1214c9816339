"""What an L2 prefetch on a side stream saves the decode GEMM that follows a gap, on one GPU.

For each Llama-3-8B decode weight (qkv, o, gate_up, down) at 1 and 64 rows, three CUDA graphs are
timed (median of replays, CUDA events):

- base: flush the L2 (write 256 MB), then a gap (`torch.cuda._sleep`, standing in for the small
  kernels between two GEMMs);
- gemm: base, then the GEMM (`kernels.linear.linear`: the engine's choice of Triton or cuBLAS);
- prefetch: as gemm, with `prefetch_weight` of the weight forked onto a side stream before the
  gap (`kernels/l2_prefetch.py`), for several bulk-prefetch chunk sizes.

Printed: the GEMM's share (graph - base) with and without the prefetch, and the weight bytes over
that time as a fraction of the measured copy bandwidth (read + write, as in gpu_decode.py).

Run: python3 benchmarks/l2_prefetch_probe.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
GAP_CYCLES = (0, 4000, 16000)       # ~0, 2, 8 us at ~1.98 GHz
CHUNKS = (4096, 16384, 65536)


def _graph_us(fn, replays: int = 40) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _graph_us(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (us * 1e-6)


def probe(rows: int, name: str, flush: torch.Tensor, gap: int, bandwidth: float) -> dict:
    from kernels import l2_prefetch, l2_prefetch_triton
    from kernels.linear import linear

    out_features, in_features = SHAPES[name]
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)

    def run(gemm: bool, prefetch: bool):
        flush.zero_()
        with l2_prefetch.weight_prefetch(x.device, enabled=prefetch):
            l2_prefetch.prefetch_weight(weight)
            if gap:
                torch.cuda._sleep(gap)
            if gemm:
                linear(x, weight)

    base = _graph_us(lambda: run(False, False))
    plain = _graph_us(lambda: run(True, False)) - base
    result = {"rows": rows, "weight": name, "gap_cycles": gap, "base_us": base, "gemm_us": plain}
    weight_bytes = weight.numel() * 2
    prefetched = min(weight_bytes, l2_prefetch.MAX_BYTES)
    saved_chunk = l2_prefetch_triton.CHUNK_BYTES
    try:
        for chunk in CHUNKS:
            l2_prefetch_triton.CHUNK_BYTES = chunk
            prefetch_only = _graph_us(lambda: run(False, True)) - base
            with_prefetch = _graph_us(lambda: run(True, True)) - base
            result[f"chunk_{chunk}"] = {"gemm_us": with_prefetch,
                                        "prefetch_only_us": prefetch_only}
    finally:
        l2_prefetch_triton.CHUNK_BYTES = saved_chunk
    result["fraction_of_copy_bw"] = weight_bytes / (plain * 1e-6) / bandwidth
    result["prefetched_MB"] = prefetched / 1e6
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    print("| rows | weight | gap (cycles) | GEMM us | GEMM us with prefetch, chunk "
          + " / ".join(str(c) for c in CHUNKS) + " |\n|---|---|---|---|---|")
    for rows in (1, 64):
        for name in SHAPES:
            for gap in GAP_CYCLES:
                r = probe(rows, name, flush, gap, bandwidth)
                results.append(r)
                pf = " / ".join(f"{r[f'chunk_{c}']['gemm_us']:.1f}" for c in CHUNKS)
                print(f"| {rows} | {name} | {gap} | {r['gemm_us']:.1f} | {pf} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"copy_bandwidth_Bps": bandwidth, "rows": results},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
