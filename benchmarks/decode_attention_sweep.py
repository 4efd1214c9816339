"""Launch-config sweep of the Triton paged-attention decode kernel on one GPU.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, 16-token blocks on
shuffled block tables) at the decode benchmark's batches and mean context (192 tokens); for each
(BLOCK_N, num_warps, num_stages) the decode call (kernel + split reduce) is timed inside a CUDA
graph, as the engine runs it (max_seq_len = 8192, as in a captured graph, so the split count is
the graph's). Printed: microseconds per call and the KV bytes read over that time as a fraction
of the measured copy bandwidth (bytes read + written, as in gpu_decode.py).

Run: python3 benchmarks/decode_attention_sweep.py [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCHES, CONTEXT = (1, 64), 192
BLOCK_NS, WARPS, STAGES = (32, 64, 128), (4, 8), (1, 2, 3)


def _graph_us(fn, replays: int = 50) -> float:
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
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
    from gpu_common import random_paged_batch

    from kernels import paged_attention_triton as pat

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 2 / (_graph_us(lambda: dst.copy_(src), 10) * 1e-6)
    del src, dst
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; defaults (BLOCK_N, num_warps, "
          f"num_stages): {(pat._DECODE_BLOCK_N, *pat._DECODE_LAUNCH)}")
    saved = (pat._DECODE_BLOCK_N, pat._DECODE_LAUNCH)
    results = []
    for batch in BATCHES:
        query, kv_cache, metadata = random_paged_batch(
            [1] * batch, [CONTEXT - 1] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128,
            block_size=16, dtype=torch.bfloat16, seed=batch, spare_blocks=64)
        metadata = dataclasses.replace(metadata, max_seq_len=8192)   # as in a captured graph
        kv_bytes = batch * CONTEXT * 8 * 128 * 2 * 2
        rows = []
        for block_n, warps, stages in itertools.product(BLOCK_NS, WARPS, STAGES):
            pat._DECODE_BLOCK_N, pat._DECODE_LAUNCH = block_n, (warps, stages)
            try:
                us = _graph_us(lambda: pat._decode(query, kv_cache, metadata, 0.088))
            except Exception as error:  # noqa: BLE001 - a config Triton cannot build
                print(f"b={batch} {block_n}/{warps}/{stages}: {type(error).__name__}")
                continue
            rows.append({"batch": batch, "BLOCK_N": block_n, "num_warps": warps,
                         "num_stages": stages, "us": us,
                         "fraction_of_copy_bw": kv_bytes / (us * 1e-6) / bandwidth})
        pat._DECODE_BLOCK_N, pat._DECODE_LAUNCH = saved
        rows.sort(key=lambda r: r["us"])
        print(f"b={batch}: best: " + "; ".join(
            f"{r['BLOCK_N']}/{r['num_warps']}/{r['num_stages']} {r['us']:.1f} us "
            f"({r['fraction_of_copy_bw']:.2f})" for r in rows[:5]), flush=True)
        results += rows
    if args.json:
        args.json.write_text(json.dumps({"copy_bandwidth_Bps": bandwidth, "rows": results},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
