"""CUDA graphs for decode steps: capture the model's forward once per batch size, replay it.

A decode step of a large model is hundreds of small kernel launches; replaying a captured graph
issues them as one, so the step costs what its kernels cost. Graphs fix every tensor address and
shape, so the runner owns static input buffers sized for the largest captured batch:

- `input_ids`, `positions` [max_batch] int64; `slot_mapping` [max_batch] int64;
- `seq_lens` [max_batch] int32; `block_tables` [max_batch, max_blocks_per_seq] int32, where
  max_blocks_per_seq = ceil(max_model_len / block_size): a fixed width, whatever the batch holds;
- `query_start_loc` = 0..max_batch (one token per sequence);
- `packed`: int32, the step's inputs in `kernels.decode_inputs`' packed layout.

A step packs its host arrays into a page-locked buffer (two, used in turn), copies that to
`packed` in one host-to-device copy and replays the graph; the graph's first kernel
(`kernels.decode_inputs.unpack_decode_inputs`) scatters `packed` into the buffers above, taking
the tokens that async scheduling feeds from the runner's `last_sampled` (the previous step's ids,
still on the device). Between two replays the device then runs two copies (this step's inputs
in, the sampled ids out) instead of ~ten (H200: +0.0-0.8% tokens/s, benchmarks/RESULTS.md
run 17).

Each graph holds the whole decode step on the device: the layers, the LM head over every row
(in the model dtype [batch, vocab]) and the greedy choice (`model.logits_and_greedy`: the
argmax per row, taken in the LM head GEMM's epilogue where the Triton skinny GEMM runs it, else
on those logits: converting them to float32 first changes no value, and at 64 rows cost 24 us
per step, plus a one-pass float32 argmax of 27 us against 19 for two passes over bf16; H200,
benchmarks/RESULTS.md run 14), so a greedy batch's step is one graph launch; sampling that needs
more (temperature, penalties, logprobs) reads the graph's logits as float32. The greedy ids are
also written to the first rows of `last_sampled`, for the next step to feed.

A step with n sequences replays the graph of the smallest captured size >= n: the first n rows
are its own, the padding rows get slot -1 (their K/V write is skipped) and seq_len 0 (their
attention reads nothing and returns zeros); their outputs are dropped. The captured
`AttentionMetadata` says max_seq_len = max_model_len, so the decode kernel's split-K partition
count (a host-side choice) is right for any context the graph will see.

Prefill and mixed steps, and batches larger than the largest size, run eagerly. Steps with
decode rows of 1 + k tokens (a request's last token and k draft tokens, speculative decoding)
replay their own graphs, one per flattened token count (engine/verify_graphs.py). Needs the
Triton attention backend (the torch
one reads host-side lengths and syncs). DeepSeek models are captured too: their MoE layers run
the Triton router and fused experts (no host sync), and the torch MLA decode path is graph-safe
on CUDA (a sync-free latent write, masks against the captured max_seq_len bound).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from deepinfer.engine.input_batch import StepInputs
from deepinfer.kernels.attention_metadata import AttentionMetadata
from deepinfer.kernels.decode_inputs import pack_decode_inputs, packed_size, unpack_decode_inputs

logger = logging.getLogger(__name__)

CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class GraphOutputs(NamedTuple):
    """A replayed step's static outputs, views valid until the next replay.

    hidden: [num_seqs, hidden_size] final-norm hidden states, model dtype.
    logits: [num_seqs, vocab_size] model dtype, every row's (`model.logits_and_greedy`).
    greedy_ids: [num_seqs] int64, `greedy_argmax(logits)`'s ids (the sampler's greedy rule).
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    greedy_ids: torch.Tensor


