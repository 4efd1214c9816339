"""CUDA graphs for speculative verify steps: decode rows of 1 + k_r query tokens, k_r varying.

A verify step (engine/model_runner.py) scores every running request's last token and its
admitted drafts: rows of 1 + k_r tokens, k_r in 0..gamma, different per row under varlen
admission (engine/spec/admission.py) and equal under fixed admission. Plain decode steps replay
the graphs of engine/cuda_graphs.py (one token per row, split-K decode kernel); these graphs
replay the verify steps. The same runner, built `with_drafts=False` (the chunk graphs), replays
steps without drafts of rows of up to 16 tokens that are not all decode rows: short prompts,
and prompts whose every full block the prefix cache held, so that only the tail is computed.

Design: one graph per *flattened token-count* bucket T (`VERIFY_TOKEN_BUCKETS`, those up to
min(max_num_seqs * (1 + gamma), max_num_batched_tokens)), not one per (batch size, tokens per
row). Each row's query length is an input (the device `query_start_loc`), so one graph serves
fixed and varlen admission, any mix of row lengths, with about a dozen graphs; a (batch, k)
grid would need ~9 x gamma graphs and still not cover varlen rows. This works because the
attention kernels multi-token rows take read the row layout from the device and only host
bounds from the metadata:

- Llama (`kernels/paged_attention_triton._rows_kernel`, split-K over the context): grid
  (num_seqs, kv heads, splits); each program loads its row's start and length from
  `query_start_loc` (an empty row returns at once) and attends the row's tokens x the group's
  heads. BLOCK_Q and the split count come from the host bounds (1 + gamma, max_model_len), so
  an eager step of the same rows may tile them otherwise (the same result up to summation
  order: within the kernel tests' 1e-5 in float32).
- DeepSeek MLA (`kernels/mla_decode_triton.latent_attention`, absorbed): grid (num_seqs, head
  tiles, splits x query tiles) with per-row lengths from `query_start_loc`, rows longer than
  `max_q_len` skipped; needs 1 + gamma <= `KernelConfig.mla_decode_max_query_len`.

A graph of T tokens holds T sequence slots (a row has at least one token, so T slots always
suffice): the n real rows first, then each of the T - N padding tokens as its own one-token row
with seq_len 0 (attention reads nothing and returns zeros, so no garbage reaches the MoE router)
and slot -1 (no KV write), then empty rows (query length 0: their programs return at once).
The captured metadata says max_query_len = 1 + gamma and max_seq_len = max_model_len (host
bounds for the kernels' grids and split counts), and lists unequal query lengths so FlashMLA,
which needs equal rows, never claims a verify graph.

Inputs: one page-locked int32 buffer per step (two, used in turn), one host-to-device copy,
then the graph's first kernels copy the fixed-offset slices into the static buffers. Layout for
bucket T with R = min(T, max_num_seqs) block-table rows and the full table width W
(ceil(max_model_len / block_size)):

    [input_ids T, positions T, slot_mapping T, seq_lens T, query_start_loc T + 1,
     block_tables R x W]

Outputs: the final hidden states, the LM head's logits and greedy ids of all T rows; a verify
step whose every token is a scored position (every row samples all its 1 + k_r positions, as
the scheduler builds them) takes its logits from the graph. A verify step always runs blocking
(engine/engine_core.py: only steps without drafts are launched asynchronously), so no token is
fed from the device.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from deepinfer.engine.cuda_graphs import GraphOutputs
from deepinfer.engine.input_batch import StepInputs
from deepinfer.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

VERIFY_TOKEN_BUCKETS = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MAX_VERIFY_QUERY_LEN = 16   # longest row: paged_attention_triton.ROWS_MAX_QUERY_LEN
INT32_MAX = np.iinfo(np.int32).max


def verify_token_buckets(max_tokens: int,
                         buckets: tuple[int, ...] = VERIFY_TOKEN_BUCKETS) -> list[int]:
    """The captured token counts: `buckets` up to max_tokens, plus max_tokens itself when it
    falls inside the range (so the largest verify step has a graph). [] when max_tokens < 2."""
    chosen = [b for b in buckets if b <= max_tokens]
    if max_tokens >= 2 and max_tokens not in chosen and max_tokens < max(buckets):
        chosen.append(max_tokens)
    return sorted(chosen)


class VerifyGraphRunner:
    """Captured verify forwards of `model` at flattened token-count buckets.

    Args:
        model: forward(input_ids, positions, kv_caches, attn_metadata) -> [T, hidden] and
            logits_and_greedy(hidden) -> ([T, vocab] model dtype, [T] int64).
        kv_caches: the runner's per-layer KV tensors (the graphs bake in their addresses).
        block_size: tokens per KV block.
        max_num_seqs: the scheduler's batch cap (block-table rows per step).
        max_model_len: longest context: the block-table width and the kernels' length bound.
        max_query_len: the longest verify row, 1 + num_speculative_tokens (2..16).
        max_num_batched_tokens: the step's token budget (caps the largest bucket).
        with_drafts: True (verify graphs): steps with draft tokens whose every token is a
            scored position; False (chunk graphs): steps without drafts of rows of 1 to
            max_query_len tokens, not all of one token (short prompts, and the tails of prompts
            that the prefix cache held all but the last partial block of; decode-only steps
            replay engine/cuda_graphs.py). Eagerly such a step is ~300 Python kernel launches
            for SmolLM2: 20-27 ms on the H100 against 0.94 ms for a replayed decode step
            (benchmarks/RESULTS.md).
    Raises:
        ValueError: max_query_len outside [2, MAX_VERIFY_QUERY_LEN].
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int, *,
                 max_num_seqs: int, max_model_len: int, max_query_len: int,
                 max_num_batched_tokens: int, with_drafts: bool = True,
                 buckets: tuple[int, ...] = VERIFY_TOKEN_BUCKETS) -> None:
        if not 2 <= max_query_len <= MAX_VERIFY_QUERY_LEN:
            raise ValueError(f"verify graphs take rows of 2..{MAX_VERIFY_QUERY_LEN} tokens; "
                             f"got max_query_len={max_query_len}")
        self.model, self.kv_caches = model, kv_caches
        self.with_drafts = with_drafts
        self.max_model_len, self.max_query_len = max_model_len, max_query_len
        self.max_num_seqs = max(max_num_seqs, 1)
        self.token_buckets = verify_token_buckets(
            min(self.max_num_seqs * max_query_len, max_num_batched_tokens), buckets)
        self.width = -(-max_model_len // block_size)
        device = kv_caches[0].device
        most = self.token_buckets[-1] if self.token_buckets else 1
        self.input_ids = torch.zeros(most, dtype=torch.int64, device=device)
        self.positions = torch.zeros(most, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((most,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(most, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(most + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(most, self.width, dtype=torch.int32, device=device)
        capacity = self.packed_size(most)
        self.packed = torch.zeros(capacity, dtype=torch.int32, device=device)
        cuda = device.type == "cuda"   # elsewhere only the packing runs (tests)
        self.packed_host = [torch.zeros(capacity, dtype=torch.int32, pin_memory=cuda)
                            for _ in range(2)]
        self.packed_copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.steps = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, GraphOutputs] = {}

    def table_rows(self, num_tokens: int) -> int:
        """Block-table rows carried for bucket num_tokens: min(T, max_num_seqs)."""
        return min(num_tokens, self.max_num_seqs)

    def packed_size(self, num_tokens: int) -> int:
        """int32 elements of bucket num_tokens' packed inputs (module docstring layout)."""
        return 5 * num_tokens + 1 + self.table_rows(num_tokens) * self.width

    def _metadata(self, num_tokens: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:num_tokens + 1],
            seq_lens=self.seq_lens[:num_tokens], block_tables=self.block_tables[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens], max_query_len=self.max_query_len,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[self.max_query_len] + [1] * (num_tokens - 1),
            seq_lens_cpu=[self.max_model_len] * num_tokens)

    def _unpack(self, num_tokens: int) -> None:
        """Copy bucket num_tokens' packed slices into the static buffers (device only)."""
        t, rows = num_tokens, self.table_rows(num_tokens)
        packed = self.packed
        self.input_ids[:t].copy_(packed[0:t])
        self.positions[:t].copy_(packed[t:2 * t])
        self.slot_mapping[:t].copy_(packed[2 * t:3 * t])
        self.seq_lens[:t].copy_(packed[3 * t:4 * t])
        self.query_start_loc[:t + 1].copy_(packed[4 * t:5 * t + 1])
        start = 5 * t + 1
        self.block_tables[:rows].copy_(packed[start:start + rows * self.width].view(rows,
                                                                                   self.width))

    def step(self, num_tokens: int) -> GraphOutputs:
        """The captured work, run eagerly: inputs unpacked, forward, LM head, argmax."""
        self._unpack(num_tokens)
        hidden = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens],
                            self.kv_caches, self._metadata(num_tokens))
        logits, greedy_ids = self.model.logits_and_greedy(hidden)
        return GraphOutputs(hidden, logits, greedy_ids)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first (later graphs reuse the first one's memory
        pool; `pool` shares another runner's), each run eagerly once before (Triton compiles,
        cuBLAS picks its kernels). The inputs are all padding (`_fill_padding_inputs`), so
        these runs write no KV and read no context."""
        start = time.perf_counter()
        self.slot_mapping.fill_(-1)
        for num_tokens in reversed(self.token_buckets):
            self._fill_padding_inputs(num_tokens)
            self.step(num_tokens)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[num_tokens] = self.step(num_tokens)
            pool = graph.pool()
            self.graphs[num_tokens] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs: captured %s steps (rows of up to %d tokens) at token "
                    "counts %s in %.1f s", "verify" if self.with_drafts else "short-chunk",
                    self.max_query_len, self.token_buckets, time.perf_counter() - start)

    def _fill_padding_inputs(self, num_tokens: int) -> None:
        """An all-padding packed input for capture: every token its own row, seq_len 0,
        slot -1 (no KV write, no context read)."""
        host = self.packed_host[0].numpy()
        size = self._pack(host, num_tokens, np.zeros(0, np.int64), np.zeros(0, np.int64),
                          np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64),
                          np.zeros((0, 0), np.int32))
        self.packed[:size].copy_(self.packed_host[0][:size])

    def can_run(self, inputs: StepInputs) -> bool:
        """True for a step a graph covers: rows of 1..max_query_len tokens, at least one
        longer than 1 (plain decode replays engine/cuda_graphs.py), at most the largest
        bucket's tokens and max_num_seqs rows; with drafts and every token a scored position
        (verify graphs), or without drafts (chunk graphs)."""
        if not self.graphs or (inputs.draft_token_ids is not None) != self.with_drafts:
            return False
        num_tokens = inputs.input_ids.size
        if (num_tokens > self.token_buckets[-1] or inputs.num_seqs > self.max_num_seqs
                or self.with_drafts and inputs.logits_indices.size != num_tokens
                or inputs.is_decode_only or inputs.block_tables.shape[1] > self.width):
            return False
        return int(np.diff(inputs.query_start_loc).max()) <= self.max_query_len

    def _pack(self, out: np.ndarray, bucket: int, input_ids: np.ndarray, positions: np.ndarray,
              slot_mapping: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray,
              block_tables: np.ndarray) -> int:
        """Write one step padded to `bucket` tokens into `out` (module docstring layout).

        Args:
            out: int32, at least packed_size(bucket) elements.
            input_ids, positions, slot_mapping: [N] integers, N <= bucket.
            query_start_loc: [n + 1] integers, query_start_loc[n] == N.
            seq_lens: [n] integers.
            block_tables: [n, w] integers, w <= the table width.
        Returns:
            Elements written (packed_size(bucket)).
        Raises:
            ValueError: a slot or token id exceeds int32.
        """
        t, rows = bucket, self.table_rows(bucket)
        num_tokens, num_seqs = input_ids.size, seq_lens.size
        if num_tokens and max(int(slot_mapping.max()), int(input_ids.max())) > INT32_MAX:
            raise ValueError("a slot or token id exceeds int32; the verify graphs cannot "
                             "carry it (use fewer KV blocks or run eagerly)")
        size = self.packed_size(t)
        out[:5 * t + 1] = 0
        out[0:num_tokens] = input_ids
        out[t:t + num_tokens] = positions
        out[2 * t:2 * t + num_tokens] = slot_mapping
        out[2 * t + num_tokens:3 * t] = -1                  # padding tokens: no KV write
        out[3 * t:3 * t + num_seqs] = seq_lens              # padding rows: seq_len 0
        qsl = out[4 * t:5 * t + 1]
        qsl[:num_seqs + 1] = query_start_loc
        padding = t - num_tokens                            # one row per padding token,
        qsl[num_seqs + 1:num_seqs + 1 + padding] = np.arange(num_tokens + 1, t + 1)
        qsl[num_seqs + 1 + padding:] = t                    # then empty rows
        table = out[5 * t + 1:size].reshape(rows, self.width)
        table[:] = 0
        table[:num_seqs, :block_tables.shape[1]] = block_tables
        return size

    def run(self, inputs: StepInputs) -> GraphOutputs:
        """Replay the graph of the smallest bucket >= the step's tokens.

        Args:
            inputs: a step `can_run` accepts.
        Returns:
            The first num_tokens rows of the graph's static outputs (valid until the next
            replay of that bucket).
        """
        num_tokens = inputs.input_ids.size
        bucket = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        turn = self.steps % 2
        self.steps += 1
        host, copied = self.packed_host[turn], self.packed_copied[turn]
        copied.synchronize()
        size = self._pack(host.numpy(), bucket, inputs.input_ids, inputs.positions,
                          inputs.slot_mapping, inputs.query_start_loc, inputs.seq_lens,
                          inputs.block_tables)
        self.packed[:size].copy_(host[:size], non_blocking=True)
        copied.record()
        self.graphs[bucket].replay()
        return GraphOutputs(*(output[:num_tokens] for output in self.outputs[bucket]))
