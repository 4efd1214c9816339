"""`KernelConfig`: every switch that steers which GPU kernel runs a decode linear or attention.

One frozen dataclass, handed to the kernel functions as a plain keyword argument (`settings=`);
no kernel reads a module global to decide what to run. The engine holds it as
`EngineConfig.kernel` (engine/config.py re-exports this class) and gives it to the model runner,
which hands it to the model's layers; benchmarks/gpu_decode.py builds one per A/B variant.

It lives here, not in engine/config.py, because kernels/ imports nothing of ours (DESIGN.md):
the kernels take it, the engine embeds it. Pure module: no torch import.

The defaults are the measured choices for an H200 (benchmarks/RESULTS.md names the measurement
that settled each). Where a tuned-config file (kernels/configs/<kind>_<device name>.json) has no
entry for a (device, shape), the call falls back to torch (cuBLAS, or the unfused ops): never an
error (`kernels.backends.tuned_entry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the kernels that release the next one right after their PDL wait (`kernels/pdl.py`);
# "mla_reduce": o_proj's GEMM streams its weight while MLA's split reduce runs (V2-Lite b=1 on
# the H200, same-process A/B over 3 rounds: 510.5-511.3 -> 515.5-516.1 tok/s; bitwise equal)
PDL_RELEASE_EARLY = frozenset({"attention", "linear_gluon gated", "linear_gluon residual",
                               "mla_reduce"})


@dataclass(frozen=True)
class MoETile:
    """Tile sizes of the Triton fused MoE (`kernels/moe_triton.py`) for calls whose mean rows
    per expert (tokens * top_k / experts) is at most `max_rows`.

    block_m: rows per tile (each expert's rows are padded to a multiple of it; >= 16).
    block_n: gate_up columns per program (the gate and the up tile each); down_block_n: down
        columns per program; block_k: the K step of both GEMMs.
    group_m: launch order: groups of group_m row tiles, a group's row tiles side by side for
        one column tile before the next column tile (Triton's grouped ordering); 0 (default):
        one group of all row tiles.
    swap_ab: bf16 / float32 experts (FP8 ignores it): each GEMM computes w . x^T, the weight
        tile on the MMA's M side, so block_n / down_block_n (>= 64) fill Hopper's 64-row MMA
        instead of the mostly empty block_m rows (the skinny linears' SWAP_AB).
    """

    max_rows: int
    block_m: int
    block_n: int
    down_block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 0
    swap_ab: bool = False


# decode (a few rows per expert) to prefill (hundreds): measured on the H200, RESULTS.md
# (4 x 2,048-token prefill, 768 rows per expert: 128-row tiles in groups of 8 row tiles 1.81
# ms per layer, the 64-row tiles 2.47 ms in the ungrouped order, 2.36 ms grouped)
MOE_TILES = (MoETile(2, 16, 32, 64, 128, 4, 4), MoETile(8, 16, 64, 64, 128, 4, 3),
             MoETile(32, 32, 64, 128, 64, 4, 4), MoETile(256, 64, 128, 128, 64, 8, 3, 8),
             MoETile(1 << 30, 128, 64, 256, 64, 8, 3, 8))
# pair tiles (`moe_pair_tiles_max_tokens`: one (token, k) pair per row tile, decode at batch 1).
# H200, V2-Lite, 26 MoE layers in one graph (router + shared stream + routed + combine): the
# swapped 64-column tile with 5 stages 40.3 us per layer against 42.7 for the unswapped 32-column
# one (18 tiles swept); engine b=1 500.3 against 484.6 tok/s (h28c ab JSON in benchmarks/results)
MOE_PAIR_TILE = MoETile(1, 16, 64, 64, 128, 4, 5, swap_ab=True)


def _check(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"KernelConfig.{name}: {message}")


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choices of the GPU decode path (CPU runs ignore all of them).

    fused_linears: True (default) runs the RMSNorm, SiLU-mul and residual adds in the decode
        GEMMs' prologue / epilogue where the device's `fused_linear` sweep found it faster
        (`kernels/fused_linear.py`); False runs them as their own kernels.
    sum_squares_handoff: True (default): a fused residual GEMM hands its rows' sums of squares
        to the next fused norm GEMM (`fused_linear.AddedRows`); False: the norm GEMM computes
        them from the stream.
    fused_rotary_decode: True (default): a decode-only batch on the "triton" attention backend
        runs rotary, KV write, attention and the split reduce as one kernel
        (`kernels/rotary_decode_triton.py`); False: three kernels.
    skinny_max_rows: up to this many rows (default 64) a bf16 / fp16 CUDA linear may run the
        Triton skinny GEMM where the device's `skinny_linear` sweep found it faster than cuBLAS;
        0 sends every linear to cuBLAS (and leaves no fused GEMM either).
    cublaslt_max_rows: up to this many rows (default 256) a bf16 CUDA linear on cuBLAS uses
        cuBLASLt where the device's `blas_library` sweep found it faster; 0: torch's default.
    row_argmax_epilogue: True (default): the greedy LM head takes each row's argmax in the
        skinny GEMM's epilogue; False: the sampler's own pass over the logits.
    gluon_block_m: row buckets (rows per program, of 16 / 32 / 64) whose skinny GEMMs run the
        Gluon kernel on Hopper (`kernels/linear_gluon.py`); default {64}; empty: Triton only.
    pdl: True (default): programmatic dependent launch on Hopper (`kernels/pdl.py`).
    pdl_release_early: the kernels that release the next one right after their PDL wait:
        "linear" (Triton skinny GEMM), "linear_gluon", "attention", "mla_reduce" (MLA's
        split reduce with W_UV), or "linear_gluon ROLE" for one epilogue role
        (`linear_gluon.epilogue_role`); default `PDL_RELEASE_EARLY`.
    norm_by_dot_rows: from this many rows per program (default 32) a norm GEMM computes its
        rows' sums of squares with an x x^T dot in its K loop; below, a pre-pass over x.
    quantized_max_rows: up to this many rows (default 64) a CPU linear with a Q4_1 / Q8_0
        weight runs the AVX2 block-quantized kernel.
    moe_tiles: the Triton fused MoE's tile sizes by mean rows per expert (`MoETile`), in
        increasing max_rows; default `MOE_TILES`.
    moe_pair_tile: the tile of the pair-tiles path (`moe_pair_tiles_max_tokens`; its max_rows
        is not read); default `MOE_PAIR_TILE`.
    moe_invariant_tile: the one tile of the Triton fused MoE in the batch-invariant mode
        (`batch_invariant`: no tile choice by rows per expert, no pair tiles; its max_rows is
        not read); default `MOE_TILES[1]`'s 16-row tile.
    moe_align_one_program_max_pairs: up to this many (token, k) pairs (default 256) the Triton
        MoE aligns pairs to experts in one program (`moe_triton.align`); above, an atomic rank
        kernel and a parallel layout kernel.
    moe_fp8_quantize_once_pairs: FP8 experts, from this many (token, k) pairs on (default
        512): each expert GEMM's activations are quantized to e4m3 once
        (`fp8_gemm_triton.quantize_activation`: per token for gate_up, per slot for down),
        not by every column tile inside its K loop; below (and in the batch-invariant mode),
        no extra launches. Same codes and scales either way. (H100, V2-Lite: prefill 57.3k
        -> 85.3k tok/s, decode b=256 (1,536 pairs) +12%, b=64 (384 pairs) -2.4% if applied.)
    moe_pair_tiles_max_tokens: up to this many tokens (default 1) the Triton MoE skips the
        alignment: each (token, k) pair is its own row tile of the expert GEMMs (one launch
        less; at one token no expert is read twice, at more an expert picked by several tokens
        is). 0: always aligned.
    moe_fused_router_max_rows: up to this many tokens (default 1) a CUDA MoE layer computes its
        router logits and routes in one Triton launch (`moe_routing_triton.route_hidden`: the
        last program routes the tokens one after another); above, the float32 cuBLAS GEMM and
        the one-program-per-token routing kernel. 0: never fused. (H200, V2-Lite: +11% decode
        at one token; at 8 the router + experts micro-benchmark read 192 us against 185 for the
        unfused router, so 8 tokens stay unfused.)
    moe_shared_stream_max_rows: up to this many tokens (default 16) a CUDA DeepSeek MoE layer
        runs its shared experts on a second stream, concurrently with the routed experts
        (`engine.models.deepseek.DeepseekMoEBlock`); above, one after the other. 0: never.
    moe_deep_gemm_min_rows: from this many mean rows per expert (default 128: prefill) a bf16
        MoE call on backend "auto" runs DeepGEMM's grouped GEMM where `deep_gemm` is installed
        (`kernels/moe_deep_gemm.py`); never below, where its 128-row alignment wastes work.
    batch_invariant: the batch-invariant mode (`DEEPINFER_BATCH_INVARIANT`, `--batch-invariant`,
        `LLM(batch_invariant=True)`): every row's result is the same bits whatever else is
        batched: every linear runs a fixed-order kernel (`kernels/linear.py`; on CUDA the
        Triton GEMM at one config per weight shape, the fused linears off), every token's
        attention one program over its own context (`kernels/paged_attention.py`; MLA:
        `kernels/mla_attention.py`), the fused MoE one tile (`moe_invariant_tile`) and the
        router the fixed-order float32 GEMM; models without invariant kernels on that device
        are refused at start-up (engine/batch_invariant.py). Default False.
    mla_decode_block_h: rows (heads x query tokens of a row) per program of the Triton MLA
        decode kernel (`kernels/mla_decode_triton.py`), a power of two >= 16; default 64
        (capped at the head count: V2-Lite's 16 heads run 16 rows; V3's 128 two programs).
    mla_decode_block_n: context positions per tile of the MLA decode kernel; default 32.
    mla_decode_max_splits: split-K partitions at most (a power of two); default 32.
    mla_decode_waves: split so the MLA decode programs fill ~this many waves; default 2.
    mla_decode_warps: warps of an MLA decode program of up to 32 rows (64 rows: twice as
        many); default 4.
    mla_decode_stages: software-pipelining stages of the MLA decode kernel; default 2.
    mla_decode_max_query_len: rows of up to this many new tokens (1 + k speculative) run the
        MLA decode kernel; longer chunks the prefill kernel. Default 8.
    mla_absorb_triton_max_tokens: up to this many tokens (default 16) absorbed MLA folds W_UK
        into the queries with a Triton kernel (`mla_attention_triton.absorb_query`); above,
        cuBLAS's batched GEMM. 0: always cuBLAS.
    mla_rotate_in_absorb: True (default): a decode batch of up to mla_absorb_triton_max_tokens
        tokens rotates its queries' rope dims and stores its latents inside the W_UK
        absorption kernel (`mla_attention_triton.rotate_write_and_attend`), not in a kernel
        of its own before it.
    mla_reduce_uv_max_tokens: up to this many tokens (default 16) absorbed MLA applies W_UV in
        its split reduce (`mla_decode_triton._mla_reduce_uv_kernel`, one launch less); above,
        a cuBLAS batched GEMM after the reduce. 0: never fused.
    mla_prefill_block_m: query tile of the MLA prefill kernel (`kernels/mla_prefill_triton.py`);
        default 64 (128, with 8 warps and 3 stages, measured ~25% slower at 2k tokens).
    mla_prefill_block_n: key tile of the MLA prefill kernel; default 64.
    mla_prefill: how MLA prefill chunks run on CUDA. "auto" (default): chunks without a
        prefix-cache hit through torch SDPA on expanded K/V (causal, no mask tensor; measured
        2-2.6x faster than the Triton kernel at 2k tokens, benchmarks/RESULTS.md), chunks with
        a hit through the Triton expanded kernel (SDPA would need a [q_len, seq_len] mask);
        "expanded": every chunk through the Triton expanded kernel; "absorbed": every chunk
        through the absorbed decode kernel tiled over query tokens.
    fp8_block_gemm: True: FP8 block-scaled checkpoints keep their linears in FP8 on CUDA
        devices of compute capability >= 8.9 and run the Triton block-scaled GEMM
        (`kernels/fp8_gemm_triton.py`); False (default) dequantizes at load as on CPU. Off
        by default: on the H200 (2026-12-04) a tiny FP8 DeepSeek-V3 through this GEMM left
        HF's bf16 greedy choice by up to 0.94 of the logit RMS (0.2 with the same weights
        dequantized), and the GEMM was slower than cuBLAS bf16 at decode sizes
        (tests/engine/test_gpu_deepseek_bf16.py; benchmarks/RESULTS.md).
    fp8_gemm_block_m: rows per program of the FP8 GEMM at most (16..128); default 64.
    """

    fused_linears: bool = True
    sum_squares_handoff: bool = True
    fused_rotary_decode: bool = True
    skinny_max_rows: int = 64
    cublaslt_max_rows: int = 256
    row_argmax_epilogue: bool = True
    gluon_block_m: frozenset[int] = frozenset({64})
    pdl: bool = True
    pdl_release_early: frozenset[str] = field(default=PDL_RELEASE_EARLY)
    norm_by_dot_rows: int = 32
    quantized_max_rows: int = 64
    moe_tiles: tuple[MoETile, ...] = MOE_TILES
    moe_pair_tile: MoETile = MOE_PAIR_TILE
    moe_invariant_tile: MoETile = MOE_TILES[1]
    moe_align_one_program_max_pairs: int = 256
    moe_fp8_quantize_once_pairs: int = 512
    moe_pair_tiles_max_tokens: int = 1
    moe_fused_router_max_rows: int = 1
    moe_shared_stream_max_rows: int = 16
    moe_deep_gemm_min_rows: int = 128
    batch_invariant: bool = False
    mla_decode_block_h: int = 64
    mla_decode_block_n: int = 32
    mla_decode_max_splits: int = 32
    mla_decode_waves: int = 2
    mla_decode_warps: int = 4
    mla_decode_stages: int = 2
    mla_decode_max_query_len: int = 8
    mla_absorb_triton_max_tokens: int = 16
    mla_rotate_in_absorb: bool = True
    mla_reduce_uv_max_tokens: int = 16
    mla_prefill_block_m: int = 64
    mla_prefill_block_n: int = 64
    mla_prefill: str = "auto"
    fp8_block_gemm: bool = False
    fp8_gemm_block_m: int = 64

    def __post_init__(self) -> None:
        # sets given as lists or tuples (a JSON file, a CLI) become frozensets: hashable, frozen
        object.__setattr__(self, "gluon_block_m", frozenset(self.gluon_block_m))
        object.__setattr__(self, "pdl_release_early", frozenset(self.pdl_release_early))
        _check("skinny_max_rows", 0 <= self.skinny_max_rows <= 64,
               f"{self.skinny_max_rows} must be in [0, 64] (the skinny GEMM's largest row "
               "bucket); 0 turns it off.")
        _check("cublaslt_max_rows", self.cublaslt_max_rows >= 0,
               f"{self.cublaslt_max_rows} must be >= 0; 0 keeps torch's default library.")
        _check("gluon_block_m", self.gluon_block_m <= {16, 32, 64},
               f"{sorted(self.gluon_block_m)} must be row buckets among 16, 32 and 64.")
        kernels = {"linear", "linear_gluon", "attention", "mla_reduce"}
        roles = {f"linear_gluon {r}" for r in ("gated", "residual", "norm", "plain")}
        _check("pdl_release_early", self.pdl_release_early <= kernels | roles,
               f"{sorted(self.pdl_release_early - kernels - roles)} are not kernels; use "
               f"{sorted(kernels | roles)}.")
        _check("norm_by_dot_rows", self.norm_by_dot_rows >= 1,
               f"{self.norm_by_dot_rows} must be >= 1.")
        object.__setattr__(self, "moe_tiles", tuple(
            t if isinstance(t, MoETile) else MoETile(**t) for t in self.moe_tiles))
        for name in ("moe_pair_tile", "moe_invariant_tile"):
            if not isinstance(getattr(self, name), MoETile):
                object.__setattr__(self, name, MoETile(**getattr(self, name)))
        for name, tiles in (("moe_tiles", self.moe_tiles),
                            ("moe_pair_tile", (self.moe_pair_tile,)),
                            ("moe_invariant_tile", (self.moe_invariant_tile,))):
            _check(name, bool(tiles) and all(
                t.block_m >= 16 and t.block_k >= 16 and t.block_n >= 16 and t.down_block_n >= 16
                and t.group_m >= 0 for t in tiles),
                   "needs at least one tile, each block >= 16 (tl.dot), group_m >= 0.")
        _check("moe_align_one_program_max_pairs", 0 <= self.moe_align_one_program_max_pairs
               <= 512, f"{self.moe_align_one_program_max_pairs} must be in [0, 512] (its "
               "[pairs, experts] one-hot matrix lives in registers; on the H200 3,000 pairs "
               "failed the agreement test); 0: never one program.")
        _check("moe_fused_router_max_rows", 0 <= self.moe_fused_router_max_rows <= 64,
               f"{self.moe_fused_router_max_rows} must be in [0, 64] (its last program routes "
               "the tokens one after another); 0: never fused.")
        _check("moe_pair_tiles_max_tokens", self.moe_pair_tiles_max_tokens >= 0,
               f"{self.moe_pair_tiles_max_tokens} must be >= 0; 0 always aligns.")
        _check("moe_shared_stream_max_rows", self.moe_shared_stream_max_rows >= 0,
               f"{self.moe_shared_stream_max_rows} must be >= 0; 0 turns the second stream off.")
        for name in ("mla_decode_block_h", "mla_decode_block_n", "mla_decode_max_splits",
                     "mla_prefill_block_m", "mla_prefill_block_n"):
            value = getattr(self, name)
            _check(name, value >= 1 and value & (value - 1) == 0,
                   f"{value} must be a power of two >= 1.")
        _check("mla_decode_block_h", self.mla_decode_block_h >= 16,
               f"{self.mla_decode_block_h} must be >= 16 (tl.dot's smallest M).")
        for name in ("mla_absorb_triton_max_tokens", "mla_reduce_uv_max_tokens"):
            _check(name, getattr(self, name) >= 0, f"{getattr(self, name)} must be >= 0; 0 "
                   "runs cuBLAS's batched GEMM.")
        _check("mla_decode_max_query_len", 1 <= self.mla_decode_max_query_len <= 16,
               f"{self.mla_decode_max_query_len} must be in [1, 16].")
        _check("mla_prefill", self.mla_prefill in ("auto", "expanded", "absorbed"),
               f"{self.mla_prefill!r} must be 'auto', 'expanded' or 'absorbed'.")
        _check("fp8_gemm_block_m", self.fp8_gemm_block_m in (16, 32, 64, 128),
               f"{self.fp8_gemm_block_m} must be one of 16, 32, 64, 128.")
        _check("quantized_max_rows", self.quantized_max_rows >= 0,
               f"{self.quantized_max_rows} must be >= 0; 0 turns the quantized kernel off.")


DEFAULT = KernelConfig()
