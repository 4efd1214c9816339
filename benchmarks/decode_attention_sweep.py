"""Launch-config sweep of the Triton paged-attention decode kernel on one GPU.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, 16-token blocks on
shuffled block tables) at the decode benchmark's batches and mean context (192 tokens); for each
(BLOCK_N, num_warps, num_stages) the decode call (kernel + split reduce) is timed inside a CUDA
graph, as the engine runs it (max_seq_len = 8192, as in a captured graph, so the split count is
the graph's). Printed: microseconds per call (graph replay, launch included) and the KV bytes
read over that time in TB/s.

Run: python3 benchmarks/decode_attention_sweep.py [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCHES, CONTEXT = (1, 64), 192
BLOCK_NS, WARPS, STAGES = (32, 64, 128), (4, 8), (1, 2, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
    from gpu_common import random_paged_batch  # noqa: I001 (tests/kernels on sys.path)

    from benchmarks.blas_sweep import graph_us

    from deepinfer.kernels import paged_attention_triton as pat

    print(f"defaults (BLOCK_N, num_warps, num_stages): "
          f"{(pat._DECODE_BLOCK_N, *pat._DECODE_LAUNCH)}")
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
                us = graph_us(lambda: pat._decode(query, kv_cache, metadata, 0.088))
            except Exception as error:  # noqa: BLE001 - a config Triton cannot build
                print(f"b={batch} {block_n}/{warps}/{stages}: {type(error).__name__}")
                continue
            rows.append({"batch": batch, "BLOCK_N": block_n, "num_warps": warps,
                         "num_stages": stages, "us": us,
                         "kv_read_TBps": kv_bytes / (us * 1e6)})
        pat._DECODE_BLOCK_N, pat._DECODE_LAUNCH = saved
        rows.sort(key=lambda r: r["us"])
        print(f"b={batch}: best: " + "; ".join(
            f"{r['BLOCK_N']}/{r['num_warps']}/{r['num_stages']} {r['us']:.1f} us "
            f"({r['kv_read_TBps']:.2f} TB/s)" for r in rows[:5]), flush=True)
        results += rows
    if args.json:
        args.json.write_text(json.dumps({"rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
