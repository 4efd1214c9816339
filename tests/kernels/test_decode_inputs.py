"""Packed decode inputs (`kernels/decode_inputs.py`): the host packing and the torch reference
unpacking against hand-built values (always run), and the Triton kernel against the reference,
exactly (integers: nothing to round). The Triton tests run on CUDA, or on CPU under
TRITON_INTERPRET=1."""

import numpy as np
import pytest
import torch

from gpu_common import DEVICE, requires_triton
from deepinfer.kernels.decode_inputs import pack_decode_inputs, packed_size, unpack_decode_inputs

BATCH, MAX_BLOCKS = 8, 300   # 300 columns: the kernel's block-table loop runs three times


def _step(num_rows: int, width: int, seed: int):
    """Host arrays of a decode step: ids, positions, slots, seq_lens, feed rows, block table."""
    rng = np.random.default_rng(seed)
    feed = np.where(rng.random(num_rows) < 0.5, rng.integers(0, 4, num_rows), -1)
    return (rng.integers(0, 50000, num_rows), rng.integers(0, 4000, num_rows),
            rng.integers(0, 1 << 20, num_rows), rng.integers(1, 4000, num_rows), feed,
            rng.integers(0, 1 << 16, (num_rows, width)).astype(np.int32))


def _buffers(device: str):
    """Fixed buffers filled with values a stale step would leave, so every write shows."""
    return (torch.full((BATCH,), 7, dtype=torch.int64, device=device),
            torch.full((BATCH,), 7, dtype=torch.int64, device=device),
            torch.full((BATCH,), 7, dtype=torch.int64, device=device),
            torch.full((BATCH,), 7, dtype=torch.int32, device=device),
            torch.full((BATCH, MAX_BLOCKS), 9, dtype=torch.int32, device=device))


def _packed(step, device: str) -> torch.Tensor:
    host = np.zeros(packed_size(BATCH, MAX_BLOCKS), dtype=np.int32)
    size = pack_decode_inputs(host, *step)
    assert size == packed_size(*step[-1].shape)
    return torch.from_numpy(host).to(device)


LAST_SAMPLED = [101, 202, 303, 404]


def test_reference_unpacks_rows_feeds_and_padding():
    step = _step(5, 3, seed=0)
    ids, positions, slots, seq_lens, feed, tables = step
    buffers = _buffers("cpu")
    last = torch.tensor(LAST_SAMPLED)
    unpack_decode_inputs(_packed(step, "cpu"), last, *buffers, backend="reference")
    got_ids, got_positions, got_slots, got_seq_lens, got_tables = buffers
    expected_ids = [LAST_SAMPLED[f] if f >= 0 else i for i, f in zip(ids.tolist(), feed.tolist())]
    assert got_ids.tolist() == expected_ids + [0] * 3
    assert got_positions.tolist() == positions.tolist() + [0] * 3
    assert got_slots.tolist() == slots.tolist() + [-1] * 3   # padding rows write no KV
    assert got_seq_lens.tolist() == seq_lens.tolist() + [0] * 3
    assert got_tables[:5, :3].tolist() == tables.tolist()
    assert (got_tables[:5, 3:] == 9).all() and (got_tables[5:] == 9).all()   # left as they were


def test_no_rows_makes_every_row_padding():
    step = _step(0, 0, seed=1)
    buffers = _buffers("cpu")
    unpack_decode_inputs(_packed(step, "cpu"), torch.tensor(LAST_SAMPLED), *buffers,
                         backend="reference")
    assert buffers[2].tolist() == [-1] * BATCH and buffers[3].tolist() == [0] * BATCH


def test_pack_refuses_a_small_buffer_and_values_past_int32():
    step = _step(4, 2, seed=2)
    with pytest.raises(ValueError, match="need 30 int32 elements"):
        pack_decode_inputs(np.zeros(29, dtype=np.int32), *step)
    ids, positions, slots, seq_lens, feed, tables = step
    slots = slots.copy()
    slots[1] = 1 << 31
    with pytest.raises(ValueError, match="exceeds int32"):
        pack_decode_inputs(np.zeros(30, dtype=np.int32), ids, positions, slots, seq_lens, feed,
                           tables)


@pytest.mark.gpu
@requires_triton
@pytest.mark.parametrize("num_rows, width", [(8, 300), (5, 17), (1, 1), (0, 0)])
def test_triton_matches_the_reference(num_rows, width):
    step = _step(num_rows, width, seed=num_rows + width)
    last = torch.tensor(LAST_SAMPLED, device=DEVICE)
    packed = _packed(step, DEVICE)
    expected, got = _buffers(DEVICE), _buffers(DEVICE)
    unpack_decode_inputs(packed, last, *expected, backend="reference")
    unpack_decode_inputs(packed, last, *got, backend="triton")
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e)
