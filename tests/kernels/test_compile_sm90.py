"""The decode kernels as Triton lowers them for an H100 / H200 (sm_90), compiled on this CPU
machine (benchmarks/compile_sm90.py): properties their speed rests on, checked without a GPU.
SWAP_AB tiles must run Hopper wgmma from shared memory, the skinny GEMM's and the decode
attention's K loops must be software-pipelined (cp.async copies in flight), and with
programmatic dependent launch nothing the previous kernel writes may be read before the wait."""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs the triton package (compiles, runs nothing)")


def _copies(kernel) -> int:
    return kernel.asm["ttgir"].count("async_copy_global_to_local")


def test_swapped_16_row_tiles_run_pipelined_wgmma():
    from benchmarks.compile_sm90 import compile_variant

    kernel = compile_variant("qkv + norm, 16 rows, swapped")
    assert "warp_group_dot " in kernel.asm["ttgir"]
    assert _copies(kernel) > 0


def test_norm_from_handed_over_partials_runs_no_x_xt_dot():
    """With the residual GEMM's sums of squares (kernels/fused_linear.AddedRows) the 64-row
    norm's K loop holds only the product's MMA, not the x x^T one."""
    from benchmarks.compile_sm90 import compile_variant

    assert compile_variant("qkv + norm from partials, 64 rows").asm["ttgir"].count(
        "warp_group_dot ") == 1


def test_rotary_decode_attention_loop_is_pipelined():
    from benchmarks.compile_sm90 import DECODE_LABEL, compile_variant

    assert _copies(compile_variant(DECODE_LABEL)) > 0


@pytest.mark.parametrize("label", ["gate_up + norm + SiLU, 16 rows, swapped",
                                   "down + residual, 64 rows",
                                   "qkv + norm from partials, 64 rows",
                                   "down + residual + sums of squares, 64"])
def test_gemm_reads_x_only_after_the_pdl_wait_and_releases_after_its_loop(label):
    """Programmatic dependent launch (kernels/pdl.py): every load (x, the residual, the
    weight tiles) comes after griddepcontrol.wait, and the next kernel is released after the
    K loop's copies were issued."""
    from benchmarks.compile_sm90 import compile_variant

    lines = compile_variant(label).asm["ptx"].splitlines()

    def first(text):
        return next(i for i, line in enumerate(lines) if text in line)

    wait = first("griddepcontrol.wait")
    assert wait < first("ld.global") and wait < first("cp.async.cg")
    assert first("cp.async.cg") < first("griddepcontrol.launch_dependents")


def test_rotary_decode_attention_waits_before_its_first_load():
    from benchmarks.compile_sm90 import DECODE_LABEL, compile_variant

    ptx = compile_variant(DECODE_LABEL).asm["ptx"]
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


@pytest.mark.parametrize("label", ["Gluon down + residual + sums of squares, 64",
                                   "Gluon gate_up + norm from partials, 64 rows",
                                   "Gluon LM head + row argmax, 64 rows"])
def test_gluon_gemm_requests_weight_tiles_before_the_pdl_wait_and_x_after(label):
    """kernels/linear_gluon.py: before griddepcontrol.wait the only memory traffic is TMA
    copies from one descriptor (the weight's: no kernel writes it); x's descriptor is read
    after the wait, the tiles are multiplied by wgmma, and the next kernel is released after
    the K loop's last wgmma."""
    import re

    from benchmarks.compile_sm90 import compile_variant

    ptx = compile_variant(label).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")

    def descriptors(text):
        return set(re.findall(r"cp\.async\.bulk\.tensor\S*\s+\[[^]]*\], \[(%rd\d+),", text))

    before, after = descriptors(ptx[:wait]), descriptors(ptx[wait:])
    assert len(before) == 1 and after - before
    assert "ld.global" not in ptx[:wait]
    assert ptx.rindex("wgmma.mma_async") < ptx.index("griddepcontrol.launch_dependents")
