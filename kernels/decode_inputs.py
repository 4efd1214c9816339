"""A decode step's inputs as one packed int32 buffer, unpacked on the device: `pack_decode_inputs`
(host) and `unpack_decode_inputs` (device), dispatched to a backend.

A CUDA graph reads its inputs from fixed device buffers (input ids, positions, slot mapping,
sequence lengths, block table). Filling each from the host is one copy per buffer, plus, under
async scheduling, the previous step's sampled ids gathered into the input ids: about ten small
copies and kernels between two graph replays. Packed, the host writes everything into one
page-locked buffer, one host-to-device copy moves it, and the first kernel of the graph scatters
it into the fixed buffers, taking the fed tokens from the device. (H200, Llama-3-8B decode in one
process, benchmarks/RESULTS.md run 17: +0.4% / +0.5-0.8% / +0.0-0.2% tokens/s at batch 1 / 8 / 64.)

Packed layout, int32, for n rows and a block table `width` blocks wide (`packed_size`):

    [n, width, input_ids[n], positions[n], slot_mapping[n], seq_lens[n], feed_src[n],
     block_tables[n, width] (row-major)]

feed_src[r] >= 0: row r's input id is `last_sampled[feed_src[r]]` (a token sampled by the step
before, still on the device); -1: input_ids[r] as packed.

Backends: "reference" (`kernels/reference/decode_inputs.py`: torch ops, reads n and width back
to the host) and "triton" (`kernels/decode_inputs_triton.py`: one kernel, nothing read back, so
it runs inside a CUDA graph). "auto": "triton" on CUDA where Triton is installed, else
"reference".
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.kernels.backends import Backends, triton_available
from deepinfer.kernels.reference.decode_inputs import HEADER, ROW_FIELDS

INT32_MAX = np.iinfo(np.int32).max

BACKENDS = Backends("decode inputs", {"reference": "deepinfer.kernels.reference.decode_inputs",
                                      "triton": "deepinfer.kernels.decode_inputs_triton"},
                    auto=lambda device: "triton" if device.type == "cuda"
                    and triton_available() else "reference")


def packed_size(num_rows: int, width: int) -> int:
    """int32 elements of the packed inputs of `num_rows` rows and a `width`-block table."""
    return HEADER + num_rows * (ROW_FIELDS + width)


def pack_decode_inputs(out: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
                       slot_mapping: np.ndarray, seq_lens: np.ndarray,
                       feed_src: np.ndarray | None, block_tables: np.ndarray) -> int:
    """Write one decode step's inputs into `out` in the packed layout (module docstring).

    Args:
        out: 1-D int32, at least `packed_size(n, width)` elements (page-locked memory for an
            asynchronous copy).
        input_ids, positions, slot_mapping, seq_lens: [n] integers.
        feed_src: [n] integers (row of `last_sampled`, or -1), or None for no fed tokens.
        block_tables: [n, width] integers.
    Returns:
        The number of elements written (`packed_size(n, width)`).
    Raises:
        ValueError: `out` is too small, or a value does not fit in int32.
    """
    num_rows, width = block_tables.shape
    size = packed_size(num_rows, width)
    if out.size < size:
        raise ValueError(f"packed decode inputs need {size} int32 elements, the buffer holds "
                         f"{out.size}")
    if num_rows and max(int(slot_mapping.max()), int(input_ids.max())) > INT32_MAX:
        raise ValueError("a slot or token id exceeds int32; the packed decode inputs cannot "
                         "carry it (use fewer KV blocks or run eagerly)")
    out[0], out[1] = num_rows, width
    rows = out[HEADER:HEADER + ROW_FIELDS * num_rows].reshape(ROW_FIELDS, num_rows)
    rows[0], rows[1], rows[2], rows[3] = input_ids, positions, slot_mapping, seq_lens
    rows[4] = -1 if feed_src is None else feed_src
    out[HEADER + ROW_FIELDS * num_rows:size] = block_tables.reshape(-1)
    return size


def unpack_decode_inputs(packed: torch.Tensor, last_sampled: torch.Tensor,
                         input_ids: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, backend: str = "auto") -> None:
    """Scatter packed inputs into a decode step's fixed buffers of B >= n rows, in place.

    Args:
        packed: 1-D int32, the packed layout (module docstring) of n <= B rows.
        last_sampled: [S] int64, ids sampled by the previous step (read where feed_src >= 0).
        input_ids, positions, slot_mapping: [B] int64 outputs.
        seq_lens: [B] int32 output.
        block_tables: [B, max_blocks] int32 output (width <= max_blocks columns written; the
            rest keep their values).
    Rows n..B-1 are padding: input id 0, position 0, slot -1 (no KV write), seq_len 0 (no
    context read); their block tables keep their values.
    """
    BACKENDS.get(backend, packed.device).unpack_decode_inputs(
        packed, last_sampled, input_ids, positions, slot_mapping, seq_lens, block_tables)
