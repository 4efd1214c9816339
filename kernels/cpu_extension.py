"""Build and load deepinfer's one CPU C++ extension (AVX2 + FMA + F16C, OpenMP).

One torch extension module holds every CPU kernel, so a fresh machine pays one ~60 s compile
(cached afterwards in the torch extensions dir), on first use:
- `q4_1_linear`, `q8_0_linear`: `csrc/quantized_linear_avx2.cpp` (kernels/quantized_linear.py).
- `rms_norm`: `csrc/rms_norm_avx2.cpp` (used by kernels/rms_norm.py).
- `paged_decode_attention`: `csrc/paged_attention_cpu.cpp` (used by kernels/paged_attention_cpu.py).
Bindings and tensor checks: `csrc/quantized_linear_bindings.cpp`.

`cpu_extension()` returns the module, or None where the CPU lacks AVX2/FMA/F16C or the build
fails; either is logged once, and every caller then takes its torch path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

_CSRC_DIR = Path(__file__).parent / "csrc"
_SOURCES = ("quantized_linear_avx2.cpp", "rms_norm_avx2.cpp", "paged_attention_cpu.cpp",
            "quantized_linear_bindings.cpp")

logger = logging.getLogger(__name__)


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(flag in flags for flag in ("avx2", "fma", "f16c"))


@functools.cache
def cpu_extension() -> ModuleType | None:
    """The compiled CPU kernels module, or None (logged once) where it cannot be built or run."""
    if not _cpu_has_avx2():
        logger.warning("CPU lacks AVX2/FMA/F16C: deepinfer's C++ CPU kernels are off (quantized "
                       "linear uses float32 weights; RMSNorm and attention use torch ops).")
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("loading deepinfer's C++ CPU kernels (compiled once per machine, ~1 min)")
        flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
        return load(name="deepinfer_cpu_ops", sources=[str(_CSRC_DIR / s) for s in _SOURCES],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure means "use the torch paths"
        logger.warning("building deepinfer's C++ CPU kernels failed (%s); falling back to torch "
                       "ops (quantized linear uses float32 weights). Install a C++ compiler and "
                       "ninja to get the ~4x faster CPU decode.", error)
        return None
