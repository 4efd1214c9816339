"""Decode layer boundaries inside CUDA graphs: the fused GEMMs of `kernels/fused_linear.py`
against the unfused ops the engine runs otherwise; Llama-3-8B or DeepSeek-V2-Lite shapes
(`--model`), bf16. Writes the config file the engine reads
(`kernels/configs/fused_linear_<device>.json`), keeping the other model's entries.

A boundary is where a residual add and an RMSNorm sit after a linear (`BOUNDARIES`):
- Llama, attn_to_mlp: o_proj -> add + RMSNorm -> gate_up_proj -> SiLU-mul, against o_proj with
  the residual added in its epilogue -> gate_up_proj with the norm and SiLU-mul in its epilogue;
- Llama, mlp_to_attn: down_proj -> add + RMSNorm -> qkv_proj, against down_proj with the
  residual add -> qkv_proj with the norm.
- DeepSeek-V2-Lite, attn_to_moe: o_proj -> add + RMSNorm (a kernel of its own: it feeds the
  router and the experts), against o_proj with the residual add -> RMSNorm;
- DeepSeek-V2-Lite, moe_to_attn: the shared experts' down_proj -> add + RMSNorm -> the merged
  q_proj + kv_a_proj_with_mqa GEMM (3072 + 576 rows), against the down_proj with the residual
  add -> the q + kv_a GEMM with the norm. In the engine the routed experts' combine sits
  between the two (the same kernel either way, not timed here) and changes the stream, so the
  norm GEMM takes its sums of squares from the stream, not from the down projection.
  Layer 0's dense down_proj is not swept (one layer of 27): it runs unfused.
Where nothing changes the stream between them, the fused residual GEMM also writes its rows' sums
of squares, which the norm GEMM after it reads (`kernels.fused_linear.AddedRows`), as in the
engine; such a norm GEMM's configs are timed on such partials.
For each row bucket (16: measured at 1 and 16 rows, summed; 64: at 64 rows), each fused kernel's
tile config is picked from CANDIDATES (each checked against the unfused ops: relative error
< 1e-2), then both chains are timed over distinct weight copies (>= 1 GB, so nothing is served
from L2) in one graph each (median replay / calls, as `gemv_sweep.py`). A boundary runs fused
(its kernels marked `fused_faster`) unless its unfused chain is at least 1% faster: in the
engine the unfused chain also pays for its two extra kernels' launch gaps and for the cuBLAS
GEMM's lack of programmatic dependent launch, which a chain of the boundary alone hides (H200,
run 16: the 64-row attn_to_mlp boundary measured 80.70 us fused against 80.37 unfused, ran
unfused, and the decode graph's replay rose to 5.06 ms over a kernel sum of 4.93).

Run: python3 benchmarks/fused_linear_sweep.py [--model llama-3-8b|deepseek-v2-lite]
     [--json PATH] [--write-configs] [--buckets 16,64]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

# the checkout root last, as `deepinfer` puts it: first, its kernels/ would shadow HF's `kernels`
# distribution for everything imported later (transformers, or a test session importing this)
sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.gemv_sweep import (BUCKETS, SHAPES, SWAP_CONFIGS,  # noqa: E402
                                   graph_us_per_call)
from benchmarks.gemv_sweep import candidate_configs as launch_configs  # noqa: E402

EPS = 1e-5
UNFUSED_MARGIN = 1.01   # the unfused chain runs only when this much faster


@dataclass(frozen=True)
class Boundary:
    """A residual add + RMSNorm after linear `first` (fused: "residual"), feeding linear
    `second` (fused: `second_fusion`, "norm" or "norm_gated") or, with `second` None, the
    RMSNorm kernel alone. `handoff`: the norm GEMM reads the residual GEMM's sums of squares
    (nothing changes the stream between them). Names: `gemv_sweep.SHAPES`'."""

    first: str
    second: str | None = None
    second_fusion: str | None = None
    handoff: bool = False


# model -> boundary label -> Boundary; labels are the config file's keys, unique over models
MODELS = {
    "llama-3-8b": {"attn_to_mlp": Boundary("o", "gate_up", "norm_gated", handoff=True),
                   "mlp_to_attn": Boundary("down", "qkv", "norm", handoff=True)},
    "deepseek-v2-lite": {"attn_to_moe": Boundary("v2lite_o"),
                         "moe_to_attn": Boundary("v2lite_shared_down", "v2lite_q_kv_a",
                                                 "norm")},
}
BOUNDARIES = {label: b for boundaries in MODELS.values() for label, b in boundaries.items()}
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): gemv_sweep's winners per bucket and their
# neighbours, and gemv_sweep.SWAP_CONFIGS with SWAP_AB (its split-K ones: V2-Lite's 2048-wide
# outputs); norm fusions skip SPLIT_K > 1, gated ones halve BLOCK_N (two weight tiles per step)
CANDIDATES = {
    16: [(16, 128, 4, 6, 1), (32, 128, 4, 8, 1), (32, 256, 4, 4, 1), (64, 128, 4, 4, 1),
         (64, 128, 4, 6, 1), (64, 256, 4, 3, 1), (128, 128, 8, 3, 1), (32, 128, 4, 8, 2)],
    64: [(64, 128, 4, 4, 1), (64, 64, 4, 6, 1), (128, 64, 8, 4, 1), (128, 128, 8, 3, 1),
         (128, 64, 4, 5, 1), (256, 64, 8, 3, 1), (64, 128, 4, 4, 2), (128, 64, 4, 4, 2),
         (64, 128, 4, 3, 4), (64, 64, 4, 6, 4), (32, 128, 4, 4, 1), (32, 64, 4, 8, 1)],
}


