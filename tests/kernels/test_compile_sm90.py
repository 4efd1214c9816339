"""The decode kernels as Triton lowers them for an H100 / H200 (sm_90), compiled on this CPU
machine (benchmarks/compile_sm90.py): properties their speed rests on, checked without a GPU.
SWAP_AB tiles must run Hopper wgmma from shared memory, the skinny GEMM's and the decode
attention's K loops must be software-pipelined (cp.async copies in flight), and with
programmatic dependent launch nothing the previous kernel writes may be read before the wait."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs the triton package (compiles, runs nothing)")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _copies(kernel) -> int:
    return kernel.asm["ttgir"].count("async_copy_global_to_local")


def test_swapped_16_row_tiles_run_pipelined_wgmma():
    from benchmarks.compile_sm90 import compile_variant

    kernel = compile_variant("qkv + norm, 16 rows, swapped")
    assert "warp_group_dot " in kernel.asm["ttgir"]
    assert _copies(kernel) > 0


def test_rotary_decode_attention_loop_is_pipelined():
    from benchmarks.compile_sm90 import DECODE_LABEL, compile_variant

    assert _copies(compile_variant(DECODE_LABEL)) > 0


def _split_at_wait(ptx: str) -> tuple[list[str], list[str]]:
    """The PTX's instruction lines before and after griddepcontrol.wait."""
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    return lines[:wait], lines[wait + 1:]


def _count(lines: list[str], text: str) -> int:
    return sum(text in line for line in lines)


@pytest.mark.parametrize("label,weight_tiles", [("gate_up + norm + SiLU, 16 rows, swapped", 2),
                                                ("down + residual, 64 rows", 1)])
def test_gemm_loads_only_its_first_weight_tile_before_the_pdl_wait(label, weight_tiles):
    """Programmatic dependent launch (kernels/pdl.py): before griddepcontrol.wait the GEMM
    loads its first weight tile(s) (16-byte loads: BLOCK_N x BLOCK_K bf16 over the threads;
    two when gated) and nothing else, so x, the residual and the K loop's copies come after
    it; the next kernel is released after the K loop's copies were issued."""
    from benchmarks.compile_sm90 import GEMMS, compile_variant

    _, _, block_n, block_k, warps, _, _, _ = next(g for g in GEMMS if g[0] == label)
    ptx = compile_variant(label).asm["ptx"]
    before, after = _split_at_wait(ptx)
    per_thread = block_n * block_k * 2 // (16 * 32 * warps)
    assert _count(before, "ld.global.v4") == _count(before, "ld.global") == (
        weight_tiles * per_thread)
    assert _count(before, "cp.async") == _count(before, "st.global") == 0
    copies = next(i for i, line in enumerate(after) if "cp.async.cg" in line)
    assert copies < next(i for i, line in enumerate(after)
                         if "griddepcontrol.launch_dependents" in line)


def test_rotary_decode_attention_reads_the_projection_only_after_the_pdl_wait():
    """Before the wait: the sequence's length, slot, cos / sin (2-byte loads), block table
    and first K / V tile (16-byte loads); no store, no atomic. The projection's q and new
    k / v are loaded after it."""
    from benchmarks.compile_sm90 import DECODE_LABEL, compile_variant

    before, after = _split_at_wait(compile_variant(DECODE_LABEL).asm["ptx"])
    tile_loads = 64 * 128 * 2 // (16 * 32 * 4)   # BLOCK_N x HEAD_DIM bf16 at 4 warps
    assert _count(before, "ld.global.v4") == 2 * tile_loads
    assert _count(before, "ld.global.b16") == 2
    assert _count(before, "st.global") == _count(before, "atom.") == 0
    assert _count(after, "ld.global.b16") >= 3 and _count(after, "st.global") > 0
