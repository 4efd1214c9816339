"""The "triton" backend of `kernels.decode_inputs.unpack_decode_inputs`: one kernel, one program
per row of the fixed buffers, reading the row count and the block-table width from the packed
buffer itself, so a CUDA graph replays it unchanged for any batch up to its size."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.reference.decode_inputs import HEADER, ROW_FIELDS

TABLE_BLOCK = 128   # block-table entries copied per vector load


@triton.jit
def _unpack_decode_inputs_kernel(packed_ptr, last_sampled_ptr, input_ids_ptr, positions_ptr,
                                 slot_mapping_ptr, seq_lens_ptr, block_tables_ptr,
                                 table_stride, HEADER: tl.constexpr, ROW_FIELDS: tl.constexpr,
                                 TABLE_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    num_rows = tl.load(packed_ptr)
    width = tl.load(packed_ptr + 1)
    fields = packed_ptr + HEADER + row
    if row < num_rows:
        token = tl.load(fields).to(tl.int64)
        feed_src = tl.load(fields + 4 * num_rows)
        if feed_src >= 0:
            token = tl.load(last_sampled_ptr + feed_src)
        tl.store(input_ids_ptr + row, token)
        tl.store(positions_ptr + row, tl.load(fields + num_rows).to(tl.int64))
        tl.store(slot_mapping_ptr + row, tl.load(fields + 2 * num_rows).to(tl.int64))
        tl.store(seq_lens_ptr + row, tl.load(fields + 3 * num_rows))
        table = packed_ptr + HEADER + ROW_FIELDS * num_rows + row * width
        out = block_tables_ptr + row.to(tl.int64) * table_stride
        for start in range(0, width, TABLE_BLOCK):
            cols = start + tl.arange(0, TABLE_BLOCK)
            tl.store(out + cols, tl.load(table + cols, mask=cols < width), mask=cols < width)
    else:   # padding: no KV write, no context
        tl.store(input_ids_ptr + row, 0)
        tl.store(positions_ptr + row, 0)
        tl.store(slot_mapping_ptr + row, -1)
        tl.store(seq_lens_ptr + row, 0)


def unpack_decode_inputs(packed: torch.Tensor, last_sampled: torch.Tensor,
                         input_ids: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor) -> None:
    """`kernels.decode_inputs.unpack_decode_inputs`'s contract (block_tables: unit stride on
    its last dim)."""
    batch = input_ids.shape[0]
    if batch == 0:
        return
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables needs unit stride along its blocks")
    _unpack_decode_inputs_kernel[(batch,)](
        packed, last_sampled, input_ids, positions, slot_mapping, seq_lens, block_tables,
        block_tables.stride(0), HEADER=HEADER, ROW_FIELDS=ROW_FIELDS, TABLE_BLOCK=TABLE_BLOCK,
        num_warps=1)
