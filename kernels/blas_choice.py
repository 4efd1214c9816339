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
faster, else None (torch's default). Row buckets are powers of two up to MAX_ROWS (the CUDA
graph runner's batch sizes); larger inputs (prefill) and other dtypes keep torch's default.

Numerics: both are cuBLAS GEMMs with float32 accumulation; their summation order may differ
(bf16 relative error ~1e-3 between them, as between any two GEMM kernels).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from deepinfer.kernels.backends import device_config_entries

CONFIG_KIND = "blas_library"   # kernels/configs/blas_library_<device name>.json
MAX_ROWS = 256


def row_bucket(num_rows: int) -> int:
    """The power of two >= num_rows (1 for 0)."""
    return 1 << max(num_rows - 1, 0).bit_length()


@functools.cache
def _choices(device: torch.device) -> frozenset[tuple[int, int, int]]:
    """{(row bucket, out_features, in_features)} where cuBLASLt was faster on `device`."""
    return frozenset((e["rows"], e["out_features"], e["in_features"])
                     for e in device_config_entries(CONFIG_KIND, device)
                     if e["library"] == "cublaslt")


def preferred_library(num_rows: int, weight: torch.Tensor) -> str | None:
    """"cublaslt" where the device's sweep measured it faster for x of `num_rows` rows times
    `weight` [out_features, in_features] (CUDA, bf16), else None (torch's default)."""
    if num_rows > MAX_ROWS or weight.dtype != torch.bfloat16:   # the sweep times bf16
        return None
    return "cublaslt" if (row_bucket(num_rows), *weight.shape) in _choices(weight.device) else None


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