def unfused_boundary(boundary: Boundary, x, weights, residual, ones):
    """The engine's ops without fusion (kernels.linear dispatch, Triton add + RMSNorm with the
    folded norm's all-ones weight `ones`, SiLU-mul); weights: one copy per linear."""
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.linear import linear
    from deepinfer.kernels.rms_norm import rms_norm

    normed, _ = rms_norm(linear(x, weights[0]), ones, EPS, residual)
    if boundary.second is None:
        return normed
    out = linear(normed, weights[1])
    return silu_and_mul(out) if boundary.second_fusion == "norm_gated" else out


def fused_call(fusion: str, x, weight, residual, config: dict, added=None):
    """The fused kernel as the engine runs it: a residual GEMM returns the stream (and writes
    its rows' sums of squares); a norm GEMM reads `added`'s where given."""
    from deepinfer.kernels.fused_linear import fused_linear_add, fused_norm_linear

    if fusion == "residual":
        return fused_linear_add(x, weight, None, residual, config)[1]
    return fused_norm_linear(added, x, EPS, weight, None, config, gated=fusion == "norm_gated")


def fused_chain(boundary: Boundary, x, weights, residual, configs, ones):
    """A fused boundary: the residual GEMM, then the norm GEMM on its stream (and, with
    `handoff`, its sums of squares: `kernels.fused_linear.AddedRows`) or the RMSNorm kernel."""
    from deepinfer.kernels.fused_linear import fused_linear_add
    from deepinfer.kernels.rms_norm import rms_norm

    added, stream = fused_linear_add(x, weights[0], None, residual, configs[0])
    if boundary.second is None:
        return rms_norm(stream, ones, EPS)
    return fused_call(boundary.second_fusion, stream, weights[1], None, configs[1],
                      added if boundary.handoff else None)


def handed_over(stream: torch.Tensor, tiles: int = 64):
    """AddedRows for `stream` [M, H] as a residual GEMM of H / tiles columns per tile writes
    them (what the engine's norm GEMM reads)."""
    from deepinfer.kernels import fused_linear

    squares = stream.float().pow(2).view(stream.shape[0], tiles, -1).sum(-1)
    return fused_linear.AddedRows(squares.t().contiguous())


def candidate_configs(fusion: str, bucket: int) -> list[dict]:
    """CANDIDATES and gemv_sweep.SWAP_CONFIGS (with SWAP_AB) as launch configs for `fusion`."""
    configs = []
    for config in launch_configs(bucket, CANDIDATES, SWAP_CONFIGS):
        if fusion != "residual" and config["SPLIT_K"] > 1:
            continue
        if fusion == "norm_gated":
            config["BLOCK_N"] = max(16, config["BLOCK_N"] // 2)
        if config not in configs:
            configs.append(config)
    return configs


def reference(fusion: str, x, weight, residual) -> torch.Tensor:
    """float32 result of the fused op on one weight (the residual not modified)."""
    import torch.nn.functional as F

    if fusion == "residual":
        return residual.float() + F.linear(x.float(), weight.float())
    xf = x.float()
    out = F.linear(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS), weight.float())
    if fusion == "norm_gated":
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


def pick_config(fusion: str, bucket: int, weights, inputs, *, handoff: bool = False
                ) -> tuple[dict, float, list]:
    """The fastest correct candidate config: (config, us summed over the bucket's rows, all).
    A norm GEMM is timed as it runs after a residual one: with `handoff`, on its sums of
    squares."""
    results = []
    inputs = [(x, residual, handed_over(x) if handoff and fusion != "residual" else None)
              for x, residual in inputs]
    for config in candidate_configs(fusion, bucket):
        try:
            for x, residual, added in inputs:
                ref = reference(fusion, x, weights[0], residual)
                out = fused_call(fusion, x, weights[0], residual.clone(), config, added).float()
                error = float((out - ref).norm() / ref.norm())
                if not error < 1e-2:
                    raise ValueError(f"relative error {error:.2e}")
            us = sum(graph_us_per_call(
                lambda w, x=x, r=residual, a=added: fused_call(fusion, x, w, r, config, a),
                weights) for x, residual, added in inputs)
            results.append((config, round(us, 2), None))
        except Exception as exc:  # shared memory exceeded, wrong result
            results.append((config, None, f"{type(exc).__name__}: {str(exc)[:80]}"))
    config, us = min(((c, u) for c, u, _ in results if u is not None), key=lambda r: r[1])
    return config, us, results


