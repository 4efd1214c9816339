"""The greedy argmax over a Llama-3 vocabulary (128,256) on one GPU: one pass against two, float32
against bf16 logits, and the float32 conversion itself, each timed inside a CUDA graph.

`engine.sampler.greedy_argmax` picks between torch's one-pass argmax (a row per thread block)
and `two_pass_argmax` (chunk maxima, then the best chunk) by row count; the decode graph
(`engine/cuda_graphs.py`) takes the greedy ids from the LM head's bf16 output. This measures
what those choices rest on (benchmarks/RESULTS.md run 14).

Run: python3 benchmarks/argmax_bench.py   (CUDA; prints microseconds per call)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 128256
ROWS = (1, 8, 64, 256)
CALLS_PER_GRAPH, REPLAYS = 20, 10


def graph_us(fn, x: torch.Tensor) -> float:
    """Microseconds per call of fn(x), CALLS_PER_GRAPH calls captured in one graph."""
    fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (CALLS_PER_GRAPH * REPLAYS)


def main() -> int:
    from deepinfer.engine.sampler import two_pass_argmax

    for rows in ROWS:
        bf16 = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16)
        f32 = bf16.float()
        timings = {
            "to_float32": graph_us(lambda x: x.float(), bf16),
            "one_pass_f32": graph_us(lambda x: x.argmax(-1), f32),
            "two_pass_256_f32": graph_us(lambda x: two_pass_argmax(x, 256), f32),
            "one_pass_bf16": graph_us(lambda x: x.argmax(-1), bf16),
            "two_pass_256_bf16": graph_us(lambda x: two_pass_argmax(x, 256), bf16),
            "two_pass_128_bf16": graph_us(lambda x: two_pass_argmax(x, 128), bf16),
        }
        print(rows, {name: round(us, 2) for name, us in timings.items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
