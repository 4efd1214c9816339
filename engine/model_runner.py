"""`ModelRunner`: owns the model and the KV cache tensors, executes one `SchedulerOutput`.

execute(): apply the scheduler's diff to the runner's request states, flatten the scheduled
tokens into one varlen batch (input_batch.py), run the model, sample the rows that reached the end
of their tokens, and return plain lists (`ModelRunnerOutput`).

A decode row with k draft tokens (`SchedulerOutput.scheduled_spec_decode_tokens`) is sampled at
each of its 1 + k positions (position j as if the drafts before j had been generated: same
seeded noise, penalties and min_tokens as plain decoding at that position). Draft j is accepted
while it equals the target's own sample at the position before it, so the committed tokens are
always the target's samples: greedy and seeded outputs are those of plain decoding.
`execute_and_score` also returns the logits of every scored position (`StepLogits`).
Steps with drafts replay the verify CUDA graphs (engine/verify_graphs.py) when captured
(`capture_cuda_graphs(verify_query_len=1 + gamma)`), else run eagerly; steps without drafts of
short rows (prompt tails after a prefix-cache hit, short prompts) replay the chunk graphs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer.engine.async_step import AsyncRunnerOutput
from deepinfer.engine.input_batch import CachedRequestState, StepInputs, build_step_inputs, feed_tokens
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.sampler import Sampler, SamplerOutput, greedy_argmax
from deepinfer.engine.sampling_metadata import build_sampling_metadata, samples_by_argmax
from deepinfer.engine.structured.manager import StructuredOutputManager
from deepinfer.engine.models.layers import set_kernel_config
from deepinfer.kernels.cpu_extension import cpu_extension
from deepinfer.kernels.settings import DEFAULT as DEFAULT_KERNEL_CONFIG
from deepinfer.kernels.settings import KernelConfig

if TYPE_CHECKING:
    from deepinfer.engine.cuda_graphs import GraphOutputs

logger = logging.getLogger(__name__)

# the largest step the chunk graphs replay (tokens): prompt tails of one request up to a few
# short prompts together; longer chunks are few and long enough to launch eagerly
CHUNK_GRAPH_TOKENS = 64


@dataclass
class StepLogits:
    """The logits a step sampled from, for callers that score tokens (tests, verifiers).

    logits: [num_logits_rows, vocab_size] float32 on the runner's device; after a CUDA-graph
        replay of a float32 model it is the graph's output buffer, valid until the next step
        (clone it to keep it).
    states: the requests that sampled, in row order (`StepInputs.sampling_states`).
    draft_token_ids: per request, its scored drafts: it owns 1 + k rows (None: one each).
    """

    logits: torch.Tensor
    states: list[CachedRequestState]
    draft_token_ids: list[list[int]] | None

    def of(self, request_id: str) -> torch.Tensor:
        """[1 + k, vocab_size] float32: the request's rows, position order."""
        index = [s.request_id for s in self.states].index(request_id)
        if self.draft_token_ids is None:
            return self.logits[index:index + 1]
        start = index + sum(len(d) for d in self.draft_token_ids[:index])
        return self.logits[start:start + 1 + len(self.draft_token_ids[index])]


class _WithDrafts(Sequence):
    """A request's token ids followed by some of its drafts, as a `SamplingState.token_ids`
    (length for the sampler's position, slices for penalties) without copying the context."""

    def __init__(self, token_ids: list[int], drafts: list[int]):
        self.token_ids, self.drafts = token_ids, drafts

    def __len__(self) -> int:
        return len(self.token_ids) + len(self.drafts)

    def __getitem__(self, index):
        return (self.token_ids + self.drafts)[index]


@dataclass
class _DraftPosition:
    """One scored position of a row with drafts, as a `SamplingState`."""

    sampling_params: Any
    seed: int
    token_ids: _WithDrafts
    num_prompt_tokens: int
    grammar: Any = None


