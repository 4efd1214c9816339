"""Which cuBLAS front end runs a decode-sized bf16 CUDA linear: cuBLAS or cuBLASLt.

torch sends a bf16 `F.linear` to cuBLAS (`cublasGemmEx`) unless told to prefer cuBLASLt
(`torch.backends.cuda.preferred_blas_library`); the two pick different kernels for the skinny
shapes of decode. On an H200 (torch 2.11, Llama-3-8B shapes, 32 linears per CUDA graph; the
committed `kernels/configs/blas_library_NVIDIA_H200.json`) cuBLASLt was faster for o at 32 rows
(12.1 against 13.1 us), gate_up at 64 (60.1 / 62.3) and down at 32 and 64 (31.1 / 32.9,
31.9 / 35.4), and within 2% everywhere else; at 256 rows the faster one changed between two
runs on one machine, so those shapes keep torch's default.

`benchmarks/blas_sweep.py --write-configs` times both for each (row bucket, out_features,
in_features) of a model's linears and writes `kernels/configs/blas_library_<device name>.json`;
`preferred_library` returns "cublaslt" for the bf16 shapes where that file says cuBLASLt was
faster, else None (torch's default). Row buckets are powers of two up to
`KernelConfig.cublaslt_max_rows` (256: the CUDA graph runner's batch sizes); larger inputs (prefill) and other dtypes keep torch's default.

Numerics: both are cuBLAS GEMMs with float32 accumulation; their summation order may differ
(bf16 relative error ~1e-3 between them, as between any two GEMM kernels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer.kernels.backends import tuned_table
from deepinfer.kernels.settings import DEFAULT, KernelConfig

CONFIG_KIND = "blas_library"   # kernels/configs/blas_library_<device name>.json


def row_bucket(num_rows: int) -> int:
    """The power of two >= num_rows (1 for 0)."""
    return 1 << max(num_rows - 1, 0).bit_length()


def cublaslt_table(entries) -> dict[tuple[int, int, int], str]:
    """{(row bucket, out_features, in_features): "cublaslt"} of the `blas_library` config-file
    entries where cuBLASLt was faster."""
    return {(e["rows"], e["out_features"], e["in_features"]): "cublaslt"
            for e in entries if e["library"] == "cublaslt"}


def preferred_library(num_rows: int, weight: torch.Tensor,
                      settings: KernelConfig = DEFAULT) -> str | None:
    """"cublaslt" where the device's sweep measured it faster for x of `num_rows` rows times
    `weight` [out_features, in_features] (CUDA, bf16), up to `settings.cublaslt_max_rows` rows;
    else None (torch's default, also for shapes the sweep has no entry for)."""
    if num_rows > settings.cublaslt_max_rows or weight.dtype != torch.bfloat16:   # bf16 swept
        return None
    return tuned_table(CONFIG_KIND, weight.device, cublaslt_table).get(
        (row_bucket(num_rows), *weight.shape))


@contextlib.contextmanager
def preferring(library: str) -> Iterator[None]:
    """torch's matmuls inside prefer `library` ("cublas" / "cublaslt"); restored after. A CUDA
    graph captured inside keeps the kernels chosen there. The preference is process-wide: this
    assumes one thread runs the model's forwards (the engine's step thread)."""
    saved = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved)
