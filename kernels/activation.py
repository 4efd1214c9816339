"""SwiGLU activation of a fused gate/up projection: `silu_and_mul`.

Backends: "reference" (`kernels/reference/activation.py`: `F.silu` + `mul_`, any device) and
"triton" (`kernels/elementwise_triton.py`, one kernel on CUDA). `backend="auto"` takes "triton"
for CUDA tensors where Triton is installed, else "reference". Same rounding steps, so bf16 results
match the reference within one ulp.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.backends import triton_available

BACKENDS = ("reference", "triton")


def silu_and_mul(gate_up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up.

    Args:
        gate_up: [num_tokens, 2 * intermediate], unit stride on the last dim.
        backend: "auto", "reference" or "triton".
    Returns:
        [num_tokens, intermediate], gate_up's dtype.
    """
    if backend == "auto":
        use_triton = gate_up.is_cuda and gate_up.stride(-1) == 1 and triton_available()
        backend = "triton" if use_triton else "reference"
    if backend == "triton":
        from deepinfer.kernels import elementwise_triton

        return elementwise_triton.silu_and_mul(gate_up)
    if backend != "reference":
        raise ValueError(f"activation backend={backend!r} is unknown; use 'auto' or one of "
                         f"{BACKENDS}.")
    from deepinfer.kernels.reference.activation import silu_and_mul as reference

    return reference(gate_up)
