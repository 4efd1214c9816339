"""The one-kernel decode attention against the three unfused kernels, on one GPU.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, 16-token blocks on
shuffled block tables), 192-token contexts (the decode benchmark's mean; --contexts), bf16. A
CUDA graph of 32 calls (one per layer, each on its own KV cache) is timed for:
- unfused: `elementwise_triton.apply_rotary_write_kv`, then `paged_attention_triton._decode`
  (the split-K decode kernel and, with several splits, its reduce kernel);
- fused: `rotary_decode_triton.rotary_decode_attention` (one kernel), at the split count the
  engine picks and, where it differs, at forced split counts (is a split worth it now that the
  reduce costs no launch?).
The graphs are captured with max_seq_len = 8192, as the engine's decode graphs are. Printed:
microseconds per layer and fused / unfused. With --sweep, the fused kernel is also timed at each
(BLOCK_N, num_warps, num_stages) of `decode_attention_sweep.py`'s grid (the engine runs
`paged_attention_triton._DECODE_BLOCK_N` / `_DECODE_LAUNCH`, swept for the unfused kernel).

Run: python3 benchmarks/rotary_decode_bench.py [--sweep] [--batches 1,8] [--contexts 64,192]
     [--json PATH]
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

BATCHES, CONTEXT, LAYERS = (1, 8, 64, 256), 192, 32
HQ, HKV, HEAD_DIM = 32, 8, 128


def graph_us_per_layer(fn) -> float:
    """Median replay time of a CUDA graph of fn(layer) for each layer, per layer (us)."""
    from benchmarks.blas_sweep import graph_us

    return graph_us(lambda: [fn(layer) for layer in range(LAYERS)]) / LAYERS


def sweep_launch_configs(fused) -> dict[str, float]:
    """{"BLOCK_N/num_warps/num_stages": us per layer} of the fused kernel over the unfused
    sweep's grid; configs Triton cannot build are left out. The defaults are restored."""
    from benchmarks.decode_attention_sweep import BLOCK_NS, STAGES, WARPS
    from deepinfer.kernels import rotary_decode_triton as fused_module

    saved = fused_module._DECODE_BLOCK_N, fused_module._DECODE_LAUNCH
    timings = {}
    try:
        for block_n, warps, stages in itertools.product(BLOCK_NS, WARPS, STAGES):
            fused_module._DECODE_BLOCK_N, fused_module._DECODE_LAUNCH = block_n, (warps, stages)
            try:
                timings[f"{block_n}/{warps}/{stages}"] = graph_us_per_layer(fused)
            except Exception as error:  # noqa: BLE001 - a config Triton cannot build
                print(f"{block_n}/{warps}/{stages}: {type(error).__name__}", flush=True)
    finally:
        fused_module._DECODE_BLOCK_N, fused_module._DECODE_LAUNCH = saved
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the fused kernel at every launch config of the grid")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help="comma-separated batch sizes")
    parser.add_argument("--contexts", default=str(CONTEXT),
                        help="comma-separated context lengths (tokens, the new one included)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
    from gpu_common import random_paged_batch  # noqa: I001 (tests/kernels on sys.path)

    from deepinfer.kernels import elementwise_triton, rotary_decode_triton
    from deepinfer.kernels import paged_attention_triton as pat
    from deepinfer.kernels.backends import num_sms

    rows = []
    for batch, context in itertools.product(map(int, args.batches.split(",")),
                                            map(int, args.contexts.split(","))):
        _, cache, metadata = random_paged_batch(
            [1] * batch, [context - 1] * batch, num_q_heads=HQ, num_kv_heads=HKV,
            head_dim=HEAD_DIM, block_size=16, dtype=torch.bfloat16, seed=batch,
            spare_blocks=64)
        caches = [cache] + [cache.clone() for _ in range(LAYERS - 1)]
        metadata = dataclasses.replace(metadata, max_seq_len=8192)   # as in a captured graph
        qkv = torch.randn(batch, (HQ + 2 * HKV) * HEAD_DIM, device="cuda").to(torch.bfloat16)
        angles = torch.rand(batch, 1, HEAD_DIM // 2, device="cuda") * 6.28
        cos = angles.cos().repeat(1, 1, 2).to(torch.bfloat16)
        sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(torch.bfloat16)
        scale = HEAD_DIM ** -0.5

        def unfused(layer):
            query = elementwise_triton.apply_rotary_write_kv(qkv, HQ, HKV, cos, sin,
                                                             caches[layer],
                                                             metadata.slot_mapping)
            pat._decode(query, caches[layer], metadata, scale)

        def fused(layer):
            rotary_decode_triton.rotary_decode_attention(qkv, HQ, cos, sin, caches[layer],
                                                         metadata, scale)

        engine_splits = pat.num_decode_splits(batch, HKV, 8192, num_sms(0))
        row = {"batch": batch, "context": context, "splits": engine_splits,
               "unfused_us": graph_us_per_layer(unfused), "fused_us": graph_us_per_layer(fused)}
        row["fused_over_unfused"] = row["fused_us"] / row["unfused_us"]
        for forced in sorted({1, 2, 4, engine_splits} - {engine_splits}):
            rotary_decode_triton.num_decode_splits = lambda *_, n=forced: n
            try:
                row[f"fused_us_splits{forced}"] = graph_us_per_layer(fused)
            finally:
                rotary_decode_triton.num_decode_splits = pat.num_decode_splits
        if args.sweep:
            row["fused_us_by_config"] = sweep_launch_configs(fused)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
