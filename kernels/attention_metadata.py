"""`AttentionMetadata`: the tensors one varlen step's attention needs, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Flattened ("varlen") batch of `num_seqs` sequences holding `num_tokens` new tokens.

    query_start_loc: [num_seqs + 1] int32 — sequence i's new tokens are rows
        query_start_loc[i]:query_start_loc[i+1] of the flattened batch.
    seq_lens: [num_seqs] int32 — context length of sequence i after this step (cached + new).
    block_tables: [num_seqs, max_num_blocks_per_seq] int32 — physical KV block ids, padded with 0.
    slot_mapping: [num_tokens] int64 — KV cache slot (block_id * block_size + offset) where each
        new token's K and V are written.
    max_query_len, max_seq_len: host-side maxima (python ints), so kernels need no device sync.
    query_lens_cpu, seq_lens_cpu: the same lengths as python lists, for host-side dispatch.
    has_draft_rows: the step scores speculative draft tokens (verify rows of 1 + k tokens); a
        backend may route such steps differently, while steps without drafts (prefill chunks,
        prefix-cache tails) keep one route whatever their lengths.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    has_draft_rows: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
