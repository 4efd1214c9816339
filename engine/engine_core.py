"""`EngineCore`: one worker's step loop body — schedule, execute, update, detokenize.

Single owner of the scheduler and block state: only `step()`, `add_request()` and
`abort_requests()` touch them, and callers (LLM, AsyncLLM) run those on one thread.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from pathlib import Path

import torch

from deepinfer.engine import loader
from deepinfer.engine.async_step import AsyncStepper
from deepinfer.engine.config import EngineConfig, ModelConfig
from deepinfer.engine.errors import PromptTooLongError, outside_vocabulary
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_transfer import IDLE_WAIT_S, KVTransfer, NoKVTransfer, model_fingerprint
from deepinfer.engine.kv_cache.spec import num_blocks_for_budget
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput, SchedulerStats
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.sampling_params import SamplingParams, SamplingParamsError
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.structured.manager import grammar_manager

logger = logging.getLogger(__name__)



def resolve_device_dtype(config: ModelConfig) -> tuple[torch.device, torch.dtype]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={config.device!r} but torch sees no CUDA device (a CPU-only "
                         "torch build, or no GPU visible); use --device cpu or auto.")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, config.dtype)
    return device, dtype


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(config: ModelConfig) -> str:
    """The name clients use: --served-model-name, else the model path's name (no .gguf)."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def _eos_token_ids(model_dir, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's."""
    ids = set()
    path = model_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # KV cache size on CPU when none is configured


class EngineCore:
    """Args:
        config: the engine configuration.
        model: an already built model on the configured device and dtype (benchmarks build
            one in memory); None loads the weights from `config.model.model`, whose directory
            still provides config.json and the tokenizer.
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None):
        self.config = config
        self.model_dir = loader.resolve_model_dir(config.model.model, config.model.cache_dir)
        self.model_name = served_model_name(config.model)
        self.device, self.dtype = resolve_device_dtype(config.model)
        hf_config = loader.load_hf_config(self.model_dir)
        self.tokenizer = loader.load_tokenizer(self.model_dir)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.tokenizer)
        if model is None:
            model = loader.load_model(self.model_dir, self.dtype, self.device)

        cache = config.cache
        spec = model.kv_cache_spec(self.dtype.itemsize)  # FullAttentionSpec, MLAAttentionSpec
        num_blocks = cache.num_blocks or num_blocks_for_budget(
            spec, cache.block_size, self._kv_cache_budget_bytes(model, spec))
        self.max_model_len = self._max_model_len(hf_config, num_blocks * cache.block_size)
        fingerprint = model_fingerprint(self.model_dir, self.dtype, cache.block_size)
        self.structured_output = grammar_manager(
            self.tokenizer, self.vocab_size, self.eos_token_ids,
            config.model.structured_outputs_backend)
        self.model_runner = ModelRunner(model, num_blocks, cache.block_size, self.device,
                                        self.dtype, self.eos_token_ids,
                                        structured_output=self.structured_output)
        if self.device.type == "cuda" and not config.model.enforce_eager:
            self.model_runner.capture_cuda_graphs(config.scheduler.max_num_seqs,
                                                  self.max_model_len)
        self.kv_transfer = self._build_kv_transfer(fingerprint)
        self.scheduler = Scheduler(config.scheduler, KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, hash_extra=fingerprint),
            save_kv_blocks=isinstance(self.kv_transfer, KVTransfer)
            and config.kv_transfer.role != "decode")
        self.output_processor = OutputProcessor(self.tokenizer)
        async_scheduling = config.scheduler.async_scheduling
        if async_scheduling is None:  # default: on where the device runs apart from the host
            async_scheduling = self.device.type == "cuda"
        self.async_steps = AsyncStepper(self) if async_scheduling else None
        logger.info("KV cache: %s, %d bytes/token; %d blocks x %d tokens (%.1f MiB), "
                    "max_model_len=%d", type(spec).__name__, spec.bytes_per_token(), num_blocks,
                    cache.block_size, num_blocks * spec.block_bytes(cache.block_size) / 2**20,
                    self.max_model_len)

    def _kv_cache_budget_bytes(self, model: torch.nn.Module, spec) -> int:
        """The KV cache's bytes: as configured, else 1 GiB on CPU, else on CUDA what
        gpu_memory_utilization leaves after a profiling step (engine/gpu_memory.py)."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        from deepinfer.engine.gpu_memory import profile_kv_cache_budget

        scheduler = self.config.scheduler
        return profile_kv_cache_budget(
            model, spec, dtype=self.dtype, device=self.device, block_size=cache.block_size,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_num_seqs=scheduler.max_num_seqs,
            gpu_memory_utilization=cache.gpu_memory_utilization)

    def _build_kv_transfer(self, fingerprint: bytes) -> KVTransfer | NoKVTransfer:
        """The KV store bridge, or a stand-in when there is no store (or no prefix caching:
        block hashes are the store's keys)."""
        config = self.config.kv_transfer
        if not config.enabled:
            return NoKVTransfer()
        if not self.config.cache.enable_prefix_caching:
            if config.role != "both":
                raise ValueError(f"role={config.role} needs prefix caching (block hashes are the "
                                 "KV store's keys); do not disable it.")
            logger.warning("prefix caching is off, so the KV store %s is not used",
                           config.kv_store)
            return NoKVTransfer()
        logger.info("KV store: %s (role %s, model fingerprint %s)",
                    re.sub(r"//[^@/]*@", "//***@", config.kv_store), config.role,
                    fingerprint.hex())
        return KVTransfer(config, self.model_runner, fingerprint, self.config.cache.block_size)

    def close(self) -> None:
        """Release the KV store connection and its thread."""
        self.kv_transfer.close()

    def _max_model_len(self, hf_config, kv_capacity_tokens: int) -> int:
        model_limit = getattr(hf_config, "max_position_embeddings", None) or kv_capacity_tokens
        wanted = self.config.model.max_model_len or model_limit
        if wanted > model_limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's context window "
                             f"({model_limit} tokens); lower --max-model-len.")
        if wanted > kv_capacity_tokens:
            if self.config.model.max_model_len:
                raise ValueError(
                    f"max_model_len={wanted} needs more KV cache than the {kv_capacity_tokens} "
                    "tokens allocated; lower --max-model-len or give the KV cache more memory.")
            wanted = kv_capacity_tokens
        return wanted

    # ---- requests -------------------------------------------------------------------------
    def make_request(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None, *,
                     kv_transfer_params: dict | None = None) -> Request:
        """Validate a tokenized prompt and build its `Request`.

        `kv_transfer_params`: prefill/decode disaggregation (engine/kv_transfer.py), e.g.
        `{"do_remote_decode": True}` to store the prompt's blocks for a decode worker.

        Raises:
            PromptTooLongError: prompt (+ max_tokens) does not fit max_model_len.
            ValueError: empty prompt, or prompt / stop token ids outside the vocabulary.
            GrammarError (a ValueError): `so_args` cannot be compiled (compiles it unless
                cached; `AsyncLLM` compiles it in a worker thread first).
        """
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty; give at least one token.")
        if message := outside_vocabulary(prompt_token_ids, self.vocab_size, "the prompt"):
            raise ValueError(message)
        # a stop id outside the vocabulary could never be generated: it would never fire
        if message := outside_vocabulary(params.stop_token_ids, self.vocab_size,
                                         "stop_token_ids"):
            raise SamplingParamsError(message, "stop_token_ids")
        max_tokens = params.max_tokens
        if num_prompt + (max_tokens or 1) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt} tokens and max_tokens={max_tokens or 1}; together "
                f"they exceed max_model_len={self.max_model_len}. Shorten the prompt, lower "
                "max_tokens, or raise --max-model-len.")
        limit = self.max_model_len if max_tokens is None else num_prompt + max_tokens
        if params.so_args is not None:
            self.structured_output.compile(params.so_args)
        seed = params.resolved_seed()
        if params.seed is None and self.config.model.seed is not None:
            seed = self.config.model.seed
        return Request(request_id=request_id or uuid.uuid4().hex, prompt_token_ids=list(
            prompt_token_ids), sampling_params=params, eos_token_ids=self.eos_token_ids,
            max_total_tokens=limit, seed=seed, kv_transfer_params=kv_transfer_params)

    def add_request(self, request: Request) -> None:
        """Raises QueueFullError when the waiting queue is at its cap. With a KV store, the
        request waits while its stored prompt blocks are fetched."""
        self.scheduler.add_request(request)
        if self.async_steps is not None:
            self.async_steps.add_request(request)
        self.output_processor.add_request(request.request_id, request.prompt_token_ids,
                                          request.sampling_params, request.arrival_time)
        self._fetch_remote_kv(request)

    def _fetch_remote_kv(self, request: Request) -> None:
        """Start fetching the request's stored blocks past its local hits, if any (new and
        preempted requests)."""
        if self.kv_transfer.add_request(request, self.scheduler.kv_cache_manager):
            self.scheduler.wait_for_remote_kv(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests at once and free their KV blocks (client gone)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.kv_transfer.discard(request_ids)
        for request_id in request_ids:
            self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished_requests > 0 or self.kv_transfer.has_held_outputs()
                or (self.async_steps is not None and self.async_steps.in_flight is not None))

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update, detokenize: one forward pass over the batch. KV store
        traffic: fetched requests rejoin the queue, fetched blocks are written before the
        forward pass, full prompt blocks are saved after it (engine/kv_transfer.py). With async
        scheduling the step overlaps the next one's host work (engine/async_step.py)."""
        if self.async_steps is not None and self.async_steps.wants_step():
            return self.async_steps.step()
        self.scheduler.remote_kv_ready(self.kv_transfer.finished_loads())
        if not self.scheduler.has_work():
            self.kv_transfer.wait(IDLE_WAIT_S)  # only block saves of a hand-off in flight
            return self.kv_transfer.hold_finished([])
        scheduler_output = self.scheduler.schedule()
        self.kv_transfer.load_blocks(scheduler_output.kv_loads)
        runner_output = self.model_runner.execute(scheduler_output)
        self.kv_transfer.save_blocks(scheduler_output.kv_saves)
        request_outputs = self.finish_step(scheduler_output, runner_output)
        if scheduler_output.is_empty:
            self.kv_transfer.wait(IDLE_WAIT_S)  # only fetches in flight: do not spin
        return self.kv_transfer.hold_finished(request_outputs)

    def finish_step(self, scheduler_output: SchedulerOutput,
                    runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """A step's end, shared by the sync and the async step: the scheduler takes the
        sampled tokens, the output processor detokenizes and applies stop strings, and what
        preemption evicted is looked up in the KV store again."""
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        request_outputs, stopped_ids = self.output_processor.process(
            core_outputs, time.monotonic())
        self.scheduler.finish_requests(stopped_ids, RequestStatus.FINISHED_STOPPED)
        for request in self.scheduler.take_preempted():
            self._fetch_remote_kv(request)
        return request_outputs

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        stats.kv_store = self.kv_transfer.get_stats()
        return stats
