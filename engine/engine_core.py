"""`EngineCore`: one worker's step loop body — schedule, execute, update, detokenize.

Single owner of the scheduler and block state: only `step()`, `add_request()` and
`abort_requests()` touch them, and callers (LLM, AsyncLLM) run those on one thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from pathlib import Path

import torch

from engine import loader
from engine.config import EngineConfig, ModelConfig
from engine.errors import PromptTooLongError
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.spec import FullAttentionSpec, num_blocks_for_budget
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, SchedulerStats
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def resolve_device_dtype(config: ModelConfig) -> tuple[torch.device, torch.dtype]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
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


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = loader.resolve_model_dir(config.model.model, config.model.cache_dir)
        self.model_name = served_model_name(config.model)
        self.device, self.dtype = resolve_device_dtype(config.model)
        hf_config = loader.load_hf_config(self.model_dir)
        self.tokenizer = loader.load_tokenizer(self.model_dir)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.tokenizer)
        model = loader.load_model(self.model_dir, self.dtype, self.device)

        cache = config.cache
        spec = FullAttentionSpec(model.num_layers, model.num_kv_heads, model.head_dim,
                                 self.dtype.itemsize)
        num_blocks = cache.num_blocks or num_blocks_for_budget(
            spec, cache.block_size, cache.kv_cache_memory_bytes)
        self.max_model_len = self._max_model_len(hf_config, num_blocks * cache.block_size)
        fingerprint = hashlib.blake2b(
            (self.model_dir / "config.json").read_bytes() + str(self.dtype).encode()
            + cache.block_size.to_bytes(4, "little"), digest_size=8).digest()
        self.model_runner = ModelRunner(model, num_blocks, cache.block_size, self.device,
                                        self.dtype, self.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, hash_extra=fingerprint))
        self.output_processor = OutputProcessor(self.tokenizer)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB), max_model_len=%d",
                    num_blocks, cache.block_size,
                    num_blocks * spec.block_bytes(cache.block_size) / 2**20, self.max_model_len)

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
                     request_id: str | None = None) -> Request:
        """Validate a tokenized prompt and build its `Request`.

        Raises:
            PromptTooLongError: prompt (+ max_tokens) does not fit max_model_len.
            ValueError: empty prompt or token ids outside the vocabulary.
        """
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty; give at least one token.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size}); check the token ids.")
        max_tokens = params.max_tokens
        if num_prompt + (max_tokens or 1) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt} tokens and max_tokens={max_tokens or 1}; together "
                f"they exceed max_model_len={self.max_model_len}. Shorten the prompt, lower "
                "max_tokens, or raise --max-model-len.")
        limit = self.max_model_len if max_tokens is None else num_prompt + max_tokens
        seed = params.resolved_seed()
        if params.seed is None and self.config.model.seed is not None:
            seed = self.config.model.seed
        return Request(request_id=request_id or uuid.uuid4().hex, prompt_token_ids=list(
            prompt_token_ids), sampling_params=params, eos_token_ids=self.eos_token_ids,
            max_total_tokens=limit, seed=seed)

    def add_request(self, request: Request) -> None:
        """Raises QueueFullError when the waiting queue is at its cap."""
        self.scheduler.add_request(request)
        self.output_processor.add_request(request.request_id, request.prompt_token_ids,
                                          request.sampling_params, request.arrival_time)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests at once and free their KV blocks (client gone)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished_requests > 0

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update, detokenize: one forward pass over the batch."""
        if not self.scheduler.has_work():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        request_outputs, stopped_ids = self.output_processor.process(
            core_outputs, time.monotonic())
        self.scheduler.finish_requests(stopped_ids, RequestStatus.FINISHED_STOPPED)
        return request_outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
