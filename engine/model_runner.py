"""`ModelRunner`: owns the model and the KV cache tensors, executes one `SchedulerOutput`.

execute(): apply the scheduler's diff to the runner's request states, flatten the scheduled
tokens into one varlen batch (input_batch.py), run the model, sample the rows that reached the end
of their tokens, and return plain lists (`ModelRunnerOutput`).
"""

from __future__ import annotations

import torch

from engine.input_batch import CachedRequestState, build_step_inputs
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.sampler import Sampler
from engine.sampling_metadata import build_sampling_metadata
from kernels.cpu_extension import cpu_extension


class ModelRunner:
    """Args:
        model: a model from engine.models (forward / compute_logits / kv_cache_shape).
        num_blocks: KV blocks to allocate.
        block_size: tokens per block.
        device, dtype: where and in which dtype the KV cache lives.
        eos_token_ids: masked while a request is below its min_tokens.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: frozenset[int]):
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.device = device
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(model.num_layers)]
        if device.type == "cpu":
            cpu_extension()  # build the C++ CPU kernels now (first run only), not on a request
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}

    def _update_states(self, scheduler_output: SchedulerOutput) -> list[CachedRequestState]:
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
        scheduled = []
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(
                request_id=new.request_id, token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=new.sampling_params, seed=new.seed)
            self.requests[new.request_id] = state
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            scheduled.append(state)
        scheduled.extend(self.requests[new.request_id]
                         for new in scheduler_output.scheduled_new_reqs)
        return scheduled

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        states = self._update_states(scheduler_output)
        if not states:
            return ModelRunnerOutput()
        num_scheduled = [scheduler_output.num_scheduled_tokens[s.request_id] for s in states]
        inputs = build_step_inputs(states, num_scheduled, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                            inputs.attn_metadata)
        sampled: dict[str, tuple[list[int], list | None]] = {}
        if inputs.sampling_states:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            metadata = build_sampling_metadata(inputs.sampling_states, self.device,
                                               eos_token_ids=self.eos_token_ids)
            result = self.sampler(logits, metadata)
            for row, state in enumerate(inputs.sampling_states):
                token_id = result.sampled_token_ids[row]
                state.token_ids.append(token_id)
                logprobs = [result.logprobs[row]] if result.logprobs is not None else None
                sampled[state.request_id] = ([token_id], logprobs)
        for state, num_tokens in zip(states, num_scheduled):
            state.num_computed_tokens += num_tokens
        return ModelRunnerOutput(
            req_ids=[s.request_id for s in states],
            sampled_token_ids=[sampled.get(s.request_id, ([], None))[0] for s in states],
            logprobs=[sampled.get(s.request_id, ([], None))[1] for s in states])
