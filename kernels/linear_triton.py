"""Skinny GEMM in Triton for decode: `y = x @ weight.T (+ bias)` with few rows of x (the
"triton" path of `kernels/linear.py`).

At decode a linear layer reads its whole weight to multiply a handful of rows, so its time is
weight bytes over memory bandwidth. cuBLAS runs the Llama-3-8B decode GEMVs at 3.0-4.1 TB/s on
an H200 (copy bandwidth 4.27) and splits K on some shapes, adding a reduce kernel per call.

Design: program (n tile, m tile) streams a [BLOCK_N, K] slab of the weight in [BLOCK_N, BLOCK_K]
tiles, software-pipelined `num_stages` deep, and multiplies each with `tl.dot` against a
[BLOCK_M, BLOCK_K] tile of x (rows past M masked). No split-K: each output element is one
program's float32 sum, rounded once (no reduce kernel; the result does not depend on timing).

Where it runs: only for (row bucket, out_features, in_features) shapes that a sweep on this
device found faster than cuBLAS inside a CUDA graph (`benchmarks/gemv_sweep.py` writes
`kernels/configs/skinny_linear_<device name>.json` with the best tile config per shape);
`tuned_config` returns None for every other shape and device, and the caller uses cuBLAS.

Numerics: float32 accumulation of bf16/fp16 products; vs F.linear (cuBLAS) the summation order
differs: relative error ~1e-3 in bf16. float32 inputs use IEEE dot products (no tf32).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_stride, w_stride,
                          out_stride, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                          EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + ks[None, :]      # [BM, BK]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_stride + ks[None, :]      # [BN, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=row_ok[:, None] & ((k + ks) < K)[None, :], other=0.0)
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=col_ok[:, None] & ((k + ks) < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_m(num_rows: int) -> int:
    """Rows per program: the smallest tl.dot tile (16) up to 64."""
    return 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64


def config_path(device_name: str) -> Path:
    """Where the sweep's tuned configs for `device_name` ("NVIDIA H200") live."""
    return CONFIG_DIR / f"skinny_linear_{device_name.replace(' ', '_')}.json"


@functools.cache
def _tuned_table(device_index: int) -> dict[tuple[int, int, int], dict]:
    """{(block_m, out_features, in_features): launch config} of the shapes where the sweep
    found this kernel faster than cuBLAS on this device; {} without a config file."""
    path = config_path(torch.cuda.get_device_name(device_index))
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())["entries"]
    return {(e["block_m"], e["out_features"], e["in_features"]): e["config"]
            for e in entries if e["triton_faster"]}


def tuned_config(num_rows: int, weight: torch.Tensor) -> dict | None:
    """The tuned launch config for x of `num_rows` rows times `weight` [N, K] on weight's CUDA
    device, or None where cuBLAS is as fast or the shape was not swept."""
    table = _tuned_table(weight.device.index if weight.device.index is not None
                         else torch.cuda.current_device())
    return table.get((block_m(num_rows), *weight.shape)) if table else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: dict) -> torch.Tensor:
    """`x @ weight.T + bias`.

    Args:
        x: [M, in_features], weight's dtype, unit stride on the last dim.
        weight: [out_features, in_features], contiguous.
        bias: [out_features] or None.
        config: launch parameters BLOCK_N, BLOCK_K, num_warps, num_stages (`tuned_config`).
    Returns:
        [M, out_features], x's dtype.
    """
    out_features, in_features = weight.shape
    num_rows = x.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    rows_per_program = block_m(num_rows)
    grid = (triton.cdiv(out_features, config["BLOCK_N"]), triton.cdiv(num_rows, rows_per_program))
    _skinny_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, num_rows, out_features,
        in_features, x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=rows_per_program, EVEN_N=out_features % config["BLOCK_N"] == 0,
        EVEN_K=in_features % config["BLOCK_K"] == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **config)
    return out
