"""Block-quantized linear `y = x @ W.T + bias` for W in ggml's Q4_1 / Q8_0 formats, on CPU.

Why: CPU decode is memory-bound; a GGUF model dequantized to float32 reads 128 bytes per 32
weights, while Q4_1 reads 20 and Q8_0 34. The engine's interface stays HF-format float32 weights:
`recover_q4_1` / `recover_q8_0` find the exact quantized form those values came from (or None),
and the kernel reconstructs every weight bit-exactly, so results match float32 up to summation
order.

Formats (32 weights per block along in_features K; ggml's definitions, evaluated in float32):
- Q4_1: w = d * q + m, q in 0..15, d and m fp16 per block. `codes` [N, K/2] uint8, byte j of a
  block holds element j in its low nibble and element j + 16 in its high nibble; `scales` (d)
  and `mins` (m) [N, K/32] float16.
- Q8_0: w = d * q, q in -127..127. `codes` [N, K] int8; `scales` (d) [N, K/32] float16.

Backends of `quantized_linear`, imported lazily on first use:
- "reference": `kernels/reference/quantized_linear.py`, dequantize + `F.linear` (the oracle).
- "cpu_avx2": `kernels/csrc/quantized_linear_avx2.cpp`, part of the one CPU extension that
  kernels/cpu_extension.py builds on first call (cached in the torch extensions dir); needs an
  x86 CPU with AVX2, FMA and F16C. Inputs of up to 8 rows (decode, speculative verify rows) run
  its AVX-512 form (`quantized_linear_avx512.cpp`) where the CPU has AVX-512F: same exact
  weights, float32 accumulation, another summation order. With `row_invariant` (the
  batch-invariant mode) a row's summation order does not depend on the number of rows: the
  AVX-512 nest in tiles of 8 rows where the CPU has it, else one FMA chain per row in both
  AVX2 nests (slower at 1-4 rows than their default 2-4 chains).
`backend="auto"` picks "cpu_avx2" when it is available and "reference" otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 32
BACKENDS = ("reference", "cpu_avx2")
# fp16 neighbours of the first scale guess tried for blocks where that guess does not verify.
_SCALE_ULP_OFFSETS = (1, -1, 2, -2, 3, -3)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in a 32-wide block format; see the module docstring for each tensor."""

    format: str                  # "q4_1" or "q8_0"
    codes: torch.Tensor          # q4_1: [N, K/2] uint8; q8_0: [N, K] int8
    scales: torch.Tensor         # [N, K/32] float16, d
    mins: torch.Tensor | None    # q4_1: [N, K/32] float16, m; q8_0: None

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) = (out_features, in_features)."""
        return self.scales.shape[0], self.scales.shape[1] * BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        """Bytes read per full pass over the weight."""
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.codes.nbytes + self.scales.nbytes + extra


# ------------------------------------------------------------------ recovery from float32


def _blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """[N, K] float32 -> [N * K/32, 32] view, or None where the weight cannot be blocked."""
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK_SIZE
            or weight.numel() == 0):
        return None
    return weight.detach().contiguous().reshape(-1, BLOCK_SIZE)


def _fp16_step(scale: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 value `offset` representable steps above `scale` (scale >= 0 float16)."""
    bits = scale.view(torch.int16).to(torch.int32) + offset
    return bits.clamp(0, 0x7BFF).to(torch.int16).view(torch.float16)


def _search_scales(blocks: torch.Tensor, first_guess: torch.Tensor, codes_and_check) -> (
        tuple[torch.Tensor, torch.Tensor] | None):
    """Per block, the fp16 scale (the first guess or a near fp16 neighbour) whose codes rebuild
    the block exactly.

    Args:
        blocks: [B, 32] float32.
        first_guess: [B] float16, >= 0.
        codes_and_check: (blocks [b, 32], scales [b] float16, rows [b] int64) -> (codes [b, 32]
            int, ok [b] bool).
    Returns:
        (scales [B] float16, codes [B, 32] int16), or None if some block has no such scale.
    """
    rows = torch.arange(blocks.shape[0])
    scales = first_guess.clone()
    codes, ok = codes_and_check(blocks, scales, rows)
    codes = codes.to(torch.int16)
    for offset in _SCALE_ULP_OFFSETS:
        if bool(ok.all()):
            return scales, codes
        todo = rows[~ok]
        candidate = _fp16_step(first_guess[todo], offset)
        todo_codes, todo_ok = codes_and_check(blocks[todo], candidate, todo)
        fixed = todo[todo_ok]
        scales[fixed] = candidate[todo_ok]
        codes[fixed] = todo_codes[todo_ok].to(torch.int16)
        ok[fixed] = True
    return (scales, codes) if bool(ok.all()) else None


