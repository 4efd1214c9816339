"""`kernels.l2_prefetch.row_prefix`: what the bulk L2 copy is asked for (the copies themselves
run in tests/kernels/test_rotary_decode_triton.py on the GPU)."""

import torch

from kernels.l2_prefetch import row_prefix


def test_row_prefix_takes_whole_16_byte_runs_of_each_row():
    weight = torch.empty(64, 4096, dtype=torch.bfloat16)
    assert row_prefix(weight, 1.0) == (64, 8192)
    assert row_prefix(weight, 2.0) == (64, 8192)
    assert row_prefix(weight, 0.5) == (64, 4096)
    assert row_prefix(weight, 0.3) == (64, 2448)     # 2457.6 bytes, down to a multiple of 16


def test_row_prefix_skips_what_the_bulk_copy_cannot_take():
    weight = torch.empty(64, 4096, dtype=torch.bfloat16)
    assert row_prefix(None, 1.0) is None
    assert row_prefix(weight, 0.0) is None
    assert row_prefix(weight, 0.001) is None                        # under 16 bytes a row
    assert row_prefix(torch.empty(64, 4095, dtype=torch.bfloat16), 1.0) is None  # rows apart
    assert row_prefix(weight.t(), 1.0) is None                      # K not contiguous
    assert row_prefix(torch.empty(4096), 1.0) is None               # not a matrix
