"""Compile the decode kernels for an H100 / H200 (sm_90) on a machine without a GPU, and say how
Triton lowered them: MMA kind, cp.async software pipelining, shared memory.

Triton compiles for a target it is told about, GPU or not (ptxas ships with it), so questions
like "is this K loop pipelined?" or "does this tile shape run wgmma?" cost no device time. The
kernels are compiled as the runtime would specialise them for real shapes: pointers and the
int arguments marked below as multiples of 16 (what the JIT infers from the tensors), so
cp.async can be used. Run 13 used it to find that a flat Stream-K loop was not pipelined and
that 16-row tiles run mma.sync unless SWAP_AB is set (benchmarks/RESULTS.md).

For output faithful to the device use its Triton version (3.6.0), e.g. in a separate venv:
  python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
  PYTHONPATH=/tmp/t36/lib/python3.11/site-packages python3 benchmarks/compile_sm90.py

Run: python3 benchmarks/compile_sm90.py [--ptx-dir DIR]   (DIR: write each variant's PTX)
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import sys
from pathlib import Path

# the checkout root last, as `deepinfer` puts it: first, its kernels/ would shadow HF's `kernels`
# distribution for everything imported later (transformers, or a test session importing this)
sys.path.append(str(Path(__file__).resolve().parents[1]))

GEMM_ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "residual_ptr": "*bf16",
             "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "ss_ptr": "*fp32",
             "max_ptr": "*fp32", "argmax_ptr": "*i32",
             "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "x_stride": "i32",
             "w_stride": "i32", "residual_stride": "i32", "out_stride": "i32", "eps": "fp32"}
DECODE_ARGS = {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "cache_ptr": "*bf16",
               "slot_ptr": "*i64", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
               "out_ptr": "*bf16", "part_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
               "counter_ptr": "*i32", "scale": "fp32", "qkv_stride": "i32", "cos_stride": "i32",
               "sin_stride": "i32", "bt_stride": "i32", "v_offset": "i32"}
NOT_MULTIPLE_OF_16 = {"M", "eps", "scale"}   # decode row counts; float scalars

# (label, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, fusion, SWAP_AB, sums of squares:
# the norm's partials (SS_PARTS) or emitted by the residual GEMM (-1)): the run-13 configs and
# the run-16 handoff
GEMMS = [("qkv + norm, 16 rows", 16, 64, 128, 4, 6, "norm", False, 0),
         ("qkv + norm, 16 rows, swapped", 16, 64, 128, 4, 6, "norm", True, 0),
         ("gate_up + norm + SiLU, 16 rows, swapped", 16, 64, 128, 8, 3, "norm_gated", True, 0),
         ("down + residual, 64 rows", 64, 64, 128, 4, 4, "residual", False, 0),
         ("LM head, 16 rows, swapped", 16, 128, 128, 8, 3, None, True, 0),
         ("qkv + norm from partials, 64 rows", 64, 64, 128, 4, 4, "norm", True, 64),
         ("gate_up + norm from partials, 64 rows", 64, 64, 64, 8, 4, "norm_gated", False, 64),
         ("down + residual + sums of squares, 64", 64, 64, 128, 4, 4, "residual", False, -1)]
DECODE_LABEL = "rotary decode attention, Llama-3-8B heads"
# the Gluon GEMM (kernels/linear_gluon.py) as the 64-row decode runs it: (label, BLOCK_N,
# fusion, SPLIT_K, sums of squares as in GEMMS)
GLUON_GEMMS = [("Gluon down + residual + sums of squares, 64", 64, "residual", 2, -1),
               ("Gluon gate_up + norm from partials, 64 rows", 64, "norm_gated", 1, 64),
               ("Gluon LM head + row argmax, 64 rows", 128, "argmax", 1, 0)]
GLUON_ARGS = {"bias_ptr": "*bf16", "residual_ptr": "*bf16", "out_ptr": "*bf16",
              "partial_ptr": "*fp32", "counter_ptr": "*i32", "ss_ptr": "*fp32",
              "max_ptr": "*fp32", "argmax_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
              "k_tiles_per_split": "i32", "residual_stride": "i32", "out_stride": "i32",
              "eps": "fp32"}


def compile_for_sm90(fn, args: dict, constexprs: dict, num_warps: int, num_stages: int):
    """triton.compile of `fn` for cuda:90 with the given arg types ("*bf16", "i32", ...),
    launched with PDL where the kernel has a PDL constexpr set."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**args, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(args)
             if name not in NOT_MULTIPLE_OF_16}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   "launch_pdl": bool(constexprs.get("PDL"))})


def describe(kernel) -> str:
    ptx = kernel.asm["ptx"]
    if "cp.async.bulk.tensor" in ptx:   # the Gluon GEMM: TMA copies before / after the wait
        wait = ptx.index("griddepcontrol.wait")
        return (f"mma wgmma    TMA copies before the wait {ptx[:wait].count('cp.async.bulk')}, "
                f"after {ptx[wait:].count('cp.async.bulk')}  "
                f"shared {kernel.metadata.shared // 1024:3d} KiB")
    ttgir = kernel.asm["ttgir"]
    mma = ("wgmma" if "warp_group_dot " in ttgir else
           "mma.sync" if "versionMajor = 2" in ttgir else "none")
    return (f"mma {mma:8s} cp.async copies {ttgir.count('async_copy_global_to_local'):2d}  "
            f"shared {kernel.metadata.shared // 1024:3d} KiB  "
            f"PDL wait {ptx.count('griddepcontrol.wait')}")