def _weights(name: str, copies: int, gen) -> list[torch.Tensor]:
    out_features, in_features = SHAPES[name]
    return [(torch.randn(out_features, in_features, device="cuda", generator=gen)
             * in_features ** -0.5).to(torch.bfloat16) for _ in range(copies)]


def sweep_boundary(label: str, bucket: int) -> list[dict]:
    """One boundary at one row bucket: its fused kernels' configs, both chains' times, and
    the config-file entries (one per linear)."""
    boundary = BOUNDARIES[label]
    names = [boundary.first] + ([boundary.second] if boundary.second else [])
    fusions = ["residual"] + ([boundary.second_fusion] if boundary.second else [])
    hidden = SHAPES[boundary.first][0]
    chain_bytes = 2 * sum(SHAPES[name][0] * SHAPES[name][1] for name in names)
    copies = max(4, min(32, -(-(1 << 30) // chain_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(bucket)
    weights = [_weights(name, copies, gen) for name in names]   # [linear][copy]

    def rows(in_features: int):
        return [(torch.randn(m, in_features, device="cuda", generator=gen).to(torch.bfloat16),
                 torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16))
                for m in BUCKETS[bucket]]

    first_inputs = rows(SHAPES[boundary.first][1])
    picks = [pick_config("residual", bucket, weights[0], first_inputs)]
    if boundary.second:
        picks.append(pick_config(boundary.second_fusion, bucket, weights[1],
                                 [(residual, residual) for _, residual in first_inputs],
                                 handoff=boundary.handoff))
    configs = [config for config, _, _ in picks]
    chains = list(zip(*weights))   # [copy] -> one weight per linear
    ones = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    unfused_us = fused_us = 0.0
    for x, residual in first_inputs:
        unfused_us += graph_us_per_call(lambda w, x=x, r=residual: unfused_boundary(
            boundary, x, w, r, ones), chains)
        fused_us += graph_us_per_call(lambda w, x=x, r=residual: fused_chain(
            boundary, x, w, r, configs, ones), chains)
    faster = fused_us <= unfused_us * UNFUSED_MARGIN   # run fused (see the docstring)
    rows_text = "+".join(str(m) for m in BUCKETS[bucket])
    picked = " ".join(f"{name}: {config} ({us:.2f} us)"
                      for name, (config, us, _) in zip(names, picks))
    print(f"{label:11s} rows {rows_text:5s}: unfused {unfused_us:7.2f} us | fused {fused_us:7.2f} "
          f"us ({fused_us / unfused_us:.3f}x) {picked}", flush=True)
    del weights, chains
    torch.cuda.empty_cache()
    common = {"block_m": bucket, "rows_measured": list(BUCKETS[bucket]), "boundary": label,
              "boundary_unfused_us": round(unfused_us, 2),
              "boundary_fused_us": round(fused_us, 2), "fused_faster": faster}
    return [{"fusion": fusion, "shape": name, "out_features": SHAPES[name][0],
             "in_features": SHAPES[name][1], "config": config, "fused_us": us, **common,
             "all": results}
            for name, fusion, (config, us, results) in zip(names, fusions, picks)]


def config_key(entry: dict) -> tuple[int, int, int]:
    """Order of the config file's entries: row bucket, boundary (`BOUNDARIES`), then the
    boundary's residual GEMM before its norm GEMM."""
    return (entry["block_m"], list(BOUNDARIES).index(entry["boundary"]),
            int(entry["shape"] != BOUNDARIES[entry["boundary"]].first))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama-3-8b",
                        help="whose layer boundaries to sweep")
    parser.add_argument("--json", type=Path, default=None, help="all timings here")
    parser.add_argument("--write-configs", action="store_true",
                        help="write kernels/configs/fused_linear_<device>.json (the entries of "
                             "other models and other buckets are kept)")
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                        help="comma-separated row buckets to sweep")
    args = parser.parse_args()
    from deepinfer.kernels import fused_linear
    from deepinfer.kernels.backends import update_device_config

    buckets = [int(b) for b in args.buckets.split(",")]
    entries = [entry for bucket in buckets for label in MODELS[args.model]
               for entry in sweep_boundary(label, bucket)]
    if args.json:
        args.json.write_text(json.dumps(entries, indent=1))
    if args.write_configs:
        path = update_device_config(
            fused_linear.CONFIG_KIND, [{k: v for k, v in e.items() if k != "all"}
                                       for e in entries],
            f"benchmarks/fused_linear_sweep.py --model {args.model} --write-configs",
            key=config_key)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