class CudaGraphRunner:
    """Captured decode forwards of `model` at `batch_sizes` (those <= max_num_seqs).

    Args:
        model: forward(input_ids, positions, kv_caches, attn_metadata) -> [T, hidden].
        kv_caches: the runner's per-layer KV tensors (the graphs bake in their addresses).
        block_size: tokens per KV block.
        last_sampled: [S] int64 on the device, S >= the largest captured size: the runner's
            buffer of the last step's sampled ids (fed tokens are read from it, greedy ids
            written to its first rows).
        max_num_seqs: the scheduler's batch cap; sizes above it are not captured.
        max_model_len: longest context; sets the block-table width and the decode split count.
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 last_sampled: torch.Tensor, *, max_num_seqs: int, max_model_len: int,
                 batch_sizes: tuple[int, ...] = CAPTURE_BATCH_SIZES) -> None:
        self.model, self.kv_caches, self.last_sampled = model, kv_caches, last_sampled
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(s for s in batch_sizes if s <= max(max_num_seqs, 1))
        if max_num_seqs not in self.batch_sizes and max_num_seqs < max(batch_sizes):
            self.batch_sizes.append(max_num_seqs)  # cover the cap itself, not only up to it
            self.batch_sizes.sort()
        device = kv_caches[0].device
        max_batch = self.batch_sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, self.max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        if last_sampled.shape[0] < max_batch:
            raise ValueError(f"last_sampled holds {last_sampled.shape[0]} ids; the graphs need "
                             f"{max_batch}")
        capacity = packed_size(max_batch, self.max_blocks_per_seq)
        self.packed = torch.zeros(capacity, dtype=torch.int32, device=device)  # n = 0: padding
        self.packed_host = [torch.zeros(capacity, dtype=torch.int32, pin_memory=True)
                            for _ in range(2)]
        self.packed_copied = [torch.cuda.Event() for _ in range(2)]  # host buffer free again
        self.steps = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, GraphOutputs] = {}

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size], block_tables=self.block_tables[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size], max_query_len=1,
            max_seq_len=self.max_model_len, query_lens_cpu=[1] * batch_size,
            seq_lens_cpu=[self.max_model_len] * batch_size)

    def _forward(self, batch_size: int) -> torch.Tensor:
        return self.model(self.input_ids[:batch_size], self.positions[:batch_size],
                          self.kv_caches, self._metadata(batch_size))

    def step(self, batch_size: int) -> GraphOutputs:
        """The captured work, run eagerly: inputs unpacked, forward, LM head, argmax."""
        unpack_decode_inputs(self.packed, self.last_sampled, self.input_ids[:batch_size],
                             self.positions[:batch_size], self.slot_mapping[:batch_size],
                             self.seq_lens[:batch_size], self.block_tables[:batch_size])
        hidden = self._forward(batch_size)
        logits, greedy_ids = self.model.logits_and_greedy(hidden)
        self.last_sampled[:batch_size].copy_(greedy_ids)
        return GraphOutputs(hidden, logits, greedy_ids)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (later graphs reuse the first one's memory pool).
        Each size runs eagerly once first, so Triton compiles and cuBLAS picks its kernels
        outside the capture. `packed` holds no rows, so every row is padding (slot -1,
        seq_len 0) and these runs write no KV."""
        start = time.perf_counter()
        pool = None
        for batch_size in reversed(self.batch_sizes):
            self.step(batch_size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch_size] = self.step(batch_size)
            pool = graph.pool()
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs: captured decode at batch sizes %s in %.1f s",
                    self.batch_sizes, time.perf_counter() - start)

    def can_run(self, inputs: StepInputs) -> bool:
        """True for a captured decode-only step this runner can replay."""
        return (bool(self.graphs) and inputs.is_decode_only
                and inputs.num_seqs <= self.batch_sizes[-1]
                and inputs.block_tables.shape[1] <= self.max_blocks_per_seq)

    def run(self, inputs: StepInputs, feed_rows: np.ndarray | None = None) -> GraphOutputs:
        """Replay the graph of the nearest captured size >= the batch.

        Args:
            inputs: a step `can_run` accepts.
            feed_rows: [num_seqs] int64, the row of `last_sampled` whose id each row takes, or
                -1 (`AsyncRunnerOutput.feed_rows`); None: no fed tokens.
        Returns:
            The first num_seqs rows of the graph's static outputs (valid until the next
            replay).
        """
        num_seqs = inputs.num_seqs
        batch_size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]
        turn = self.steps % 2
        self.steps += 1
        host, copied = self.packed_host[turn], self.packed_copied[turn]
        copied.synchronize()   # its copy two steps ago has run (normally long since)
        size = pack_decode_inputs(host.numpy(), inputs.input_ids, inputs.positions,
                                  inputs.slot_mapping, inputs.seq_lens, feed_rows,
                                  inputs.block_tables)
        self.packed[:size].copy_(host[:size], non_blocking=True)
        copied.record()
        self.graphs[batch_size].replay()
        return GraphOutputs(*(output[:num_seqs] for output in self.outputs[batch_size]))
