"""The model runner's per-request state and the builder of one step's inputs.

`CachedRequestState` is the runner's copy of a request (token ids, block table), updated from
each `SchedulerOutput` diff; `build_step_inputs` flattens the scheduled requests into one varlen
batch on the host (`StepInputs`, numpy): `input_ids`, `positions`, `slot_mapping`,
`query_start_loc`, `seq_lens`, `block_tables`, plus which rows produce logits.
`StepInputs.on_device()` copies it to the device as `DeviceInputs` (with the
`AttentionMetadata`) for an eager forward; a replayed CUDA graph packs the host arrays into its
own buffer instead (`engine/cuda_graphs.py`).

A decode row may carry k draft tokens after its last sampled token (speculative decoding): its
1 + k tokens are one query of the varlen batch (causal within the row, against its paged
context), and all 1 + k positions produce logits (`StepInputs.draft_token_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.kernels.attention_metadata import AttentionMetadata


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]          # prompt + sampled tokens (the runner appends what it samples)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int      # tokens in the KV cache before this step
    sampling_params: SamplingParams
    seed: int
    grammar: Any = None           # a structured-output GrammarMatcher when so_args is set
    mm_inputs: list = field(default_factory=list)  # engine.multimodal.ImageInput, placed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class StepInputs:
    """One step's varlen batch on the host (numpy); `on_device()` moves it to the device.

    A replayed decode graph packs these arrays into its own input buffer instead
    (`engine/cuda_graphs.py`), so a graph step makes no other copy.
    """

    input_ids: np.ndarray          # [num_tokens] int64
    positions: np.ndarray          # [num_tokens] int64
    slot_mapping: np.ndarray       # [num_tokens] int64
    query_start_loc: np.ndarray    # [num_seqs + 1] int64
    seq_lens: np.ndarray           # [num_seqs] int64
    block_tables: np.ndarray       # [num_seqs, max_blocks] int32, padded with 0
    logits_indices: np.ndarray     # [num_logits_rows] int64 — rows whose logits are sampled
    sampling_states: list[CachedRequestState]  # requests that sample, in logits_indices order
    device: torch.device
    # None when no row scores drafts (one logits row per sampling request); else per sampling
    # request its scored drafts: it owns 1 + len(drafts) consecutive logits rows
    draft_token_ids: list[list[int]] | None = None
    _device_inputs: DeviceInputs | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.size

    @property
    def is_decode_only(self) -> bool:
        """Every sequence schedules one token."""
        return self.input_ids.size == self.seq_lens.size

    def on_device(self) -> DeviceInputs:
        """The batch as device tensors (two host-to-device copies, made on the first call)."""
        if self._device_inputs is None:
            self._device_inputs = _to_device(self)
        return self._device_inputs

    def logits_indices_on_device(self) -> torch.Tensor:
        """`logits_indices` as a device tensor: `on_device()`'s when the batch was copied, else
        copied alone (one asynchronous copy; a replayed graph copied the rest its own way)."""
        if self._device_inputs is not None:
            return self._device_inputs.logits_indices
        return _packed_to_device([self.logits_indices], np.int64, self.device)[0]


class DeviceInputs(NamedTuple):
    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor   # [num_sampling_reqs] int64


def build_step_inputs(states: list[CachedRequestState], num_scheduled: list[int],
                      block_size: int, device: torch.device, *,
                      draft_token_ids: dict[str, list[int]] | None = None) -> StepInputs:
    """Flatten the scheduled requests (in `states` order) into one varlen batch, on the host.

    Args:
        states: the scheduled requests, with `num_computed_tokens` as before this step.
        num_scheduled: tokens scheduled per request this step (drafts included).
        block_size: tokens per KV block.
        device: where `StepInputs.on_device` puts it.
        draft_token_ids: request id -> draft tokens scored after its known tokens
            (`SchedulerOutput.scheduled_spec_decode_tokens`); None or empty: no drafts.
    """
    num_seqs = len(states)
    query_lens = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_seqs)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # positions: for each sequence, start .. start + query_len - 1
    seq_index = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - starts, query_lens)
    # per-request lists are flattened by itertools at C speed (host time per step matters)
    num_block_ids = np.fromiter((len(s.block_ids) for s in states), np.int64, num_seqs)
    max_blocks = int(num_block_ids.max())
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    block_tables[np.arange(max_blocks) < num_block_ids[:, None]] = np.fromiter(
        chain.from_iterable(s.block_ids for s in states), np.int32, int(num_block_ids.sum()))
    ends = seq_lens.tolist()
    if draft_token_ids:
        input_ids, logits_indices, sampling, drafts = _tokens_with_drafts(
            states, starts.tolist(), ends, query_start_loc, draft_token_ids)
    else:
        input_ids = np.fromiter(chain.from_iterable(
            s.token_ids[begin:end] for s, begin, end in zip(states, starts.tolist(), ends)),
            np.int64, num_tokens)
        sampling = [i for i, (s, end) in enumerate(zip(states, ends)) if end == len(s.token_ids)]
        logits_indices, drafts = query_start_loc[1:][sampling] - 1, None
    slot_mapping = (block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    return StepInputs(
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        logits_indices=logits_indices, sampling_states=[states[i] for i in sampling],
        device=device, draft_token_ids=drafts)


def _tokens_with_drafts(states: list[CachedRequestState], starts: list[int], ends: list[int],
                        query_start_loc: np.ndarray, draft_token_ids: dict[str, list[int]]
                        ) -> tuple[np.ndarray, np.ndarray, list[int], list[list[int]]]:
    """`build_step_inputs`' (input_ids, logits_indices, sampling requests, their drafts) when
    some rows score drafts: a row's query is its known tokens [start, len(token_ids)) then its
    drafts; a row that reaches its end samples at its last 1 + len(drafts) positions."""
    drafts = [draft_token_ids.get(s.request_id, []) for s in states]
    input_ids = np.fromiter(chain.from_iterable(
        chain(s.token_ids[begin:end], d) for s, begin, end, d in zip(states, starts, ends,
                                                                    drafts)),
        np.int64, int(query_start_loc[-1]))
    sampling = [i for i, (s, end, d) in enumerate(zip(states, ends, drafts))
                if end == len(s.token_ids) + len(d)]
    query_ends = query_start_loc[1:].tolist()
    logits_indices = np.fromiter(chain.from_iterable(
        range(query_ends[i] - 1 - len(drafts[i]), query_ends[i]) for i in sampling),
        np.int64, sum(1 + len(drafts[i]) for i in sampling))
    return input_ids, logits_indices, sampling, [drafts[i] for i in sampling]


def _to_device(inputs: StepInputs) -> DeviceInputs:
    num_seqs, max_blocks = inputs.block_tables.shape
    ints64 = _packed_to_device([inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                inputs.logits_indices], np.int64, inputs.device)
    ints32 = _packed_to_device([inputs.query_start_loc, inputs.seq_lens,
                                inputs.block_tables.reshape(-1)], np.int32, inputs.device)
    query_lens = np.diff(inputs.query_start_loc)
    metadata = AttentionMetadata(
        query_start_loc=ints32[0], seq_lens=ints32[1],
        block_tables=ints32[2].view(num_seqs, max_blocks), slot_mapping=ints64[2],
        max_query_len=int(query_lens.max()), max_seq_len=int(inputs.seq_lens.max()),
        query_lens_cpu=query_lens.tolist(), seq_lens_cpu=inputs.seq_lens.tolist(),
        has_draft_rows=bool(inputs.draft_token_ids))
    return DeviceInputs(input_ids=ints64[0], positions=ints64[1], attn_metadata=metadata,
                        logits_indices=ints64[3])


def feed_tokens(input_ids: torch.Tensor, feed_rows: np.ndarray,
                last_sampled: torch.Tensor) -> None:
    """input_ids[t] = last_sampled[feed_rows[t]] wherever feed_rows[t] >= 0, on the device
    (`AsyncRunnerOutput.feed_rows`), without waiting for it.

    Args:
        input_ids: [num_tokens] int64 on the device, updated in place.
        feed_rows: [num_tokens] int64 host array, -1 where the id is known.
        last_sampled: [S] int64 on the device.
    """
    fed = np.flatnonzero(feed_rows >= 0)
    index = _packed_to_device([fed, feed_rows[fed]], np.int64, input_ids.device)
    input_ids.index_copy_(0, index[0], last_sampled.index_select(0, index[1]))


def _packed_to_device(arrays: list[np.ndarray], dtype: type, device: torch.device
                      ) -> list[torch.Tensor]:
    """Copy 1-D arrays to `device` as one host->device transfer (one buffer, page-locked on
    CUDA so the copy is asynchronous); returns contiguous views of the device buffer, one per
    array, in `dtype`."""
    sizes = [a.size for a in arrays]
    host = torch.from_numpy(np.concatenate(arrays).astype(dtype, copy=False))
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device=device, non_blocking=True)
    return list(flat.split(sizes))
