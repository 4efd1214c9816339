"""Reference unpacking of a decode step's packed inputs (`kernels/decode_inputs.py`, which
documents the layout) in torch ops. The test oracle; it reads the row count back to the host."""

from __future__ import annotations

import torch

HEADER = 2       # packed[0] = n rows, packed[1] = block-table width
ROW_FIELDS = 5   # then [5, n]: input_ids, positions, slot_mapping, seq_lens, feed_src


def unpack_decode_inputs(packed: torch.Tensor, last_sampled: torch.Tensor,
                         input_ids: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor) -> None:
    """`kernels.decode_inputs.unpack_decode_inputs` in torch ops (its contract)."""
    num_rows, width = packed[:HEADER].tolist()
    rows = packed[HEADER:HEADER + ROW_FIELDS * num_rows].view(ROW_FIELDS, num_rows).long()
    feed_src = rows[4]
    fed = last_sampled[feed_src.clamp(min=0)] if bool((feed_src >= 0).any()) else rows[0]
    input_ids.zero_()
    positions.zero_()
    slot_mapping.fill_(-1)
    seq_lens.zero_()
    input_ids[:num_rows] = torch.where(feed_src >= 0, fed, rows[0])
    positions[:num_rows] = rows[1]
    slot_mapping[:num_rows] = rows[2]
    seq_lens[:num_rows] = rows[3].int()
    start = HEADER + ROW_FIELDS * num_rows
    block_tables[:num_rows, :width] = packed[start:start + num_rows * width].view(num_rows,
                                                                                 width)