def recover_q4_1(weight: torch.Tensor) -> QuantizedWeight | None:
    """The Q4_1 form of `weight` if every 32-block is exactly `fl32(d * q + m)`, else None.

    m is the block minimum (the q = 0 code) and must be an fp16 value; d is the fp16 value near
    (max - min) / 15 for which integer codes 0..15 rebuild each element exactly.

    Args:
        weight: [N, K] float32, K a multiple of 32.
    Returns:
        QuantizedWeight(format="q4_1") or None (not Q4_1 data, or unsupported shape/dtype).
    """
    blocks = _blocks(weight)
    if blocks is None or not bool(torch.isfinite(blocks).all()):
        return None
    low, high = blocks.aminmax(dim=-1)                               # [B] each
    mins = low.to(torch.float16)
    if not bool((mins.float() == low).all()):
        return None
    mins_f32 = mins.float().unsqueeze(-1)                            # [B, 1]

    def codes_and_check(block, scale, rows):
        d = scale.float().unsqueeze(-1)                              # [b, 1]
        m = mins_f32[rows]
        q = torch.where(d > 0, torch.round((block - m) / d), 0.0).clamp(0, 15)
        return q, (d * q + m == block).all(dim=-1)

    found = _search_scales(blocks, ((high - low) / 15).to(torch.float16), codes_and_check)
    if found is None:
        return None
    scales, codes = found
    num_rows = weight.shape[0]
    codes = codes.to(torch.uint8)                                    # [B, 32]
    packed = codes[:, :16] | (codes[:, 16:] << 4)                     # [B, 16]
    return QuantizedWeight("q4_1", packed.reshape(num_rows, -1).contiguous(),
                           scales.reshape(num_rows, -1), mins.reshape(num_rows, -1))


def recover_q8_0(weight: torch.Tensor) -> QuantizedWeight | None:
    """The Q8_0 form of `weight` if every 32-block is exactly `fl32(d) * q`, else None.

    d is the fp16 value near max|w| / 127 (llama.cpp's choice) for which integer codes in
    -127..127 rebuild each element exactly.

    Args:
        weight: [N, K] float32, K a multiple of 32.
    Returns:
        QuantizedWeight(format="q8_0") or None.
    """
    blocks = _blocks(weight)
    if blocks is None or not bool(torch.isfinite(blocks).all()):
        return None

    def codes_and_check(block, scale, rows):
        d = scale.float().unsqueeze(-1)
        q = torch.where(d > 0, torch.round(block / d), 0.0).clamp(-127, 127)
        return q, (d * q == block).all(dim=-1)

    first_guess = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)
    found = _search_scales(blocks, first_guess, codes_and_check)
    if found is None:
        return None
    scales, codes = found
    num_rows = weight.shape[0]
    return QuantizedWeight("q8_0", codes.to(torch.int8).reshape(num_rows, -1),
                           scales.reshape(num_rows, -1), None)


def recover_quantized(weight: torch.Tensor) -> QuantizedWeight | None:
    """`recover_q4_1(weight)`, else `recover_q8_0(weight)`, else None."""
    return recover_q4_1(weight) or recover_q8_0(weight)


# ------------------------------------------------------------------ the op and its backends


def _cpu_extension():
    """The compiled CPU kernels module (kernels/cpu_extension.py), or None (logged once)."""
    from deepinfer.kernels.cpu_extension import cpu_extension

    return cpu_extension()


def cpu_kernel_available() -> bool:
    """True if the "cpu_avx2" backend works here (builds it on the first call)."""
    return _cpu_extension() is not None


def _cpu_avx2_linear(x: torch.Tensor, qweight: QuantizedWeight, row_invariant: bool
                     ) -> torch.Tensor:
    ext = _cpu_extension()
    if ext is None:
        raise RuntimeError("quantized linear backend 'cpu_avx2' is unavailable here (see the "
                           "logged warning); use backend='reference' or 'auto'.")
    x = x.contiguous() if x.stride(-1) != 1 else x
    if qweight.format == "q4_1":
        return ext.q4_1_linear(x, qweight.codes, qweight.scales, qweight.mins,
                               row_invariant=row_invariant)
    return ext.q8_0_linear(x, qweight.codes, qweight.scales, row_invariant=row_invariant)


def quantized_linear(x: torch.Tensor, qweight: QuantizedWeight,
                     bias: torch.Tensor | None = None, backend: str = "auto", *,
                     row_invariant: bool = False) -> torch.Tensor:
    """`x @ W.T + bias` with W the exact float32 values `qweight` encodes.

    Args:
        x: [..., K] float32 on CPU.
        qweight: QuantizedWeight of shape [N, K].
        bias: [N] float32 or None (added after, in float32).
        backend: "auto", "reference" or "cpu_avx2".
        row_invariant: "cpu_avx2" only: each row's bits independent of the other rows and of
            their number (batch-invariant mode).
    Returns:
        [..., N] float32. Tolerance vs reference: float32 summation order only.
    """
    if backend == "auto":
        backend = "cpu_avx2" if cpu_kernel_available() else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"quantized linear backend={backend!r} is unknown; use 'auto' or one "
                         f"of {BACKENDS}.")
    lead_shape = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])                                 # [M, K]
    if backend == "reference":
        from deepinfer.kernels.reference.quantized_linear import quantized_linear as reference

        y = reference(x2d, qweight, bias)
    else:
        y = _cpu_avx2_linear(x2d, qweight, row_invariant)
        if bias is not None:
            y.add_(bias)
    return y.reshape(*lead_shape, qweight.shape[0])
