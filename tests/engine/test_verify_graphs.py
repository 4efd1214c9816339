"""The verify CUDA graphs' input layout (engine/verify_graphs.py), on the CPU: a verify step
packed into a token bucket and unpacked into the static buffers describes the same rows, and
every padding token is its own row with seq_len 0 and slot -1 (nothing attended, nothing
written). The replay itself is checked against eager steps in test_verify_graphs_gpu.py.
"""

import numpy as np
import pytest
import torch

from deepinfer.engine.input_batch import CachedRequestState, build_step_inputs
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.verify_graphs import VerifyGraphRunner, verify_token_buckets

BLOCK_SIZE = 4


def _runner(max_num_seqs=4, max_query_len=6, max_num_batched_tokens=64):
    kv = [torch.zeros(1)]   # only its device is read
    return VerifyGraphRunner(None, kv, BLOCK_SIZE, max_num_seqs=max_num_seqs, max_model_len=64,
                             max_query_len=max_query_len,
                             max_num_batched_tokens=max_num_batched_tokens)


def _verify_inputs(drafts_per_row: list[int]):
    params = SamplingParams(temperature=0.0)
    states, drafts = [], {}
    for r, k in enumerate(drafts_per_row):
        context = 5 + 3 * r
        states.append(CachedRequestState(f"r{r}", list(range(10, 10 + context + 1)),
                                         context + 1, list(range(8 * r, 8 * r + 8)), context,
                                         params, 0))
        drafts[f"r{r}"] = list(range(100 + r, 100 + r + k))
    return build_step_inputs(states, [1 + k for k in drafts_per_row], BLOCK_SIZE,
                             torch.device("cpu"), draft_token_ids=drafts)


def test_buckets_cover_the_largest_verify_step():
    assert verify_token_buckets(24) == [2, 4, 8, 12, 16, 24]
    assert verify_token_buckets(40) == [2, 4, 8, 12, 16, 24, 32, 40]
    assert verify_token_buckets(4096)[-1] == 512       # larger steps run eagerly
    assert verify_token_buckets(1) == []
    assert _runner(max_num_seqs=4, max_query_len=6).token_buckets[-1] == 24


def test_query_len_bound_is_checked():
    with pytest.raises(ValueError, match="rows of 2..16"):
        _runner(max_query_len=17)


@pytest.mark.parametrize("drafts_per_row", [[5, 5, 5], [0, 3, 5, 1], [2]],
                         ids=["fixed", "varlen", "single"])
def test_packed_step_unpacks_to_the_same_rows_plus_padding_rows(drafts_per_row):
    runner = _runner()
    inputs = _verify_inputs(drafts_per_row)
    assert runner.can_run(inputs) is False   # nothing captured on the CPU
    num_tokens, num_seqs = inputs.input_ids.size, inputs.num_seqs
    bucket = next(b for b in runner.token_buckets if b >= num_tokens)
    host = runner.packed_host[0].numpy()
    size = runner._pack(host, bucket, inputs.input_ids, inputs.positions, inputs.slot_mapping,
                        inputs.query_start_loc, inputs.seq_lens, inputs.block_tables)
    runner.packed[:size].copy_(runner.packed_host[0][:size])
    runner._unpack(bucket)
    meta = runner._metadata(bucket)
    assert meta.max_query_len == 6 and meta.num_seqs == bucket
    np.testing.assert_array_equal(runner.input_ids[:num_tokens].numpy(), inputs.input_ids)
    np.testing.assert_array_equal(runner.positions[:num_tokens].numpy(), inputs.positions)
    np.testing.assert_array_equal(runner.slot_mapping[:num_tokens].numpy(), inputs.slot_mapping)
    assert (runner.slot_mapping[num_tokens:bucket] == -1).all()
    qsl = meta.query_start_loc.numpy()
    np.testing.assert_array_equal(qsl[:num_seqs + 1], inputs.query_start_loc)
    lens = np.diff(qsl)
    padding = bucket - num_tokens
    assert (lens[num_seqs:num_seqs + padding] == 1).all()          # one row per padding token
    assert (lens[num_seqs + padding:] == 0).all() and qsl[-1] == bucket
    seq_lens = meta.seq_lens.numpy()
    np.testing.assert_array_equal(seq_lens[:num_seqs], inputs.seq_lens)
    assert (seq_lens[num_seqs:] == 0).all()
    width = inputs.block_tables.shape[1]
    np.testing.assert_array_equal(meta.block_tables[:num_seqs, :width].numpy(),
                                  inputs.block_tables)
    assert (meta.block_tables[num_seqs:runner.table_rows(bucket)] == 0).all()


def test_steps_a_graph_does_not_cover_stay_eager():
    runner = _runner()
    runner.graphs = {b: None for b in runner.token_buckets}   # as if captured
    assert runner.can_run(_verify_inputs([0, 3, 5, 1]))
    assert not runner.can_run(_verify_inputs([0, 0]))          # plain decode: decode graphs
    assert not runner.can_run(_verify_inputs([6, 1]))          # a row longer than 1 + gamma
    assert not runner.can_run(_verify_inputs([1] * 5))         # more rows than max_num_seqs


def _chunk_inputs(row_lengths: list[int]):
    """Prompt chunks without drafts: row r schedules its first row_lengths[r] tokens (the
    last one samples when the row is the whole prompt)."""
    params = SamplingParams(temperature=0.0)
    states = [CachedRequestState(f"r{r}", list(range(10, 10 + n)), n,
                                 list(range(8 * r, 8 * r + 8)), 0, params, 0)
              for r, n in enumerate(row_lengths)]
    return build_step_inputs(states, row_lengths, BLOCK_SIZE, torch.device("cpu"))


def test_chunk_graphs_take_short_prompt_rows_without_drafts_only():
    chunks = VerifyGraphRunner(None, [torch.zeros(1)], BLOCK_SIZE, max_num_seqs=4,
                               max_model_len=64, max_query_len=16, max_num_batched_tokens=64,
                               with_drafts=False)
    chunks.graphs = {b: None for b in chunks.token_buckets}   # as if captured
    assert chunks.token_buckets[-1] == 64
    assert chunks.can_run(_chunk_inputs([9, 14, 1]))   # only the rows' last tokens sample
    assert not chunks.can_run(_chunk_inputs([17]))     # a row longer than 16: eager
    assert not chunks.can_run(_chunk_inputs([1, 1]))   # decode-shaped: the decode graphs
    assert not chunks.can_run(_verify_inputs([0, 3]))  # drafts: the verify graphs
    verify = _runner()
    verify.graphs = {b: None for b in verify.token_buckets}
    assert not verify.can_run(_chunk_inputs([3, 5]))   # no drafts: not a verify graph's