class ModelRunner:
    """Args:
        model: a model from deepinfer.engine.models (forward / compute_logits / kv_cache_spec).
        num_blocks: KV blocks to allocate.
        block_size: tokens per block.
        device, dtype: where and in which dtype the KV cache lives.
        eos_token_ids: masked while a request is below its min_tokens.
        structured_output: builds the grammar matchers of requests with `so_args` (None: such
            requests are refused earlier, by EngineCore).
        kernel_config: the GPU kernel choices, handed to the model's layers
            (`EngineConfig.kernel`; `set_kernel_config` changes them).
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: frozenset[int],
                 structured_output: StructuredOutputManager | None = None,
                 kernel_config: KernelConfig = DEFAULT_KERNEL_CONFIG,
                 mm_cache_bytes: int = 256 << 20):
        self.model = model
        self.set_kernel_config(kernel_config)
        self.structured_output = structured_output
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.device = device
        spec = model.kv_cache_spec(dtype.itemsize)  # the model's per-layer KV layout
        shape = spec.kv_cache_shape(num_blocks, block_size)
        self.kv_cache_spec = spec
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(spec.num_layers)]
        if device.type == "cpu":
            cpu_extension()  # build the C++ CPU kernels now (first run only), not on a request
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # a multimodal model's image embeddings (engine/mm_encoder.py); EngineCore may give it
        # the KV store's embedding namespace
        self.mm = None
        if getattr(model, "is_multimodal", False):
            from deepinfer.engine.mm_encoder import MultiModalEmbedder

            self.mm = MultiModalEmbedder(model.encode_image, device, dtype, mm_cache_bytes)
        self.cuda_graphs = None  # engine.cuda_graphs.CudaGraphRunner after capture_cuda_graphs
        # engine.verify_graphs.VerifyGraphRunner: verify steps (rows of 1 + k tokens), or None
        self.verify_graphs = None
        # the same for steps without drafts of short rows (prompt tails), or None
        self.chunk_graphs = None
        # a drafter that runs on each step's hidden states (engine/spec/mtp.py), or None
        self.drafter = None
        # [S] int64: the last async step's sampled ids, where the next step's fed tokens are
        # read (engine/async_step.py); sized for max_num_seqs once graphs bake its address in
        self.last_sampled = torch.zeros(0, dtype=torch.int64, device=device)

    def set_kernel_config(self, kernel_config: KernelConfig) -> None:
        """Run the model's kernels with `kernel_config` from the next step (CUDA graphs
        captured before keep the old choices: capture them again)."""
        self.kernel_config = kernel_config
        set_kernel_config(self.model, kernel_config)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, *,
                            verify_query_len: int = 0,
                            max_num_batched_tokens: int | None = None) -> None:
        """Capture decode forwards at batch sizes up to max_num_seqs (CUDA only); decode-only
        steps then replay them (engine/cuda_graphs.py). Needs Triton: the torch attention
        backend synchronizes with the host, which a graph capture cannot hold.

        verify_query_len: 1 + num_speculative_tokens when speculating (0: off): also capture
            verify steps, rows of up to that many tokens, at flattened token-count buckets up
            to min(max_num_seqs * verify_query_len, max_num_batched_tokens)
            (engine/verify_graphs.py).
        Steps without drafts of rows of up to 16 tokens (8 for MLA), up to CHUNK_GRAPH_TOKENS
        tokens, replay chunk graphs (`VerifyGraphRunner(with_drafts=False)`).
        """
        from deepinfer.engine.cuda_graphs import CudaGraphRunner
        from deepinfer.kernels.backends import triton_available

        if not triton_available():
            logger.warning("CUDA graphs are off: Triton is not installed, and the torch "
                           "attention backend cannot be captured. Install triton for speed.")
            return
        if not getattr(self.model, "supports_cuda_graphs", True):
            logger.warning("CUDA graphs are off: %s reads values back to the host inside its "
                           "forward pass (torch MLA/MoE paths); decode runs eagerly.",
                           type(self.model).__name__)
            return
        self.last_sampled = torch.zeros(max(max_num_seqs, 1), dtype=torch.int64,
                                        device=self.device)
        runner = CudaGraphRunner(self.model, self.kv_caches, self.block_size, self.last_sampled,
                                 max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        runner.capture()
        self.cuda_graphs = runner
        budget = max_num_batched_tokens or max_num_seqs * max(verify_query_len, 1)
        limit = self._graph_row_limit()
        if verify_query_len > 1:
            if verify_query_len > limit:
                logger.warning("CUDA graphs: verify steps run eagerly: rows of %d tokens exceed "
                               "the graph-safe kernels' %d (lower num_speculative_tokens, or "
                               "raise mla_decode_max_query_len for MLA)", verify_query_len,
                               limit)
            else:
                self.verify_graphs = self._capture_rows_graphs(
                    max_num_seqs, max_model_len, verify_query_len, budget, with_drafts=True)
        if limit > 1:
            self.chunk_graphs = self._capture_rows_graphs(
                max_num_seqs, max_model_len, limit,
                min(max_num_batched_tokens or CHUNK_GRAPH_TOKENS, CHUNK_GRAPH_TOKENS),
                with_drafts=False)

    def _graph_row_limit(self) -> int:
        """The longest row the graph-safe multi-token attention kernels take."""
        from deepinfer.engine.kv_cache.spec import MLAAttentionSpec
        from deepinfer.engine.verify_graphs import MAX_VERIFY_QUERY_LEN

        if isinstance(self.kv_cache_spec, MLAAttentionSpec):   # absorbed MLA decode kernel
            return min(MAX_VERIFY_QUERY_LEN, self.kernel_config.mla_decode_max_query_len)
        return MAX_VERIFY_QUERY_LEN

    def _capture_rows_graphs(self, max_num_seqs: int, max_model_len: int, max_query_len: int,
                             max_num_batched_tokens: int, *, with_drafts: bool):
        """`capture_cuda_graphs`' verify (with_drafts) or chunk graphs: a captured
        `VerifyGraphRunner`, or None (no bucket, or a kernel that cannot be captured: those
        steps stay eager)."""
        from deepinfer.engine.verify_graphs import VerifyGraphRunner

        runner = VerifyGraphRunner(self.model, self.kv_caches, self.block_size,
                                   max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                   max_query_len=max_query_len,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   with_drafts=with_drafts)
        if not runner.token_buckets:
            return None
        try:
            runner.capture()
        except RuntimeError:
            logger.exception("CUDA graphs: capturing the %s steps failed; they run eagerly",
                             "verify" if with_drafts else "short-chunk")
            return None
        return runner

    def _update_states(self, scheduler_output: SchedulerOutput) -> list[CachedRequestState]:
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
        scheduled = []
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(
                request_id=new.request_id, token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=new.sampling_params, seed=new.seed,
                mm_inputs=list(new.mm_inputs))
            if new.sampling_params.so_args is not None:   # rebuilt from the output so far
                state.grammar = self.structured_output.new_matcher(
                    new.sampling_params.so_args, state.output_token_ids,
                    self.eos_token_ids | set(new.sampling_params.stop_token_ids))
            self.requests[new.request_id] = state
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            if cached.num_kept_block_ids is not None:   # rejected drafts freed lookahead blocks
                del state.block_ids[cached.num_kept_block_ids:]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            scheduled.append(state)
        scheduled.extend(self.requests[new.request_id]
                         for new in scheduler_output.scheduled_new_reqs)
        return scheduled

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward the scheduled tokens, sample, commit (module docstring)."""
        return self.execute_and_score(scheduler_output, score=False)[0]

    @torch.inference_mode()
    def execute_and_score(self, scheduler_output: SchedulerOutput, *, score: bool = True
                          ) -> tuple[ModelRunnerOutput, StepLogits | None]:
        """`execute`, also returning the logits sampled from (None when no row sampled, or
        `score` is False: `execute`'s greedy steps then commit a replayed graph's own argmax
        without making float32 logits)."""
        states = self._update_states(scheduler_output)
        if not states:
            return ModelRunnerOutput(), None
        num_scheduled = [scheduler_output.num_scheduled_tokens[s.request_id] for s in states]
        inputs = build_step_inputs(states, num_scheduled, self.block_size, self.device,
                                   draft_token_ids=scheduler_output.scheduled_spec_decode_tokens)
        embeds = self._image_embeds(scheduler_output, states, num_scheduled, inputs)
        hidden, graph_outputs = self._forward(inputs, inputs_embeds=embeds)
        sampled: dict[str, tuple[list[int], list | None]] = {}
        step_logits = None
        if inputs.sampling_states:
            sampled, logits = self._sample_step(inputs, hidden, graph_outputs,
                                                keep_logits=score)
            if logits is not None:
                step_logits = StepLogits(logits, inputs.sampling_states, inputs.draft_token_ids)
        if self.drafter is not None:   # after the commit: it drafts after the newest tokens
            self.drafter.after_step(inputs, hidden, states)
        for state, num_tokens in zip(states, num_scheduled):
            state.num_computed_tokens += num_tokens
        output = ModelRunnerOutput(
            req_ids=[s.request_id for s in states],
            sampled_token_ids=[sampled.get(s.request_id, ([], None))[0] for s in states],
            logprobs=[sampled.get(s.request_id, ([], None))[1] for s in states])
        return output, step_logits

    def _sample_step(self, inputs: StepInputs, hidden: torch.Tensor,
                     graph_outputs: GraphOutputs | None, *, keep_logits: bool = False
                     ) -> tuple[dict[str, tuple[list[int], list | None]], torch.Tensor | None]:
        """Sample a step's rows and commit them: (what `_sample` returns, the float32 logits
        sampled from, or None).

        Greedy requests without penalties, logprobs, pending min_tokens or grammar sample
        every row by one argmax: a verify step then needs no per-position sampling states (a
        host cost that grows with its drafts), and a step whose replayed graph scored exactly
        its sampled rows commits the graph's own argmax unless `keep_logits` (no float32 copy
        of the logits, no second argmax pass: tens of us of a verify step on the H200)."""
        graph_rows = self._graph_rows_sample(inputs, graph_outputs)
        if (inputs.draft_token_ids is not None or graph_rows) and all(
                s.grammar is None for s in inputs.sampling_states) and samples_by_argmax(
                    inputs.sampling_states, eos_token_ids=self.eos_token_ids):
            logits = None
            if graph_rows and not keep_logits:
                token_ids = graph_outputs.greedy_ids
            else:
                logits = self._logits(inputs, hidden, graph_outputs)
                token_ids = greedy_argmax(logits)
            return self._commit(inputs, SamplerOutput(token_ids.tolist(), None)), logits
        logits = self._logits(inputs, hidden, graph_outputs)
        return self._sample(inputs, logits), logits

    def _sample(self, inputs: StepInputs, logits: torch.Tensor
                ) -> dict[str, tuple[list[int], list | None]]:
        """Sample every logits row and commit each request's tokens to its state.

        Returns:
            request id -> (committed token ids, their logprobs or None).
        """
        row_states = self._row_states(inputs.sampling_states, inputs.draft_token_ids)
        metadata = build_sampling_metadata(row_states, self.device,
                                           eos_token_ids=self.eos_token_ids)
        if inputs.draft_token_ids is not None and any(
                s.grammar is not None for s in inputs.sampling_states):
            bitmask, grammar_rows = self._draft_bitmask(inputs.sampling_states,
                                                        inputs.draft_token_ids)
            metadata = dataclasses.replace(metadata, grammar_bitmask=bitmask,
                                           grammar_rows=grammar_rows)
        elif any(s.grammar is not None for s in row_states):
            bitmask, grammar_rows = self.structured_output.fill_bitmask(
                [s.grammar for s in row_states])
            metadata = dataclasses.replace(metadata, grammar_bitmask=bitmask,
                                           grammar_rows=grammar_rows)
        return self._commit(inputs, self.sampler(logits, metadata))

    def _commit(self, inputs: StepInputs, result: SamplerOutput
                ) -> dict[str, tuple[list[int], list | None]]:
        """Commit a step's samples (one per logits row) to its requests' states: with drafts
        `_commit_drafts`, else each row's token, its grammar advanced over it.

        Returns:
            request id -> (committed token ids, their logprobs or None).
        """
        if inputs.draft_token_ids is not None:
            return self._commit_drafts(inputs, result)
        sampled = {}
        for row, state in enumerate(inputs.sampling_states):
            token_id = result.sampled_token_ids[row]
            state.token_ids.append(token_id)
            if state.grammar is not None and not state.grammar.accept_token(token_id):
                logger.warning("request %s: sampled token %d outside its grammar",
                               state.request_id, token_id)
            logprobs = [result.logprobs[row]] if result.logprobs is not None else None
            sampled[state.request_id] = ([token_id], logprobs)
        return sampled

    def _draft_bitmask(self, states: list[CachedRequestState], drafts: list[list[int]]
                       ) -> tuple[Any, list[int]]:
        """The grammar bitmask of a step whose rows score drafts: a grammar request's row j
        allows what its grammar allows after its drafts before j (the matcher advanced over
        them, then rolled back). Rows after a draft the grammar refuses stay unmasked: that
        draft never equals the target's masked sample before it, so nothing from them is
        committed. So do rows after a draft that ends the grammar (its stop token: the
        request ends there, and a terminated matcher has no next mask).

        Returns:
            ([num_rows, ceil(V / 32)] int32 bitmask, the masked rows).
        """
        bitmask = self.structured_output.backend.allocate_bitmask(
            sum(1 + len(d) for d in drafts))
        masked, row = [], 0
        for state, draft_ids in zip(states, drafts):
            matcher = state.grammar
            if matcher is not None:
                advanced = 0
                for j in range(len(draft_ids) + 1):
                    matcher.fill_bitmask(bitmask, row + j)
                    masked.append(row + j)
                    if j == len(draft_ids) or not matcher.accept_token(draft_ids[j]):
                        break
                    advanced += 1
                    if matcher.is_terminated():
                        break
                matcher.rollback(advanced)
            row += 1 + len(draft_ids)
        return bitmask, masked

    @staticmethod
    def _commit_drafts(inputs: StepInputs, result: SamplerOutput
                       ) -> dict[str, tuple[list[int], list | None]]:
        """`_sample`'s commit when rows scored drafts: a request's first m drafts are accepted
        while each equals the target's sample before it; it commits those samples and the next
        one (the correction, or the bonus token when all k drafts pass), and advances its
        grammar matcher over them."""
        sampled, row = {}, 0
        for state, draft_ids in zip(inputs.sampling_states, inputs.draft_token_ids):
            scored = result.sampled_token_ids[row:row + 1 + len(draft_ids)]
            num_accepted = 0
            while (num_accepted < len(draft_ids)
                   and draft_ids[num_accepted] == scored[num_accepted]):
                num_accepted += 1
            committed = scored[:num_accepted + 1]
            state.token_ids.extend(committed)
            for token_id in committed if state.grammar is not None else ():
                if state.grammar.is_terminated():   # past its stop token: the request ends
                    break
                if not state.grammar.accept_token(token_id):
                    logger.warning("request %s: committed token %d outside its grammar",
                                   state.request_id, token_id)
                    break
            logprobs = (result.logprobs[row:row + num_accepted + 1]
                        if result.logprobs is not None else None)
            sampled[state.request_id] = (committed, logprobs)
            row += len(scored)
        return sampled

    @staticmethod
    def _row_states(states: list[CachedRequestState], drafts: list[list[int]] | None) -> list:
        """One `SamplingState` per logits row: the request itself for its first position, a
        `_DraftPosition` holding the drafts before position j for its j-th."""
        if drafts is None:
            return states
        rows: list = []
        for state, draft_ids in zip(states, drafts):
            rows.append(state)
            rows.extend(_DraftPosition(state.sampling_params, state.seed,
                                       _WithDrafts(state.token_ids, draft_ids[:j]),
                                       state.num_prompt_tokens)
                        for j in range(1, len(draft_ids) + 1))
        return rows

    def _image_embeds(self, scheduler_output: SchedulerOutput,
                      states: list[CachedRequestState], num_scheduled: list[int],
                      inputs: StepInputs, feed_rows: np.ndarray | None = None
                      ) -> torch.Tensor | None:
        """[num_tokens, hidden] input embeddings with the scheduled image tokens' rows in
        place (engine/mm_encoder.py), or None for a step without image tokens."""
        if self.mm is None or not scheduler_output.scheduled_encoder_inputs:
            return None
        device_inputs = inputs.on_device()
        if feed_rows is not None:   # tokens sampled by the step in flight, before embedding
            feed_tokens(device_inputs.input_ids, feed_rows, self.last_sampled)
        return self.mm.inputs_embeds(self.model.embed_tokens, device_inputs.input_ids, states,
                                     num_scheduled, inputs.query_start_loc,
                                     self.model.image_token_id,
                                     scheduler_output.scheduled_encoder_inputs)

    def _forward(self, inputs: StepInputs, feed_rows: np.ndarray | None = None, *,
                 inputs_embeds: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, GraphOutputs | None]:
        """(hidden [num_tokens, hidden_size], the graph's outputs): a captured graph's replay
        for a decode step it covers (hidden, logits and greedy ids of every row), else the
        eager forward (and None).

        feed_rows: [num_tokens] int64 or None (`AsyncRunnerOutput.feed_rows`): tokens whose id
            is `last_sampled[row]` (row >= 0), still on the device.
        """
        if (inputs_embeds is None and self.cuda_graphs is not None
                and self.cuda_graphs.can_run(inputs)):
            outputs = self.cuda_graphs.run(inputs, feed_rows)
            return outputs.hidden, outputs
        for rows_graphs in (self.verify_graphs, self.chunk_graphs):
            if (inputs_embeds is None and feed_rows is None and rows_graphs is not None
                    and rows_graphs.can_run(inputs)):
                outputs = rows_graphs.run(inputs)
                return outputs.hidden, outputs
        device_inputs = inputs.on_device()
        if inputs_embeds is not None:   # image rows in place (ids were fed by _image_embeds)
            return self.model(device_inputs.input_ids, device_inputs.positions, self.kv_caches,
                              device_inputs.attn_metadata, inputs_embeds=inputs_embeds), None
        if feed_rows is not None:
            feed_tokens(device_inputs.input_ids, feed_rows, self.last_sampled)
        return self.model(device_inputs.input_ids, device_inputs.positions, self.kv_caches,
                          device_inputs.attn_metadata), None

    def _store_sampled(self, token_ids: torch.Tensor) -> None:
        """Keep a step's sampled ids ([B] int64, device) in `last_sampled` for the next step."""
        if self.last_sampled.shape[0] < token_ids.shape[0]:
            if self.cuda_graphs is not None:   # graphs hold its address; max_num_seqs bounds B
                raise RuntimeError(f"{token_ids.shape[0]} sampled rows exceed last_sampled "
                                   f"({self.last_sampled.shape[0]})")
            self.last_sampled = torch.empty_like(token_ids)
        self.last_sampled[:token_ids.shape[0]].copy_(token_ids)

    @staticmethod
    def _graph_rows_sample(inputs: StepInputs, graph_outputs: GraphOutputs | None) -> bool:
        """True when a replayed graph's rows are the sampled rows: every token of the step
        is a scored position (logits_indices is 0..num_tokens-1: a decode step whose every
        sequence samples, or a verify step whose rows score all their 1 + k tokens). A 1-token
        chunk in the middle of a prompt is a decode-shaped row that does not sample."""
        return (graph_outputs is not None
                and inputs.logits_indices.size == inputs.input_ids.size)

    def _logits(self, inputs: StepInputs, hidden: torch.Tensor,
                graph_outputs: GraphOutputs | None) -> torch.Tensor:
        """[num_sampling, vocab_size] float32 logits of the rows that sample: the graph's own
        when they are its rows, else the LM head over `hidden[logits_indices]` (after a graph
        replay only the indices are copied to the device, not the whole batch)."""
        if self._graph_rows_sample(inputs, graph_outputs):
            return graph_outputs.logits.float()
        return self.model.compute_logits(hidden[inputs.logits_indices_on_device()])

    @torch.inference_mode()
    def execute_async(self, scheduler_output: SchedulerOutput,
                      previous: AsyncRunnerOutput | None) -> AsyncRunnerOutput:
        """`execute` for async scheduling (engine/async_step.py): launch the step and return
        without waiting for the device. Tokens `previous` sampled are still on the device: the
        runner holds -1 for them, and the decode rows that feed them gather them on the device.
        The requests must have no grammar and no penalties (those need the token values), and
        no draft tokens (their acceptance needs the sampled values)."""
        if scheduler_output.scheduled_spec_decode_tokens:
            raise ValueError("draft tokens were scheduled for an asynchronous step; run steps "
                             "with drafts through execute() (async scheduling off).")
        states = self._update_states(scheduler_output)
        if not states:
            return AsyncRunnerOutput.empty()
        num_scheduled = [scheduler_output.num_scheduled_tokens[s.request_id] for s in states]
        inputs = build_step_inputs(states, num_scheduled, self.block_size, self.device)
        feed_rows = previous.feed_rows(states, num_scheduled) if previous is not None else None
        embeds = self._image_embeds(scheduler_output, states, num_scheduled, inputs, feed_rows)
        hidden, graph_outputs = self._forward(inputs, feed_rows, inputs_embeds=embeds)
        token_ids = logprobs = None
        if inputs.sampling_states:
            metadata = build_sampling_metadata(inputs.sampling_states, self.device,
                                               eos_token_ids=self.eos_token_ids)
            if metadata.argmax_only and self._graph_rows_sample(inputs, graph_outputs):
                token_ids = graph_outputs.greedy_ids   # argmax ran inside the graph, and
            else:                                      # wrote last_sampled there
                logits = self._logits(inputs, hidden, graph_outputs)
                token_ids, logprobs = self.sampler.sample_on_device(logits, metadata)
                self._store_sampled(token_ids)
            for state in inputs.sampling_states:
                state.token_ids.append(-1)  # a placeholder until the step is resolved
        for state, num_tokens in zip(states, num_scheduled):
            state.num_computed_tokens += num_tokens
        return AsyncRunnerOutput.launch([s.request_id for s in states],
                                        inputs.sampling_states, token_ids, logprobs)

    # ---- KV blocks in and out, for the KV store (engine/kv_transfer.py) --------------------
    @property
    def kv_block_dim(self) -> int:
        """The block axis of each layer's KV tensor (1 for [2, num_blocks, ...], 0 for MLA's
        [num_blocks, ...]): the axis whose size follows the block count."""
        one = self.kv_cache_spec.kv_cache_shape(1, self.block_size)
        two = self.kv_cache_spec.kv_cache_shape(2, self.block_size)
        return next(axis for axis, (a, b) in enumerate(zip(one, two)) if a != b)

    @torch.inference_mode()
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy blocks out of the KV cache, all layers.

        Returns:
            [len(block_ids), num_layers, *block_shape] on CPU in the cache dtype, where
            block_shape is one layer's tensor shape without its block axis (e.g. [2,
            block_size, num_kv_heads, head_dim] for K/V, [block_size, latent_dim] for MLA).
        """
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self._gather_kv_blocks(index).cpu()

    @torch.inference_mode()
    def start_read_kv_blocks(self, block_ids: list[int]
                             ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """`read_kv_blocks` without waiting for the device: on CUDA the gather and the copy to
        the host are queued on the current stream behind the work already launched (a step in
        flight), and the host returns at once.

        Returns:
            (blocks, ready). blocks: [len(block_ids), num_layers, *block_shape] on CPU in the
            cache dtype (pinned memory on CUDA). ready: on CUDA, an event recorded after the
            copy; the blocks hold their values only once it has completed (`ready.query()` /
            `ready.synchronize()`, which sleeps rather than spins). None on CPU, where the
            blocks are already there.
        """
        if self.device.type != "cuda":
            return self.read_kv_blocks(block_ids), None
        gathered = self._gather_kv_blocks(self._device_index(block_ids))
        blocks = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        blocks.copy_(gathered, non_blocking=True)
        ready = torch.cuda.Event(blocking=True)
        ready.record()
        return blocks, ready

    def _device_index(self, block_ids: list[int]) -> torch.Tensor:
        """block_ids as int64 on the cache's device; on CUDA through pinned memory, because a
        copy from pageable memory would wait for the step in flight."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _gather_kv_blocks(self, index: torch.Tensor) -> torch.Tensor:
        """[len(index), num_layers, *block_shape] on the cache's device: the blocks `index`
        (int64 on that device) of every layer."""
        axis = self.kv_block_dim
        per_layer = [kv.index_select(axis, index).movedim(axis, 0) for kv in self.kv_caches]
        return torch.stack(per_layer, dim=1)

    @torch.inference_mode()
    def write_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Overwrite blocks of the KV cache, all layers.

        Args:
            block_ids: destination block ids.
            blocks: [len(block_ids), num_layers, *block_shape] in the cache dtype (as
                `read_kv_blocks` returns), on any device.
        """
        axis = self.kv_block_dim
        index = self._device_index(block_ids)
        blocks = blocks.to(self.device, non_blocking=True)  # async from pinned staging memory
        for layer, kv in enumerate(self.kv_caches):
            kv.index_copy_(axis, index, blocks[:, layer].movedim(0, axis))
