"""How fast one SM streams a skinny GEMM's weight: the Gluon GEMM timed at growing grids.

A decode GEMM at batch 64 is memory-bound, but `kernels/linear_gluon.py` runs one program per
SM (192 KiB of pipeline stages each), so a grid of fewer programs than SMs (Llama-3-8B's qkv:
96 output tiles on 132 SMs) can only reach the HBM rate if one program streams its share fast
enough. This times `linear_gluon.launch` on [M, K] x [N, K]^T with N = 64 x programs (BLOCK_N
64, one K split) for a range of program counts, K = 4096 and 14336, M = 64 (and M = 16: a
quarter of the x bytes each program also reads, from L2), then Llama-3-8B's four decode GEMMs
per tile and with stream-K (`kernels/linear_gluon_stream_k.py`), and prints per shape:
microseconds per call, weight bytes per second, that as a fraction of the copy bandwidth
measured in the same run, and weight bytes per second per program.

Each timing is a CUDA graph of calls on distinct weights (more bytes than L2 holds), chained
with programmatic dependent launch as in the engine. H200 only (Gluon's Hopper TMA / wgmma).

With --tiles: the same four GEMMs at other one-wave tilings (wider weight tiles read x once for
two or four wgmma row blocks; more K splits keep the programs near the SM count).

Run: python3 benchmarks/gluon_grid_sweep.py [--llama-only | --tiles] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROGRAMS = (33, 66, 96, 132, 198, 264)
L2_MULTIPLE_BYTES = 400 * 2 ** 20     # weights per graph: well past the 50 MiB L2


def gemm_us(rows: int, out_features: int, in_features: int, split_k: int = 1,
            gated: bool = False, stream_k: int = 0, block_n: int = 64) -> float:
    """Microseconds per call of the Gluon GEMM ([block_n]-row weight tiles) in a graph of calls
    on distinct weights; with stream_k, `linear_gluon_stream_k`'s kernel over that many
    programs (split_k unused)."""
    from benchmarks.blas_sweep import graph_us
    from deepinfer.kernels import linear_gluon, linear_gluon_stream_k, pdl
    from deepinfer.kernels.backends import arrival_counters

    device = torch.device("cuda")
    weight_rows = out_features * (2 if gated else 1)
    weight_bytes = weight_rows * in_features * 2
    calls = max(4, L2_MULTIPLE_BYTES // weight_bytes)
    weights = [torch.randn(weight_rows, in_features, device=device, dtype=torch.bfloat16)
               for _ in range(calls)]
    x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
    out = torch.empty(rows, out_features, device=device, dtype=torch.bfloat16)
    partial = torch.empty(split_k, rows, out_features, device=device, dtype=torch.float32)
    counters = arrival_counters(device)
    options = pdl.launch_options(device)

    def run():
        for weight in weights:
            if stream_k:
                linear_gluon_stream_k.launch(
                    x, weight, None, out, counters, out, 0, block_m=max(16, rows),
                    block_n=block_n, norm_eps=None, gated=gated, residual=None,
                    emit_ss=False, pdl_options=options)
                continue
            linear_gluon.launch(x, weight, None, out, partial, counters, out, 0,
                                block_m=max(16, rows), block_n=block_n, split_k=split_k,
                                norm_eps=None, gated=gated, residual=None, emit_ss=False,
                                maxima=out, columns=out, emit_argmax=False,
                                pdl_options=options)

    saved = linear_gluon_stream_k.PROGRAMS
    linear_gluon_stream_k.PROGRAMS = stream_k or None
    try:
        return graph_us(run) / calls
    finally:
        linear_gluon_stream_k.PROGRAMS = saved


# --tiles: Llama-3-8B's 64-row decode GEMMs (rows, N, K, gated) and the one-wave (BLOCK_N,
# SPLIT_K) tilings tried for each (the first: the committed config)
TILINGS = {"qkv": ((64, 6144, 4096, False), ((64, 1), (128, 2), (128, 1), (256, 4), (256, 2))),
           "o": ((64, 4096, 4096, False), ((64, 1), (64, 2), (128, 4), (128, 2), (256, 8),
                                           (256, 4))),
           "gate_up": ((64, 14336, 4096, True), ((64, 1), (128, 1))),
           "down": ((64, 4096, 14336, False), ((64, 2), (64, 1), (128, 4), (128, 2), (256, 8),
                                               (256, 4)))}


def tiling_sweep(copy_bandwidth: float) -> list[dict]:
    """TILINGS' cases: us per call, and against the committed tiling of the same GEMM."""
    results = []
    print(f"{'gemm':>8} {'BLOCK_N':>7} {'split':>5} {'programs':>8} {'us':>8} {'/copy':>6} "
          f"{'/committed':>10}")
    for name, ((rows, n, k, gated), tilings) in TILINGS.items():
        committed = None
        for block_n, split_k in tilings:
            us = gemm_us(rows, n, k, split_k, gated, block_n=block_n)
            committed = committed or us
            rate = n * (2 if gated else 1) * k * 2 / (us * 1e-6)
            row = dict(gemm=name, block_n=block_n, split_k=split_k,
                       programs=-(-n // block_n) * split_k, us=us,
                       of_copy=rate / copy_bandwidth, of_committed=us / committed)
            results.append(row)
            print(f"{name:>8} {block_n:>7} {split_k:>5} {row['programs']:>8} {us:>8.2f} "
                  f"{row['of_copy']:>6.3f} {row['of_committed']:>10.3f}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--llama-only", action="store_true",
                        help="only Llama-3-8B's four GEMMs, per tile and stream-K")
    parser.add_argument("--tiles", action="store_true",
                        help="only Llama-3-8B's four GEMMs at the tilings of TILINGS")
    args = parser.parse_args()
    from benchmarks.gpu_decode import measure_ceilings
    from deepinfer.kernels import backends

    copy_bandwidth = measure_ceilings()["copy_bandwidth_Bps"]
    num_sms = backends.num_sms(0)
    print(f"copy bandwidth {copy_bandwidth / 1e12:.3f} TB/s, {num_sms} SMs", flush=True)
    if args.tiles:
        results = tiling_sweep(copy_bandwidth)
        if args.json:
            args.json.write_text(json.dumps(dict(copy_bandwidth_Bps=copy_bandwidth,
                                                  num_sms=num_sms, tilings=results), indent=1))
        return 0
    cases = []
    if not args.llama_only:
        cases += [(64, 64 * p, 4096, 1, False) for p in PROGRAMS]
        cases += [(16, 64 * p, 4096, 1, False) for p in (96, 132)]
        cases += [(64, 4096, 14336, s, False) for s in (1, 2, 3, 4)]
        cases += [(64, 64 * p, 14336, 1, False) for p in (96, 132)]
    # Llama-3-8B's decode GEMMs at their 64-row configs (qkv, o, gate_up, down), then stream-K
    llama = [(64, 6144, 4096, 1, False), (64, 4096, 4096, 1, False),
             (64, 14336, 4096, 1, True), (64, 4096, 14336, 2, False)]
    # stream-K (split -P: over P programs): on the SMs, and on as many programs as tiles (one
    # whole tile each, no partials: the kernel's own cost against the per-tile kernel's)
    cases += llama + [case[:3] + (-num_sms,) + case[4:] for case in llama]
    cases += [(64, 6144, 4096, -96, False), (64, 4096, 14336, -64, False),
              (64, 4096, 14336, -128, False)]
    # 16 rows (a quarter of the x bytes): does stream-K's loss follow x's reads?
    cases += [(16, 6144, 4096, 1, False), (16, 6144, 4096, -num_sms, False),
              (16, 4096, 14336, 2, False), (16, 4096, 14336, -num_sms, False)]
    results = []
    print(f"{'M':>3} {'N':>6} {'K':>6} {'split':>5} {'gated':>5} {'programs':>8} {'us':>8} "
          f"{'TB/s':>6} {'/copy':>6} {'GB/s/prog':>9}   (split -P: stream-K on P programs)")
    for rows, n, k, split_k, gated in cases:
        us = gemm_us(rows, n, k, max(split_k, 1), gated, stream_k=max(-split_k, 0))
        weight_bytes = n * (2 if gated else 1) * k * 2
        programs = (n // 64) * split_k if split_k > 0 else -split_k
        rate = weight_bytes / (us * 1e-6)
        row = dict(rows=rows, out_features=n, in_features=k, split_k=split_k, gated=gated,
                   programs=programs, us=us, weight_Bps=rate, of_copy=rate / copy_bandwidth,
                   per_program_Bps=rate / min(programs, num_sms))
        results.append(row)
        print(f"{rows:>3} {n:>6} {k:>6} {split_k:>5} {gated!s:>5} {programs:>8} {us:>8.2f} "
              f"{rate / 1e12:>6.3f} {rate / copy_bandwidth:>6.3f} "
              f"{row['per_program_Bps'] / 1e9:>9.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(copy_bandwidth_Bps=copy_bandwidth,
                                              num_sms=num_sms, cases=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