def variants() -> list[tuple]:
    """(label, kernel, arg types, constexprs, num_warps, num_stages) of every variant."""
    from deepinfer.kernels import linear_triton, rotary_decode_triton
    from deepinfer.kernels.settings import DEFAULT

    out = []
    for label, block_m, block_n, block_k, warps, stages, fusion, swap, parts in GEMMS:
        constexprs = dict(HAS_BIAS=False, NORM=fusion in ("norm", "norm_gated"),
                          GATED=fusion == "norm_gated", HAS_RESIDUAL=fusion == "residual",
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1,
                          EVEN_N=True, EVEN_K=True, PRECISION="tf32",
                          NORM_BY_DOT=block_m >= DEFAULT.norm_by_dot_rows,
                          SS_CHUNK=4096 // block_m, SS_CHUNKS=0 if parts else block_m,
                          SWAP_AB=swap, SS_PARTS=max(parts, 0),
                          SS_PARTS_P2=max(parts, 1), EMIT_SS=parts < 0, EMIT_ARGMAX=False, PDL=True,
                          TRIGGER_AFTER_LOOP=True)
        out.append((label, linear_triton._skinny_linear_kernel, GEMM_ARGS, constexprs, warps,
                    stages))
    decode = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GROUP=4, BLOCK_G=16, HEAD_DIM=128,
                  BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=32, PRECISION="tf32",
                  PDL=True, TRIGGER_AFTER_LOOP=False)
    out.append((DECODE_LABEL, rotary_decode_triton._rotary_decode_kernel, DECODE_ARGS, decode,
                4, 2))
    return out


@functools.cache
def quiet_gluon_leak_report() -> None:
    """Compiling a Gluon kernel (Triton 3.9) leaks 4 `ir.attribute` instances inside libtriton's
    bindings (no Python object holds them), so its nanobind teardown prints a ~25-line "nanobind:
    leaked ..." report at exit, after pytest's summary, where it reads as a failure. Triton has
    no switch for nanobind's leak warnings and silences the same report in its own compile
    workers by pointing stderr at /dev/null at exit (`triton/_compile_warmup_pool.py`); do the
    same, once, in a process that compiled Gluon here. Registered at the first compile, the
    handler runs after those registered later; output printed before exit is unaffected."""
    def stderr_to_devnull() -> None:
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    atexit.register(stderr_to_devnull)


def compile_gluon_for_sm90(block_n: int, fusion: str, split_k: int, parts: int):
    """The Gluon GEMM compiled for cuda:90 as `linear_gluon.launch` would launch it on 64 rows
    of bf16 (TMA descriptors of its box shapes, its stage count, PDL on)."""
    quiet_gluon_leak_report()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from deepinfer.kernels import linear_gluon, pdl

    def descriptor(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, linear_gluon.BOX_K], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {linear_gluon.BOX_K}],{layout!r}>"

    gated = fusion == "norm_gated"
    args = {"w_desc": descriptor(block_n), "x_desc": descriptor(64), **GLUON_ARGS}
    constexprs = dict(HAS_BIAS=False, NORM=fusion.startswith("norm"), GATED=gated,
                      HAS_RESIDUAL=fusion == "residual", EMIT_SS=parts < 0,
                      SS_PARTS=max(parts, 0), SS_PARTS_P2=max(parts, 1),
                      STAGES=linear_gluon.stages_for(64, block_n, gated),
                      SUB=linear_gluon.sub_boxes(block_n, gated), PDL=True,
                      TRIGGER_AFTER_LOOP=pdl.release_after_loop("linear_gluon"), num_warps=4,
                      EMIT_ARGMAX=fusion == "argmax", SPLIT_K=split_k)
    signature = {**args, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(args)
             if name.endswith("_ptr")}
    source = GluonASTSource(fn=linear_gluon._skinny_kernel, signature=signature,
                            constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "launch_pdl": True})


def compile_variant(label: str):
    """The compiled kernel of the variant called `label`."""
    for name, fn, arg_types, constexprs, warps, stages in variants():
        if name == label:
            return compile_for_sm90(fn, arg_types, constexprs, warps, stages)
    for name, *gluon_args in GLUON_GEMMS:
        if name == label:
            return compile_gluon_for_sm90(*gluon_args)
    raise KeyError(label)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ptx-dir", type=Path, default=None)
    args = parser.parse_args()
    import triton

    print(f"Triton {triton.__version__}, target cuda:90")
    labels = [v[0] for v in variants()] + [g[0] for g in GLUON_GEMMS]
    for label in labels:
        kernel = compile_variant(label)
        print(f"{label:42s} {describe(kernel)}", flush=True)
        if args.ptx_dir:
            args.ptx_dir.mkdir(parents=True, exist_ok=True)
            name = "".join(c if c.isalnum() else "_" for c in label)
            (args.ptx_dir / f"{name}.ptx").write_text(kernel.asm["ptx"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
