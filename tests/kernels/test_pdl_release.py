"""Where each decode kernel releases the next one (`kernels.pdl.release_after_loop`): the
committed release points, by kernel and, for the Gluon GEMM, by epilogue role. Host logic only:
runs anywhere (the chain's bits are checked on the GPU in test_pdl.py)."""

import pytest

from deepinfer.kernels import pdl


def test_gemms_feeding_a_gemm_release_early_and_qkv_after_its_loop():
    linear_gluon = pytest.importorskip("deepinfer.kernels.linear_gluon")
    role = linear_gluon.epilogue_role
    assert role(gated=True, residual=False, norm=True) == "gated"          # gate_up
    assert role(gated=False, residual=True, norm=False) == "residual"      # o, down
    assert role(gated=False, residual=False, norm=True) == "norm"          # qkv
    assert role(gated=False, residual=False, norm=False) == "plain"        # LM head
    early = {r for r in ("gated", "residual", "norm", "plain")
             if not pdl.release_after_loop("linear_gluon", r)}
    assert early == {"gated", "residual"}
    assert not pdl.release_after_loop("attention")
    assert pdl.release_after_loop("linear") and pdl.release_after_loop("linear", "residual")


def test_a_kernel_name_releases_all_its_roles():
    from deepinfer.kernels.settings import KernelConfig

    whole_kernel = KernelConfig(pdl_release_early=frozenset({"linear_gluon"}))
    assert not any(pdl.release_after_loop("linear_gluon", r, whole_kernel) for r in ("norm", None))
    none_early = KernelConfig(pdl_release_early=frozenset())
    assert all(pdl.release_after_loop(k, r, none_early) for k in ("linear_gluon", "attention")
               for r in ("gated", None))
